"""Paged extend attention over per-layer KV pages: ragged, causal, GQA, float32 accumulation,
split-K when the grid would be small and the cached prefix long."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._attention import (
    LayerGate,
    attend,
    check_gate,
    check_pages_in_range,
    combine_splits,
    gate_operands,
    paged_attention_reference,
    split_gate,
    token_requests,
    validate_common,
)
from jhicache.pallas_kernels._common import check, is_concrete
from jhicache.pallas_kernels.backend import use_interpreter
from jhicache.pallas_kernels.tuning import KernelTuning, default_tuning

__all__ = ["choose_extend_splits", "paged_attention", "paged_attention_reference", "token_requests"]


# ---------------------------------------------------------------- extend kernels
def _tile(lens_ref, qstart_ref, qlen_ref, b, hk, tile, *, group: int, heads: int, block_q: int):
    """Rows of tile `tile` of request b for kv head hk: packed row r = (token r // group, head hk *
    group + r % group). Returns (flat rows of q/o [T * H, D], each row's key position, the tile's
    first position, key bound)."""
    qlen, seq = qlen_ref[b], lens_ref[b]
    packed = tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
    # Rows past the request's last token redo that token's rows: their stores then write the same
    # values to the same places, so no mask is needed (the interpreter's masked scatter would write
    # stale bytes there).
    first = jnp.minimum(packed // group, qlen - 1)  # index among b's new tokens
    rows = (qstart_ref[b] + first) * heads + hk * group + packed % group
    # the tile's earliest query: keys <= it are visible to all rows
    lo_pos = seq - qlen + tile * block_q // group
    # last visible key + 1
    hi = seq - qlen + jnp.minimum((tile * block_q + block_q - 1) // group + 1, qlen)
    return rows, seq - qlen + first, lo_pos, hi


def _row_cols(rows, dim: int):
    """[rows, D] gather/scatter indices of whole rows of a [N, D] array."""
    cols = jnp.broadcast_to(jnp.arange(dim, dtype=jnp.int32)[None, :], (rows.shape[0], dim))
    return jnp.broadcast_to(rows[:, None], cols.shape), cols


def _causal_attend(pt_ref, k_ref, v_ref, q, b, hk, pos, lo_pos, lo, hi, *, sm_scale, block_k,
                   page_size):
    """Online softmax of the tile over keys [lo, hi), lo a multiple of block_k: the whole blocks
    before the tile's diagonal without mask work, the rest masked by each row's position (and by
    hi)."""
    kw = dict(sm_scale=sm_scale, block_k=block_k, page_size=page_size)
    # Clamped into [lo, hi): a multiple of block_k too, since hi < full only where hi is a split's
    # aligned end.
    full = jnp.clip((lo_pos + 1) // block_k * block_k, lo, hi)
    carry = attend(pt_ref, k_ref, v_ref, q, b, hk, lo, full, None, **kw)
    return attend(pt_ref, k_ref, v_ref, q, b, hk, full, hi,
                  lambda tok: tok[None, :] <= pos[:, None], init=carry, **kw)


def _extend_kernel(*refs, gated, group, heads, sm_scale, block_q, block_k, page_size, num_tiles):
    """Program (b, row tile, kv head): block_q packed query rows of request b over all their keys,
    normalised. A GQA group shares each K/V block load and dot (no padding of the group)."""
    pt_ref, lens_ref, qstart_ref, qlen_ref, q_ref, k_ref, v_ref, _o_in, o_ref = split_gate(refs,
                                                                                         gated)
    b, hk = pl.program_id(0), pl.program_id(2)
    # heaviest (latest, most keys) tiles launch first: shorter tail
    tile = num_tiles - 1 - pl.program_id(1)

    @pl.when(tile * block_q < qlen_ref[b] * group)
    def _():
        rows, pos, lo_pos, hi = _tile(lens_ref, qstart_ref, qlen_ref, b, hk, tile, group=group,
                                      heads=heads, block_q=block_q)
        row_idx, cols = _row_cols(rows, q_ref.shape[1])
        q = q_ref[row_idx, cols].astype(k_ref.dtype)
        acc, _, l = _causal_attend(pt_ref, k_ref, v_ref, q, b, hk, pos, lo_pos, 0, hi,
                                   sm_scale=sm_scale, block_k=block_k, page_size=page_size)
        o_ref[row_idx, cols] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _extend_split_kernel(*refs, gated, group, heads, sm_scale, block_q, block_k, page_size,
                         num_tiles, splits):
    """Program (b, row tile, kv head, split): as _extend_kernel over split s's share of the tile's
    key blocks, writing the un-normalised state (acc, m, l) to rows s * T * H + row of the partial
    buffers."""
    (pt_ref, lens_ref, qstart_ref, qlen_ref, q_ref, k_ref, v_ref, acc_ref, m_ref,
     l_ref) = split_gate(refs, gated)
    b, hk, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = num_tiles - 1 - pl.program_id(1)

    @pl.when(tile * block_q < qlen_ref[b] * group)
    def _():
        rows, pos, lo_pos, hi = _tile(lens_ref, qstart_ref, qlen_ref, b, hk, tile, group=group,
                                      heads=heads, block_q=block_q)
        # Whole blocks shared out evenly (sizes differ by at most one); more splits than blocks:
        # empty ranges, whose state (acc 0, m NEG, l 0) adds nothing to the merge. Rows that see no
        # key of a range also keep l = 0.
        blocks = pl.cdiv(hi, block_k)
        lo = s * blocks // splits * block_k
        end = jnp.minimum(hi, (s + 1) * blocks // splits * block_k)
        row_idx, cols = _row_cols(rows, q_ref.shape[1])
        q = q_ref[row_idx, cols].astype(k_ref.dtype)
        acc, m, l = _causal_attend(pt_ref, k_ref, v_ref, q, b, hk, pos, lo_pos, lo, end,
                                   sm_scale=sm_scale, block_k=block_k, page_size=page_size)
        part = s * q_ref.shape[0] + rows
        acc_ref[_row_cols(part, q_ref.shape[1])] = acc
        m_ref[part] = m
        l_ref[part] = l


def _extend_call(q_rows, k_flat, v_flat, page_table, seq_lens, query_start, query_lens, gate, *,
                 group, splits, sm_scale, block_q, block_k, page_size, num_warps, num_stages):
    """q_rows: [T * H, D]; k/v_flat: [pages*S, Hkv, D]. splits 1: the output [T * H, D], starting as
    zeros (aliased) so padding rows stay 0. splits > 1: partial (acc [splits * T * H, D], m, l
    [splits * T * H]) in float32, rows of padding tokens left unwritten."""
    kv_heads = k_flat.shape[1]
    num_tiles = pl.cdiv(q_rows.shape[0] // kv_heads, block_q)  # T * group rows per kv head, at most
    kw = dict(gated=gate is not None, group=group, heads=group * kv_heads, sm_scale=sm_scale,
              block_q=block_q, block_k=block_k, page_size=page_size, num_tiles=num_tiles)
    params = dict(interpret=use_interpreter(),
                  compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    gated = gate_operands(gate)
    args = (*gated, page_table, seq_lens, query_start, query_lens, q_rows, k_flat, v_flat)
    grid = (page_table.shape[0], num_tiles, kv_heads)
    if splits == 1:
        return pl.pallas_call(functools.partial(_extend_kernel, **kw), grid=grid,
                              input_output_aliases={len(args): 0},
                              out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype), **params,
                              )(*args, jnp.zeros_like(q_rows))
    rows = splits * q_rows.shape[0]
    stats = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return pl.pallas_call(functools.partial(_extend_split_kernel, splits=splits, **kw),
                          grid=(*grid, splits),
                          out_shape=[jax.ShapeDtypeStruct((rows, q_rows.shape[1]), jnp.float32),
                                     stats, stats],
                          **params)(*args)


def choose_extend_splits(tokens: int, batch: int, max_tokens: int, heads: int, kv_heads: int,
                         dim: int, *, block_q: int, block_k: int,
                         tuning: KernelTuning | None = None) -> int:
    """Key-range splits per extend program, from static shapes only (one compiled kernel per shape
    bucket).

    Split only when the un-split grid cannot fill the GPU once (fewer non-empty programs than SMs: a
    short new turn over a long prefix). Then aim for tuning.programs_per_sm programs per SM, but
    give each split >= tuning.min_split_blocks key blocks of the longest possible request and
    keep the float32 partials under tuning.max_partial_bytes. tuning None: the default device's
    (default_tuning)."""
    tuning = default_tuning() if tuning is None else tuning
    num_tiles = -(-tokens * (heads // kv_heads) // block_q)
    # non-empty programs at most: sum_b ceil(rows_b)
    live = min(batch * num_tiles, num_tiles + batch) * kv_heads
    if live >= tuning.num_sms:
        return 1
    by_grid = -(-tuning.target_programs // live)
    by_keys = max_tokens // (tuning.min_split_blocks * block_k)
    by_bytes = tuning.max_partial_bytes // (tokens * heads * dim * 4)
    splits = min(by_grid, by_keys, by_bytes)
    return splits if splits >= 2 else 1


# ---------------------------------------------------------------- jitted public function
@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "splits",
                                             "num_warps", "num_stages"))
def _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, gate, *, sm_scale,
            block_q, block_k, splits, num_warps, num_stages):
    num_pages, page_size, kv_heads, dim = k_pages.shape
    tokens, heads, _ = q.shape
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads, dim)  # noqa: E731  a bitcast
    out = _extend_call(q.reshape(tokens * heads, dim), flat(k_pages), flat(v_pages), page_table,
                       seq_lens, query_start, query_lens, gate, group=heads // kv_heads,
                       splits=splits,
                       sm_scale=sm_scale, block_q=block_q, block_k=block_k, page_size=page_size,
                       num_warps=num_warps, num_stages=num_stages)
    if splits == 1:
        return out.reshape(tokens, heads, dim)  # [T, H, D]
    return _merge_partials(*out, query_start, query_lens, splits=splits,
                           heads=heads).astype(q.dtype)


def _merge_partials(acc, m, l, query_start, query_lens, *, splits: int, heads: int) -> jax.Array:
    """Split states (acc [splits * T * H, D], m, l [splits * T * H]) -> normalised [T, H, D] in
    float32. Rows of padding tokens are written by no program (garbage there, NaN maybe): zeros."""
    merged = combine_splits(*(x.reshape(splits, -1, *x.shape[1:]) for x in (acc, m, l)), axis=0)
    merged = merged.reshape(-1, heads, acc.shape[1])
    padding = token_requests(query_start, query_lens, merged.shape[0]) < 0
    return jnp.where(padding[:, None, None], 0.0, merged)


def paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]; T may include padding tokens
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, max_pages] int32 device page ids per request
    seq_lens: jax.Array,  # [B] int32: tokens in the cache after this step (prefix + new)
    query_start: jax.Array,  # [B] int32: offset of each request's first new token in q
    query_lens: jax.Array,  # [B] int32: new tokens per request (0 = padding request)
    *,
    sm_scale: float,
    # packed (token, group head) rows per program; None: 128, 64 for f32 (smem)
    block_q: int | None = None,
    block_k: int = 64,
    splits: int | None = None,  # key-range splits per program (split-K); None: choose_extend_splits
    num_warps: int = 4,
    num_stages: int = 2,
    gate: LayerGate | None = None,  # wait for this layer's loaded pages first (on the device)
) -> jax.Array:  # [T, num_heads, head_dim], zeros at padding tokens
    """Causal attention of each request's new tokens over all of its cached pages (new KV already
    written)."""
    validate_common(q, k_pages, v_pages, page_table, seq_lens, query_lens)
    check_gate(gate)
    check(query_start.shape == seq_lens.shape and query_start.dtype == np.int32,
          "query_start must be int32 [B]")
    check(splits is None or splits >= 1, f"splits must be >= 1, got {splits}")
    if all(is_concrete(x) for x in (page_table, seq_lens, query_start, query_lens)):
        _check_extend_values(q.shape[0], k_pages.shape[:2],
                             *map(np.asarray, (page_table, seq_lens, query_start, query_lens)))
    if q.shape[0] == 0 or page_table.shape[0] == 0:
        return jnp.zeros_like(q)
    block_q = block_q or (64 if q.dtype.itemsize > 2 else 128)
    tokens, heads, dim = q.shape
    splits = splits or choose_extend_splits(tokens, page_table.shape[0],
                                            page_table.shape[1] * k_pages.shape[1], heads,
                                            k_pages.shape[2], dim, block_q=block_q, block_k=block_k)
    return _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, gate,
                   sm_scale=float(sm_scale), block_q=block_q, block_k=block_k, splits=splits,
                   num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------- validation (outside jit, cheap)
def _check_extend_values(num_tokens: int, pages_shape, table, seq_lens, query_start,
                         query_lens) -> None:
    check(bool((query_lens >= 0).all() and (query_lens <= seq_lens).all()),
          "need 0 <= query_lens <= seq_lens")
    live = query_lens > 0
    check(bool((query_start[live] >= 0).all()
               and (query_start + query_lens)[live].max(initial=0) <= num_tokens),
          f"query ranges beyond the {num_tokens} query rows")
    check_pages_in_range(table, seq_lens, *pages_shape)
