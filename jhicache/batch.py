"""Batch: the host-side plan of one forward step, and its bucketed inputs for the jitted model."""

from __future__ import annotations

import dataclasses
import jax
import numpy as np

from jhicache.cache import LoadTicket
from jhicache.cache.transfer import pow2_bucket
from jhicache.request import Request
from jhicache.models import AttentionMetadata, metadata_arrays, pack_token_array, put_int32


@dataclasses.dataclass(frozen=True)
class Chunk:
    """`length` tokens of `request.tokens` starting at `start` are computed this step."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.start + self.length == self.request.num_tokens


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
    lengths = [c.length for c in chunks]
    arrays = metadata_arrays(
        [c.start for c in chunks], lengths, [c.request.device_pages for c in chunks],
        page_size=page_size, num_tokens=num_tokens, num_reqs=num_reqs,
        max_pages=pow2_bucket(max(len(c.request.device_pages) for c in chunks), 4), decode_only=batch.is_decode,
    )
    tokens = pack_token_array([c.request.token_slice(c.start, c.start + c.length) for c in chunks], num_tokens)
    last_index = np.zeros(num_reqs, np.int32)
    last_index[: len(chunks)] = np.cumsum(lengths) - 1
    # The step's eight host arrays in one transfer (see put_int32): each separate transfer costs
    # a dispatch of its own, hundreds of microseconds of host time per step on the H200.
    put = put_int32({**arrays, "tokens": tokens, "last_index": last_index})
    tokens, last_index = put.pop("tokens"), put.pop("last_index")
    return tokens, AttentionMetadata(**put, decode_only=batch.is_decode), last_index
