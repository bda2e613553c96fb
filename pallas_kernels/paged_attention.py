"""Paged attention over per-layer KV pages: extend (ragged, causal) and decode, GQA, float32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check, check_pages_pair, is_concrete
from pallas_kernels.backend import use_interpreter

_NEG = -1e30  # finite: a fully masked block then gives exp(-huge) = 0, never inf - inf = NaN


# ---------------------------------------------------------------- kernel pieces
def _key_slots(pt_ref, b, start, *, block_k: int, page_size: int, max_pages: int, num_slots: int):
    """Flat slots of tokens start..start+block_k of request b; clamped so masked lanes stay in bounds."""
    tok = start + jnp.arange(block_k, dtype=jnp.int32)
    page = pt_ref[b, jnp.minimum(tok // page_size, max_pages - 1)]
    return jnp.clip(page * page_size + tok % page_size, 0, num_slots - 1), tok


def _online_softmax_step(q, k, v, visible, carry, *, sm_scale: float):
    """One key block of flash attention; acc, m, l in float32. visible None: every key of the block is visible."""
    acc, m, l = carry
    exact = None if q.dtype != jnp.float32 else False  # f32 storage: no TF32 rounding
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=exact).astype(jnp.float32) * sm_scale
    if visible is not None:
        s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=exact).astype(jnp.float32)
    return acc, m_new, l * alpha + p.sum(axis=1)


def _attend(pt_ref, k_ref, v_ref, q, b, kv_head, lo, hi, visible_fn, *, sm_scale, block_k, page_size, init=None):
    """Online softmax of q over request b's tokens [lo, hi) in blocks of block_k, continuing from `init`.
    visible_fn None: the caller promises [lo, hi) is whole blocks all visible to every row (no mask work)."""
    max_pages, num_slots = pt_ref.shape[1], k_ref.shape[0]

    def body(i, carry):
        slots, tok = _key_slots(pt_ref, b, lo + i * block_k, block_k=block_k, page_size=page_size,
                                max_pages=max_pages, num_slots=num_slots)
        k = k_ref[slots, kv_head, :].astype(q.dtype)
        v = v_ref[slots, kv_head, :].astype(q.dtype)
        visible = None if visible_fn is None else visible_fn(tok) & (tok < hi)[None, :]
        return _online_softmax_step(q, k, v, visible, carry, sm_scale=sm_scale)

    rows, dim = q.shape
    if init is None:
        init = (jnp.zeros((rows, dim), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
    return jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), body, init)


# ---------------------------------------------------------------- extend kernel
def _extend_kernel(pt_ref, lens_ref, qstart_ref, qlen_ref, q_ref, k_ref, v_ref, _o_in, o_ref, *,
                   group, heads, sm_scale, block_q, block_k, page_size, num_tiles):
    """Program (b, row tile, kv head): block_q packed query rows of request b, row r = (token r // group, head
    kv_head * group + r % group), so a GQA group shares each K/V block load and dot (no padding of the group)."""
    b, hk = pl.program_id(0), pl.program_id(2)
    tile = num_tiles - 1 - pl.program_id(1)  # heaviest (latest, most keys) tiles launch first: shorter tail
    qlen = qlen_ref[b]

    @pl.when(tile * block_q < qlen * group)
    def _():
        seq = lens_ref[b]
        packed = tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
        # Rows past the request's last token redo that token's rows: their stores then write the same values to
        # the same places, so no mask is needed (the interpreter's masked scatter would write stale bytes there).
        first = jnp.minimum(packed // group, qlen - 1)  # index among b's new tokens
        rows = (qstart_ref[b] + first) * heads + hk * group + packed % group  # flat row of q/o [T * H, D]
        pos = seq - qlen + first
        lo_pos = seq - qlen + tile * block_q // group  # the tile's earliest query: keys <= it are visible to all
        hi = seq - qlen + jnp.minimum((tile * block_q + block_q - 1) // group + 1, qlen)  # last visible key + 1
        cols = jnp.broadcast_to(jnp.arange(q_ref.shape[1], dtype=jnp.int32)[None, :], (block_q, q_ref.shape[1]))
        row_idx = jnp.broadcast_to(rows[:, None], cols.shape)
        q = q_ref[row_idx, cols].astype(k_ref.dtype)
        full = (lo_pos + 1) // block_k * block_k  # whole key blocks before the diagonal: no mask work
        kw = dict(sm_scale=sm_scale, block_k=block_k, page_size=page_size)
        carry = _attend(pt_ref, k_ref, v_ref, q, b, hk, 0, full, None, **kw)
        acc, _, l = _attend(pt_ref, k_ref, v_ref, q, b, hk, full, hi, lambda tok: tok[None, :] <= pos[:, None],
                            init=carry, **kw)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        o_ref[row_idx, cols] = out.astype(o_ref.dtype)


def _extend_call(q_rows, k_flat, v_flat, page_table, seq_lens, query_start, query_lens, *, group, sm_scale,
                 block_q, block_k, page_size, num_warps, num_stages):
    """q_rows: [T * H, D]; k/v_flat: [pages*S, Hkv, D]. Output rows start as zeros (aliased), so padding stays 0."""
    kv_heads = k_flat.shape[1]
    num_tiles = pl.cdiv(q_rows.shape[0] // kv_heads, block_q)  # T * group rows per kv head, at most
    grid = (page_table.shape[0], num_tiles, kv_heads)
    kernel = functools.partial(_extend_kernel, group=group, heads=group * kv_heads, sm_scale=sm_scale, block_q=block_q,
                               block_k=block_k, page_size=page_size, num_tiles=num_tiles)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype), grid=grid,
        input_output_aliases={7: 0}, interpret=use_interpreter(),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(page_table, seq_lens, query_start, query_lens, q_rows, k_flat, v_flat, jnp.zeros_like(q_rows))


# ---------------------------------------------------------------- decode kernel
def _decode_kernel(pt_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, sm_scale, block_k,
                   page_size, split_tokens):
    """Program (b, kv head, split): the padded query-head group of request b over one token range."""
    b, hk, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo = s * split_tokens
    hi = jnp.minimum(lens_ref[b], lo + split_tokens)
    q = q_ref[b, hk, :, :].astype(k_ref.dtype)
    acc, m, l = _attend(pt_ref, k_ref, v_ref, q, b, hk, lo, hi, lambda tok: jnp.full((1, tok.shape[0]), True),
                        sm_scale=sm_scale, block_k=block_k, page_size=page_size)
    o_ref[b, hk, s, :, :] = acc
    m_ref[b, hk, s, :] = m
    l_ref[b, hk, s, :] = l


def _decode_call(q_groups, k_flat, v_flat, page_table, seq_lens, *, splits, split_tokens, sm_scale, block_k,
                 page_size, num_warps, num_stages):
    """q_groups: [B, Hkv, Gp, D] -> per-split (acc [B, Hkv, splits, Gp, D], m, l [B, Hkv, splits, Gp])."""
    batch, kv_heads, gp, dim = q_groups.shape
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, block_k=block_k, page_size=page_size,
                               split_tokens=split_tokens)
    stats = jax.ShapeDtypeStruct((batch, kv_heads, splits, gp), jnp.float32)
    return pl.pallas_call(
        kernel, grid=(batch, kv_heads, splits), interpret=use_interpreter(),
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, splits, gp, dim), jnp.float32), stats, stats],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(page_table, seq_lens, q_groups, k_flat, v_flat)


def _combine_splits(acc, m, l):
    """Merges per-split softmax states; rows with no keys (seq_len 0) come out as zeros."""
    m_all = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    total = (l * w).sum(axis=2)
    out = (acc * w[..., None]).sum(axis=2)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


# ---------------------------------------------------------------- jitted public functions
_STATIC = ("sm_scale", "block_q", "block_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, *, sm_scale, block_q, block_k,
            num_warps, num_stages):
    num_pages, page_size, kv_heads, dim = k_pages.shape
    tokens, heads, _ = q.shape
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads, dim)  # noqa: E731  a bitcast
    out = _extend_call(q.reshape(tokens * heads, dim), flat(k_pages), flat(v_pages), page_table, seq_lens,
                       query_start, query_lens, group=heads // kv_heads, sm_scale=sm_scale, block_q=block_q,
                       block_k=block_k, page_size=page_size, num_warps=num_warps, num_stages=num_stages)
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
    block_q: int | None = None,  # packed (token, group head) rows per program; None: 128, 64 for f32 (smem)
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [T, num_heads, head_dim], zeros at padding tokens
    """Causal attention of each request's new tokens over all of its cached pages (new KV already written)."""
    _validate_common(q, k_pages, v_pages, page_table, seq_lens, query_lens)
    check(query_start.shape == seq_lens.shape and query_start.dtype == np.int32, "query_start must be int32 [B]")
    if all(is_concrete(x) for x in (page_table, seq_lens, query_start, query_lens)):
        _check_extend_values(q.shape[0], k_pages.shape[:2], *map(np.asarray, (page_table, seq_lens, query_start,
                                                                              query_lens)))
    if q.shape[0] == 0 or page_table.shape[0] == 0:
        return jnp.zeros_like(q)
    block_q = block_q or (64 if q.dtype.itemsize > 2 else 128)
    return _extend(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, sm_scale=float(sm_scale),
                   block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=(*_STATIC[:1], "block_k", "splits", "num_warps", "num_stages"))
def _decode(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale, block_k, splits, num_warps, num_stages):
    batch, heads, dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    gp = max(16, pl.next_power_of_2(group))  # Triton dots need >= 16 rows
    q_groups = jnp.pad(q.reshape(batch, kv_heads, group, dim), ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    max_tokens = page_table.shape[1] * page_size
    split_tokens = pl.cdiv(pl.cdiv(max_tokens, splits), block_k) * block_k
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads, dim)  # noqa: E731  a bitcast
    acc, m, l = _decode_call(q_groups, flat(k_pages), flat(v_pages), page_table, seq_lens,
                             splits=pl.cdiv(max_tokens, split_tokens), split_tokens=split_tokens, sm_scale=sm_scale,
                             block_k=block_k, page_size=page_size, num_warps=num_warps, num_stages=num_stages)
    out = _combine_splits(acc, m, l)[:, :, :group]  # [B, Hkv, group, D]
    return out.reshape(batch, heads, dim).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [B, num_heads, head_dim]: one query token per request
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, max_pages] int32
    seq_lens: jax.Array,  # [B] int32 tokens in the cache including this one; 0 = padding row -> zeros
    *,
    sm_scale: float,
    block_k: int = 128,
    splits: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [B, num_heads, head_dim]
    """Decode attention: each request's single query over all of its cached tokens (split-K, merged in f32)."""
    check(q.ndim == 3 and q.shape[0] == page_table.shape[0], f"q must be [B, H, D] with B = {page_table.shape[0]}")
    _validate_common(q, k_pages, v_pages, page_table, seq_lens, seq_lens)
    if all(is_concrete(x) for x in (page_table, seq_lens)):
        _check_pages_in_range(np.asarray(page_table), np.asarray(seq_lens), *k_pages.shape[:2])
    if q.shape[0] == 0:
        return jnp.zeros_like(q)
    return _decode(q, k_pages, v_pages, page_table, seq_lens, sm_scale=float(sm_scale), block_k=block_k,
                   splits=splits, num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------- validation (outside jit, cheap)
def _validate_common(q, k_pages, v_pages, page_table, seq_lens, query_lens) -> None:
    check_pages_pair("attention pages", k_pages, v_pages)
    check(q.ndim == 3 and q.shape[2] == k_pages.shape[3], f"q {q.shape} head_dim != pages' {k_pages.shape[3]}")
    check(q.shape[1] % k_pages.shape[2] == 0, f"{q.shape[1]} query heads not a multiple of {k_pages.shape[2]}")
    # Triton's dots need inner dims >= 16: on the H200, bf16 with head_dim 8 gave wrong results.
    check(use_interpreter() or q.shape[2] >= 16, f"head_dim {q.shape[2]} < 16 is not supported by the Triton kernels")
    check(page_table.ndim == 2 and page_table.dtype == np.int32, "page_table must be int32 [B, max_pages]")
    for name, x in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        check(x.shape == page_table.shape[:1] and x.dtype == np.int32, f"{name} must be int32 [B], got {x.shape}")


def _check_pages_in_range(table, seq_lens, num_pages: int, page_size: int) -> None:
    """Columns a request uses (ceil(seq_len / page_size)) must be in the table and in [0, num_pages)."""
    used = -(-seq_lens // page_size)
    check(bool((seq_lens >= 0).all()) and bool((used <= table.shape[1]).all()), "seq_lens beyond the page table")
    live = np.arange(table.shape[1])[None, :] < used[:, None]
    bad = table[live & ((table < 0) | (table >= num_pages))]
    check(bad.size == 0, f"page ids out of range [0, {num_pages}): {bad[:8].tolist()}")


def _check_extend_values(num_tokens: int, pages_shape, table, seq_lens, query_start, query_lens) -> None:
    check(bool((query_lens >= 0).all() and (query_lens <= seq_lens).all()), "need 0 <= query_lens <= seq_lens")
    live = query_lens > 0
    check(bool((query_start[live] >= 0).all() and (query_start + query_lens)[live].max(initial=0) <= num_tokens),
          f"query ranges beyond the {num_tokens} query rows")
    _check_pages_in_range(table, seq_lens, *pages_shape)


# ---------------------------------------------------------------- references (pure jnp)
def token_requests(query_start: jax.Array, query_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Request index of each of `num_tokens` query rows, -1 for padding rows."""
    t = jnp.arange(num_tokens)[:, None]
    inside = (t >= query_start[None, :]) & (t < (query_start + query_lens)[None, :])
    return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)


def paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, *, sm_scale):
    """Pure-jnp reference: gathers every request's pages and runs a masked softmax in float32."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // num_kv_heads
    req = token_requests(query_start, query_lens, num_tokens)
    safe_req = jnp.maximum(req, 0)
    pos = seq_lens[safe_req] - query_lens[safe_req] + (jnp.arange(num_tokens) - query_start[safe_req])
    max_len = page_table.shape[1] * page_size
    keys = k_pages[page_table].reshape(page_table.shape[0], max_len, num_kv_heads, head_dim)
    values = v_pages[page_table].reshape(page_table.shape[0], max_len, num_kv_heads, head_dim)
    k_tok = jnp.repeat(keys[safe_req], group, axis=2).astype(jnp.float32)  # [T, L, H, D]
    v_tok = jnp.repeat(values[safe_req], group, axis=2).astype(jnp.float32)
    scores = jnp.einsum("thd,tlhd->thl", q.astype(jnp.float32), k_tok) * sm_scale
    key_pos = jnp.arange(max_len)
    visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < seq_lens[safe_req][:, None])
    scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("thl,tlhd->thd", probs, v_tok)
    return jnp.where((req >= 0)[:, None, None], out, 0.0).astype(q.dtype)


def paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale):
    """Pure-jnp reference for decode: the extend reference with one query row per request."""
    start = jnp.arange(q.shape[0], dtype=jnp.int32)
    lens = (seq_lens > 0).astype(jnp.int32)
    return paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, start, lens, sm_scale=sm_scale)
