"""AttentionMetadata: where a step's tokens sit in the paged KV cache, and its host-side builder."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch layout. T counts token rows (padded), B request rows (padded).

    `decode_only` is static (a pytree meta field): True means one token per request with
    T == B, so token row b belongs to request b and the decode kernel is used.
    """

    positions: jax.Array  # [T] int32 position of each token in its request (0 for padding)
    token_req: jax.Array  # [T] int32 request row of each token, -1 = padding
    page_table: jax.Array  # [B, max_pages] int32 page ids per request (0 where unused)
    seq_lens: jax.Array  # [B] int32 tokens cached after this step (prefix + new), 0 = padding
    query_start: jax.Array  # [B] int32 first token row of each request
    query_lens: jax.Array  # [B] int32 new tokens of each request, 0 = padding
    # With a host tier: a flag per layer that the loads' copy stream sets once that layer's pages
    # have landed, and the newest load this step reads (0: none); each layer's attention waits,
    # on the device, until its flag reaches it (`LayerGate`). None: nothing is ever loaded.
    load_flags: jax.Array | None = None  # [num_layers + 1] int32
    load_seq: jax.Array | None = None  # [1] int32
    decode_only: bool = False

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["positions", "token_req", "page_table", "seq_lens", "query_start", "query_lens",
                 "load_flags", "load_seq"],
    meta_fields=["decode_only"],
)


def build_metadata(
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    page_ids: Sequence[Sequence[int]],
    *,
    page_size: int,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    max_pages: int | None = None,
    decode_only: bool = False,
) -> AttentionMetadata:
    """Lays requests' new tokens out back to back, padded to the given bucket sizes.

    Request b has `prefix_lens[b]` tokens already cached and `new_lens[b]` new ones; its
    pages `page_ids[b]` must cover prefix + new tokens. Unset sizes default to the exact fit.
    With `decode_only`, every new_len must be 1 and T is padded to B.
    """
    arrays = metadata_arrays(prefix_lens, new_lens, page_ids, page_size=page_size,
                             num_tokens=num_tokens, num_reqs=num_reqs, max_pages=max_pages,
                             decode_only=decode_only)
    return AttentionMetadata(**put_int32(arrays), decode_only=decode_only)


def put_int32(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Small int32 host arrays -> device arrays of the same shapes, in one transfer.

    Each separate transfer costs a dispatch of its own, and one batched `jax.device_put` still
    pays per array; one packed buffer passed to a jitted unpack rides jit's C++ dispatch path
    instead, once for all the model's inputs (measured: benchmarks/LOG.md, 2026-11-30).
    """
    if not arrays:
        return {}
    host = {name: np.asarray(a) for name, a in arrays.items()}
    for name, a in host.items():
        # only these can hold values int32 cannot
        wide = a.dtype.itemsize > 4 or a.dtype == np.uint32
        if a.dtype.kind not in "iub" or (wide and a.size
                                         and (a.min() < -(2**31) or a.max() >= 2**31)):
            raise ValueError(f"put_int32: {name} must hold integers in the int32 range, "
                             f"got {a.dtype}")
    shapes = tuple((name, a.shape) for name, a in host.items())
    return _unpack(np.concatenate([a.astype(np.int32).ravel() for a in host.values()]), shapes)


@functools.partial(jax.jit, static_argnums=1)
def _unpack(flat: jax.Array,
            shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        out[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return out


def metadata_arrays(
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    page_ids: Sequence[Sequence[int]],
    *,
    page_size: int,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    max_pages: int | None = None,
    decode_only: bool = False,
) -> dict[str, np.ndarray]:
    """`build_metadata`'s fields as validated host int32 arrays, for a caller that moves them
    to the device together with its other step inputs (`put_int32`)."""
    num_real = len(new_lens)
    num_reqs = num_real if num_reqs is None else num_reqs
    needed_pages = max((len(p) for p in page_ids), default=1)
    max_pages = max(needed_pages, 1) if max_pages is None else max_pages
    total = int(sum(new_lens))
    if decode_only:
        if any(n != 1 for n in new_lens):
            raise ValueError("decode_only needs one new token per request, "
                             f"got new_lens={list(new_lens)}")
        num_tokens = num_reqs if num_tokens is None else num_tokens
        if num_tokens != num_reqs:
            raise ValueError("decode_only needs num_tokens == num_reqs, "
                             f"got {num_tokens} != {num_reqs}")
    num_tokens = total if num_tokens is None else num_tokens
    _check_sizes(prefix_lens, new_lens, page_ids, page_size, num_tokens, num_reqs, max_pages)
    return _layout(prefix_lens, new_lens, page_ids, num_tokens, num_reqs, max_pages)


def pack_tokens(token_lists: Sequence[Sequence[int]], num_tokens: int | None = None) -> jax.Array:
    """Concatenates requests' new token ids in the order `build_metadata` lays them out; pads with
    0."""
    return jnp.asarray(pack_token_array(token_lists, num_tokens))


def pack_token_array(token_lists: Sequence[Sequence[int]],
                     num_tokens: int | None = None) -> np.ndarray:
    """`pack_tokens` as a host int32 array [T] (numpy converts each list in C, not per token)."""
    total = sum(len(toks) for toks in token_lists)
    num_tokens = total if num_tokens is None else num_tokens
    if total > num_tokens:
        raise ValueError(f"{total} tokens do not fit in a bucket of {num_tokens}")
    out = np.zeros((num_tokens,), np.int32)  # [T]
    start = 0
    for toks in token_lists:
        out[start : start + len(toks)] = toks
        start += len(toks)
    return out


def _check_sizes(prefix_lens, new_lens, page_ids, page_size, num_tokens, num_reqs,
                 max_pages) -> None:
    if not len(prefix_lens) == len(new_lens) == len(page_ids):
        raise ValueError("prefix_lens, new_lens and page_ids must have one entry per request")
    if len(new_lens) > num_reqs or sum(new_lens) > num_tokens:
        raise ValueError(f"{len(new_lens)} requests / {sum(new_lens)} tokens exceed buckets "
                         f"{num_reqs} / {num_tokens}")
    for b, (pre, new, pages) in enumerate(zip(prefix_lens, new_lens, page_ids)):
        if len(pages) > max_pages or len(pages) * page_size < pre + new:
            raise ValueError(
                f"request {b}: {len(pages)} pages of {page_size} cannot hold {pre + new} tokens "
                f"(or exceed max_pages={max_pages})"
            )


def _layout(prefix_lens, new_lens, page_ids, num_tokens, num_reqs,
            max_pages) -> dict[str, np.ndarray]:
    """Vectorised over requests and tokens: this runs on the host every step, before the forward."""
    num_real = len(new_lens)
    pre = np.asarray(prefix_lens, np.int32).reshape(num_real)
    new = np.asarray(new_lens, np.int32).reshape(num_real)
    total = int(new.sum())
    starts = np.cumsum(new, dtype=np.int32) - new  # first token row of each request
    positions = np.zeros((num_tokens,), np.int32)
    token_req = np.full((num_tokens,), -1, np.int32)
    # Token row t of request b sits at position pre[b] + (t - starts[b]).
    positions[:total] = np.arange(total, dtype=np.int32) + np.repeat(pre - starts, new)
    token_req[:total] = np.repeat(np.arange(num_real, dtype=np.int32), new)
    page_table = np.zeros((num_reqs, max_pages), np.int32)
    counts = np.fromiter((len(p) for p in page_ids), np.int64, num_real)
    # Row-major boolean fill: request b's pages land in row b, columns [0, len(pages)).
    page_table[:num_real][np.arange(max_pages) < counts[:, None]] = np.fromiter(
        itertools.chain.from_iterable(page_ids), np.int32, int(counts.sum()))
    seq_lens = np.zeros((num_reqs,), np.int32)
    query_lens = np.zeros((num_reqs,), np.int32)
    query_start = np.full((num_reqs,), total, np.int32)  # padding rows start past the real tokens
    seq_lens[:num_real], query_lens[:num_real], query_start[:num_real] = pre + new, new, starts
    return dict(
        positions=positions, token_req=token_req, page_table=page_table,
        seq_lens=seq_lens, query_start=query_start, query_lens=query_lens,
    )
