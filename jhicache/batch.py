"""Batch: the host-side plan of one forward step, and its bucketed inputs for the jitted model."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from jhicache.cache import LoadTicket
from jhicache.cache.transfer import pow2_bucket
from jhicache.request import Request
from models import AttentionMetadata, build_metadata, pack_tokens


@dataclasses.dataclass(frozen=True)
class Chunk:
    """`length` tokens of `request.tokens` starting at `start` are computed this step."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.start + self.length == len(self.request.tokens)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step: the chunks to compute, whether it is decode-only, and a load-back to wait on."""

    chunks: list[Chunk]
    is_decode: bool
    tickets: tuple[LoadTicket, ...] = ()  # load-backs whose pages this step reads

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


def model_inputs(batch: Batch, page_size: int) -> tuple[jax.Array, AttentionMetadata, jax.Array]:
    """Token ids [T], attention metadata and the row of each request's last token [B], bucketed."""
    chunks = batch.chunks
    num_reqs = pow2_bucket(len(chunks), 4 if batch.is_decode else 1)
    num_tokens = num_reqs if batch.is_decode else pow2_bucket(batch.num_tokens, 16)
    meta = build_metadata(
        [c.start for c in chunks], [c.length for c in chunks], [c.request.device_pages for c in chunks],
        page_size=page_size, num_tokens=num_tokens, num_reqs=num_reqs,
        max_pages=pow2_bucket(max(len(c.request.device_pages) for c in chunks), 4), decode_only=batch.is_decode,
    )
    tokens = pack_tokens([c.request.tokens[c.start : c.start + c.length] for c in chunks], num_tokens)
    last_index = np.zeros(num_reqs, np.int32)
    last_index[: len(chunks)] = np.cumsum([c.length for c in chunks]) - 1
    return tokens, meta, jnp.asarray(last_index)
