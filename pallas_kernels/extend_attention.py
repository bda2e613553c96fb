"""Paged extend attention over per-layer KV pages: ragged, causal, GQA, float32 accumulation,
split-K when the grid would be small and the cached prefix long (a short turn over a long prefix):
then each split writes a normalised partial output and its log-sum-exp, and one small kernel
merges them. Given the new tokens' K/V, the kernel reads only the cached prefix and continues
from their attention among themselves, computed apart (`fresh_attention`, cuDNN on GPUs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._attention import (
    NEG,
    LayerGate,
    attend,
    check_gate,
    check_pages_in_range,
    gate_operands,
    paged_attention_reference,
    split_gate,
    token_requests,
    validate_common,
)
from jhicache.pallas_kernels._common import check, is_concrete
from jhicache.pallas_kernels.backend import use_interpreter
from jhicache.pallas_kernels.fresh_attention import check_request_order, fresh_attention
from jhicache.pallas_kernels.tuning import KernelTuning, default_tuning

__all__ = ["choose_extend_splits", "default_stages", "paged_attention",
           "paged_attention_reference", "token_requests"]


# ---------------------------------------------------------------- extend kernels
def _tile(lens_ref, qstart_ref, qlen_ref, b, hk, tile, *, group: int, heads: int, block_q: int):
    """Rows of tile `tile` of request b for kv head hk: packed row r = (token r // group, head hk *
    group + r % group). Returns (flat rows of q/o [T * H, D], each row's key position, the tile's
    first position, key bound)."""
    qlen, seq = qlen_ref[b], lens_ref[b]
    # Rows past the request's last packed row redo that row, this tile's own: their stores then
    # write the same values to the same place, so no mask is needed (the interpreter's masked
    # scatter would write stale bytes there). Not the last token's other heads: where that token
    # straddles two tiles, those rows are the other tile's, which may read them (the output
    # starts as the new tokens' state when they were attended apart).
    packed = jnp.minimum(tile * block_q + jnp.arange(block_q, dtype=jnp.int32), qlen * group - 1)
    first = packed // group  # index among b's new tokens
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


def _key_range(hi, s, *, splits: int, block_k: int):
    """Split s's share [lo, end) of keys [0, hi): whole blocks shared out evenly (counts differ by
    at most one). More splits than blocks: empty ranges, whose state adds nothing to the merge."""
    if splits == 1:
        return 0, hi
    blocks = pl.cdiv(hi, block_k)
    return (s * blocks // splits * block_k,
            jnp.minimum(hi, (s + 1) * blocks // splits * block_k))


def _prefix_attend(pt_ref, k_ref, v_ref, q, b, hk, lo, end, init, *, sm_scale, block_k,
                   page_size):
    """Online softmax of the tile over cached keys [lo, end) (lo a multiple of block_k), all
    visible to every row, continuing from `init`: the whole blocks without mask work, then the
    last partial block masked by its end."""
    kw = dict(sm_scale=sm_scale, block_k=block_k, page_size=page_size)
    full = lo + (end - lo) // block_k * block_k
    carry = attend(pt_ref, k_ref, v_ref, q, b, hk, lo, full, None, init=init, **kw)
    every = lambda tok: jnp.broadcast_to((tok >= 0)[None, :], (q.shape[0], block_k))  # noqa: E731
    return attend(pt_ref, k_ref, v_ref, q, b, hk, full, end, every, init=carry, **kw)


def _extend_kernel(*refs, gated, group, heads, sm_scale, block_q, block_k, page_size, num_tiles,
                   splits, cont):
    """Program (row tile, split, kv head, b): block_q packed query rows of request b over split s's
    share of their keys. A GQA group shares each K/V block load and dot (no padding of the group).
    One split: writes the normalised output. Several: the split's normalised partial output
    (rows s * T * H + row) and its base-2 log-sum-exp, merged by `_merge_call`.

    `cont`: the new tokens' attention among themselves was computed apart (`fresh_attention`):
    the programs read only the cached prefix, keys [0, seq_len - query_len), visible to every
    row. One split continues from that state in place (the output aliases o0, lse0 an input), and
    a request without a prefix has nothing to add: its programs do nothing. Several splits leave
    the state to the merge.

    The row tile is the fastest grid axis, so the tiles that read the same keys run side by side
    and all but the first find them in L2."""
    pt_ref, lens_ref, qstart_ref, qlen_ref, q_ref, k_ref, v_ref, *out_refs = split_gate(refs,
                                                                                      gated)
    if cont and splits == 1:
        lse0_ref, *out_refs = out_refs
    # heaviest (latest, most keys) tiles launch first: shorter tail
    tile = num_tiles - 1 - pl.program_id(0)
    s, hk, b = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    live = tile * block_q < qlen_ref[b] * group
    if cont and splits == 1:  # the output holds the new tokens' state already
        live &= lens_ref[b] > qlen_ref[b]

    @pl.when(live)
    def _():
        rows, pos, lo_pos, hi = _tile(lens_ref, qstart_ref, qlen_ref, b, hk, tile, group=group,
                                      heads=heads, block_q=block_q)
        if cont:
            hi = lens_ref[b] - qlen_ref[b]  # the cached prefix
        lo, end = _key_range(hi, s, splits=splits, block_k=block_k)
        row_idx, cols = _row_cols(rows, q_ref.shape[1])
        q = q_ref[row_idx, cols].astype(k_ref.dtype)
        kw = dict(sm_scale=sm_scale, block_k=block_k, page_size=page_size)
        if not cont:
            acc, m, l = _causal_attend(pt_ref, k_ref, v_ref, q, b, hk, pos, lo_pos, lo, end, **kw)
        else:
            init = None
            if splits == 1:  # the new tokens' state: normalised output, so l = 1 at m = lse0
                m0 = lse0_ref[rows]
                init = (out_refs[0][row_idx, cols].astype(jnp.float32), m0, jnp.ones_like(m0))
            acc, m, l = _prefix_attend(pt_ref, k_ref, v_ref, q, b, hk, lo, end, init, **kw)
        # Rows that see no key of the range (l = 0): output 0 and log-sum-exp NEG, which the merge
        # weighs at exp2(NEG - max) = 0.
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[:, None]
        if splits == 1:
            _start, o_ref = out_refs  # the output aliases its start: zeros, or o0 with `cont`
            o_ref[row_idx, cols] = out.astype(o_ref.dtype)
            return
        o_ref, lse_ref = out_refs
        part = s * q_ref.shape[0] + rows
        o_ref[_row_cols(part, q_ref.shape[1])] = out.astype(o_ref.dtype)
        lse_ref[part] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), NEG)


def _merge_kernel(qstart_ref, qlen_ref, o_ref, lse_ref, *refs, splits, heads, block_rows):
    """Program i: flat output rows [i * block_rows, ...) (row = token * H + head) from the splits'
    partial outputs and log-sum-exps, and the new tokens' own state where it was computed apart
    (refs o0, lse0 before the output); rows of padding tokens, which no split program wrote (they
    hold garbage, NaN maybe), come out as zeros. Reads no page, so it needs no gate: it runs after
    the split kernel, which waited."""
    *fresh_refs, out_ref = refs
    n = out_ref.shape[0]
    # Rows past the end redo the last row: the same values to the same place, no mask needed.
    rows = jnp.minimum(pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32),
                       n - 1)
    tok = rows // heads

    def live(b, count):
        start = qstart_ref[b]
        return count + ((tok >= start) & (tok < start + qlen_ref[b])).astype(jnp.int32)

    valid = jax.lax.fori_loop(0, qstart_ref.shape[0], live, jnp.zeros_like(rows)) > 0
    # (log-sum-exp, rows of o) of each split (static count: unrolled), then the new tokens' own
    parts = [(lse_ref[s * n + rows], o_ref, s * n + rows) for s in range(splits)]
    if fresh_refs:
        o0_ref, lse0_ref = fresh_refs
        parts.append((lse0_ref[rows], o0_ref, rows))
    top = functools.reduce(jnp.maximum, [lse for lse, _, _ in parts])
    total = jnp.zeros((block_rows,), jnp.float32)
    acc = jnp.zeros((block_rows, out_ref.shape[1]), jnp.float32)
    for lse, part_ref, part_rows in parts:
        w = jnp.exp2(lse - top)  # the largest part weighs 1, so total >= 1
        total = total + w
        acc = acc + w[:, None] * part_ref[_row_cols(part_rows, out_ref.shape[1])].astype(
            jnp.float32)
    out = jnp.where(valid[:, None], acc / total[:, None], 0.0)
    out_ref[_row_cols(rows, out_ref.shape[1])] = out.astype(out_ref.dtype)


def _params(num_warps: int, num_stages: int) -> dict:
    return dict(interpret=use_interpreter(),
                compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def _extend_call(q_rows, k_flat, v_flat, page_table, seq_lens, query_start, query_lens, gate, fresh,
                 *, group, splits, sm_scale, block_q, block_k, page_size, num_warps, num_stages):
    """q_rows: [T * H, D]; k/v_flat: [pages*S, Hkv, D]; fresh: None, or the new tokens' own state
    (o0 [T * H, D], base-2 lse0 [T * H]), when the kernel is to read only the cached prefix.
    splits 1: the output [T * H, D], starting as zeros (aliased) so padding rows stay 0, or with
    `fresh` as o0 (aliased, so a prompt without a prefix costs no copy; padding rows then hold
    what o0 held). splits > 1: partials (out [splits * T * H, D] in q's dtype, base-2
    log-sum-exp [splits * T * H] in float32), rows of padding tokens unwritten; the merge folds
    `fresh` in."""
    kv_heads = k_flat.shape[1]
    num_tiles = pl.cdiv(q_rows.shape[0] // kv_heads, block_q)  # T * group rows per kv head, at most
    kernel = functools.partial(_extend_kernel, gated=gate is not None, group=group,
                               heads=group * kv_heads, sm_scale=sm_scale, block_q=block_q,
                               block_k=block_k, page_size=page_size, num_tiles=num_tiles,
                               splits=splits, cont=fresh is not None)
    args = (*gate_operands(gate), page_table, seq_lens, query_start, query_lens, q_rows, k_flat,
            v_flat)
    grid = (num_tiles, splits, kv_heads, page_table.shape[0])
    if splits == 1:
        start = jnp.zeros_like(q_rows)
        if fresh is not None:
            start, lse0 = fresh
            args += (lse0,)
        return pl.pallas_call(kernel, grid=grid, input_output_aliases={len(args): 0},
                              out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
                              **_params(num_warps, num_stages))(*args, start.astype(q_rows.dtype))
    rows = splits * q_rows.shape[0]
    return pl.pallas_call(kernel, grid=grid,
                          out_shape=[jax.ShapeDtypeStruct((rows, q_rows.shape[1]), q_rows.dtype),
                                     jax.ShapeDtypeStruct((rows,), jnp.float32)],
                          **_params(num_warps, num_stages))(*args)


def merge_rows(rows: int, dim: int, num_sms: int) -> int:
    """Rows per merge program: enough programs to spread the partials' reads over the SMs (at
    least 4 rows, at most 64, and a block of at least 512 elements), a power of two."""
    per_sm = max(1, rows // num_sms)
    return min(64, max(4, 512 // dim, 1 << (per_sm.bit_length() - 1)))


def _merge_call(o_part, lse, query_start, query_lens, fresh, *, splits, heads, block_rows):
    """One kernel: partials (o_part [splits * N, D], lse [splits * N]) and the new tokens' own
    state if computed apart (`fresh`: o0 [N, D], lse0 [N]) -> output [N, D]."""
    n = o_part.shape[0] // splits
    kernel = functools.partial(_merge_kernel, splits=splits, heads=heads, block_rows=block_rows)
    return pl.pallas_call(kernel, grid=(pl.cdiv(n, block_rows),),
                          out_shape=jax.ShapeDtypeStruct((n, o_part.shape[1]), o_part.dtype),
                          **_params(4, 1))(query_start, query_lens, o_part, lse, *(fresh or ()))


def choose_extend_splits(tokens: int, batch: int, max_tokens: int, heads: int, kv_heads: int,
                         dim: int, *, block_q: int, block_k: int,
                         tuning: KernelTuning | None = None) -> int:
    """Key-range splits per extend program, from static shapes only (one compiled kernel per shape
    bucket).

    Split only when the un-split grid cannot fill the GPU once (fewer non-empty programs than SMs: a
    short new turn over a long prefix). Then take as many splits as fit tuning.programs_per_sm
    programs on every SM (rounded down: a few programs past a full wave would be a second wave of
    their own), but give each split >= tuning.min_split_blocks key blocks of the longest possible
    request and keep the partials (at most 4 bytes an element) under tuning.max_partial_bytes.
    tuning None: the default device's (default_tuning)."""
    tuning = default_tuning() if tuning is None else tuning
    num_tiles = -(-tokens * (heads // kv_heads) // block_q)
    # non-empty programs at most: sum_b ceil(rows_b)
    live = min(batch * num_tiles, num_tiles + batch) * kv_heads
    if live >= tuning.num_sms:
        return 1
    by_grid = tuning.target_programs // live
    by_keys = max_tokens // (tuning.min_split_blocks * block_k)
    by_bytes = tuning.max_partial_bytes // (tokens * heads * (dim + 1) * 4)
    splits = min(by_grid, by_keys, by_bytes)
    return splits if splits >= 2 else 1


# ---------------------------------------------------------------- jitted public function
@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "splits",
                                             "num_warps", "num_stages"))
def _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, gate, new_kv, *,
            sm_scale, block_q, block_k, splits, num_warps, num_stages):
    num_pages, page_size, kv_heads, dim = k_pages.shape
    tokens, heads, _ = q.shape
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads, dim)  # noqa: E731  a bitcast
    fresh = None
    if new_kv is not None:
        k_new, v_new = new_kv
        o0, lse0 = fresh_attention(q, k_new, v_new, query_start, query_lens, sm_scale=sm_scale)
        fresh = (o0.reshape(tokens * heads, dim), lse0.reshape(tokens * heads))
    out = _extend_call(q.reshape(tokens * heads, dim), flat(k_pages), flat(v_pages), page_table,
                       seq_lens, query_start, query_lens, gate, fresh, group=heads // kv_heads,
                       splits=splits, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
                       page_size=page_size, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        rows = merge_rows(tokens * heads, dim, default_tuning().num_sms)
        o_part, lse = out  # split: each split's partial output and log-sum-exp
        out = _merge_call(o_part, lse, query_start, query_lens, fresh, splits=splits,
                          heads=heads, block_rows=rows)
    return out.reshape(tokens, heads, dim)  # [T, H, D]


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
    num_stages: int | None = None,  # pipeline stages; None: default_stages
    gate: LayerGate | None = None,  # wait for this layer's loaded pages first (on the device)
    # this step's new K and V ([T, num_kv_heads, head_dim] each, rows as q's), also written in
    # the pages: given, the new tokens attend among themselves apart (`fresh_attention`: cuDNN on
    # GPUs that have it) and the kernel reads only the cached prefix; the requests' rows must then
    # come in request order (as `build_metadata` lays them out), and rows of padding tokens may
    # hold anything (with one split they keep what the new tokens' attention left there)
    new_kv: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], zeros at padding tokens (without new_kv)
    """Causal attention of each request's new tokens over all of its cached pages (new KV already
    written)."""
    validate_common(q, k_pages, v_pages, page_table, seq_lens, query_lens)
    check_gate(gate)
    check(query_start.shape == seq_lens.shape and query_start.dtype == np.int32,
          "query_start must be int32 [B]")
    check(splits is None or splits >= 1, f"splits must be >= 1, got {splits}")
    if new_kv is not None:
        shape = (q.shape[0], k_pages.shape[2], q.shape[2])
        check(len(new_kv) == 2 and all(x.shape == shape and x.dtype == q.dtype for x in new_kv),
              f"new_kv must be two {shape} {q.dtype} arrays, got "
              f"{[(x.shape, x.dtype) for x in new_kv]}")
    if all(is_concrete(x) for x in (page_table, seq_lens, query_start, query_lens)):
        _check_extend_values(q.shape[0], k_pages.shape[:2],
                             *map(np.asarray, (page_table, seq_lens, query_start, query_lens)))
        if new_kv is not None:
            check_request_order(np.asarray(query_start), np.asarray(query_lens))
    if q.shape[0] == 0 or page_table.shape[0] == 0:
        return jnp.zeros_like(q)
    block_q = block_q or (64 if q.dtype.itemsize > 2 else 128)
    tokens, heads, dim = q.shape
    num_stages = num_stages or default_stages(q.dtype, dim)
    splits = splits or choose_extend_splits(tokens, page_table.shape[0],
                                            page_table.shape[1] * k_pages.shape[1], heads,
                                            k_pages.shape[2], dim, block_q=block_q, block_k=block_k)
    return _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, gate,
                   new_kv, sm_scale=float(sm_scale), block_q=block_q, block_k=block_k,
                   splits=splits, num_warps=num_warps, num_stages=num_stages)


def default_stages(dtype: jnp.dtype, head_dim: int) -> int:
    """Pipeline stages where the caller names none: 3 for 16-bit heads of 128, where Qwen2-7B's
    extend and prefill shapes ran faster with 3 than with 2 on the H200, else 2 (0.5B's heads
    of 64 ran slower with 3; float32 blocks would outgrow shared memory). The sweep's figures
    are in BENCHMARKS.md (the kernel targets)."""
    return 3 if jnp.dtype(dtype).itemsize == 2 and head_dim >= 128 else 2


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
