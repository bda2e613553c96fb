"""RoPE and the paged KV write in one kernel: a layer's QKV projection rows in, the rotated
queries out and the rotated keys and the values written into their page slots (donated, aliased
pages), with Qwen3's per-head q/k RMSNorm before the rotation.

Why one kernel: XLA runs the projection's split, the RoPE tables, each rotation and the write as
separate small kernels, each launched and each reading and writing the rows again; for a short
turn or a decode step of a small model they cost more than the rows' bytes (the 0.5B forward's
trace in BENCHMARKS.md). Here each program reads its rows once and writes each result once.
The decoder keeps XLA's path until the kernels bench (`--only rope_write`, this kernel against
`rope_write_reference` compiled by XLA) and the forward's floor measure this one faster on a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._common import check, check_pages_pair, is_concrete
from jhicache.pallas_kernels.backend import use_interpreter
from jhicache.pallas_kernels.kv_write import (
    check_referenced_pages,
    slots_of_block,
    write_kv_reference,
)

__all__ = ["QKNorm", "RopeWritten", "rope_write", "rope_write_reference"]


class QKNorm(NamedTuple):
    """Qwen3's RMSNorm over each query and key head before RoPE: weights [head_dim] each."""

    q_weight: jax.Array
    k_weight: jax.Array
    eps: float


class RopeWritten(NamedTuple):
    """What `rope_write` returns: rotated queries [T, H, D]; the pages with the new keys (rotated)
    and values written; the new keys and values [T, KV, D] themselves where asked for (for
    attention among the new tokens computed apart), else None."""

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    k: jax.Array | None
    v: jax.Array | None


# ---------------------------------------------------------------- kernel
def _normed(x1, x2, w_ref, *, eps, dim):
    """HF's RMSNorm of rows split in halves [rows, D/2] each: float32 statistics, the normed
    value cast to the weight's dtype, then scaled (in that dtype, as HF does)."""
    half = dim // 2
    inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / dim + eps)
    dtype = w_ref.dtype
    w1 = w_ref[pl.ds(0, half)]
    w2 = w_ref[pl.ds(half, half)]
    return ((w1[None, :] * (x1 * inv[:, None]).astype(dtype)).astype(jnp.float32),
            (w2[None, :] * (x2 * inv[:, None]).astype(dtype)).astype(jnp.float32))


def _rotated(qkv_ref, inv_ref, w_ref, rows, pos, col, *, dim, eps, dtype):
    """Halves of head rows `rows` at columns [col, col + D) of the projection, normed (w_ref) and
    rotated by positions `pos`: HF's rotate_half RoPE, x * cos + rotate_half(x) * sin, with the
    tables cast to the rows' dtype as HF casts them; the arithmetic in float32, one rounding."""
    half = dim // 2
    lanes = jnp.arange(half, dtype=jnp.int32)[None, :]
    r = jnp.broadcast_to(rows[:, None], (rows.shape[0], half))
    x1 = qkv_ref[r, col + lanes].astype(jnp.float32)
    x2 = qkv_ref[r, col + half + lanes].astype(jnp.float32)
    if w_ref is not None:
        x1, x2 = _normed(x1, x2, w_ref, eps=eps, dim=dim)
    angle = pos.astype(jnp.float32)[:, None] * inv_ref[...][None, :]
    cos = jnp.cos(angle).astype(dtype).astype(jnp.float32)
    sin = jnp.sin(angle).astype(dtype).astype(jnp.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _store_halves(ref, rows, col, halves, *, dim, mask=None):
    """Stores the halves [rows, D/2] at columns [col, col + D) of `ref` rows `rows`."""
    half = dim // 2
    lanes = jnp.arange(half, dtype=jnp.int32)[None, :]
    r = jnp.broadcast_to(rows[:, None], (rows.shape[0], half))
    for i, x in enumerate(halves):
        plgpu.store(ref.at[r, col + i * half + lanes], x.astype(ref.dtype), mask=mask)


def _kernel(*refs, normed, new_rows, block_t, count, dim, heads, kv_heads, page_size,
            max_pages, eps):
    """Program (token block i, head h) of the [q heads | k heads | v heads] columns: a q head's
    rows rotated into q; a k head's rotated and written to the tokens' page slots; a v head's
    written as they are. Page writes take the block's live tokens only, padding lanes repeating
    the first live one (`slots_of_block`); q and the new rows take every row (padding rows too,
    so they hold finite values)."""
    pt_ref, req_ref, pos_ref, inv_ref, qkv_ref, *rest = refs
    qw_ref, kw_ref = (rest[0], rest[1]) if normed else (None, None)
    _k_in, _v_in, q_ref, k_pages, v_pages, *rows_out = rest[2:] if normed else rest
    dtype = qkv_ref.dtype
    h = pl.program_id(1)
    lane = jnp.arange(block_t, dtype=jnp.int32)
    every = jnp.minimum(pl.program_id(0) * block_t + lane, count - 1)  # padding lanes: last row
    src, dst, any_live = slots_of_block(pt_ref, req_ref, pos_ref, block_t=block_t, count=count,
                                        page_size=page_size, max_pages=max_pages)
    kw = dict(dim=dim, eps=eps, dtype=dtype)
    col = h * dim  # this head's first column in the projection

    @pl.when(h < heads)
    def _():
        halves = _rotated(qkv_ref, inv_ref, qw_ref, every, pos_ref[every], col, **kw)
        _store_halves(q_ref, every, col, halves, dim=dim)

    @pl.when((h >= heads) & (h < heads + kv_heads))
    def _():
        kcol = col - heads * dim  # in the pages' [KV * D] rows
        halves = _rotated(qkv_ref, inv_ref, kw_ref, src, pos_ref[src], col, **kw)
        mask = jnp.broadcast_to(any_live, (block_t, dim // 2))
        _store_halves(k_pages, dst, kcol, halves, dim=dim, mask=mask)
        if new_rows:
            halves = _rotated(qkv_ref, inv_ref, kw_ref, every, pos_ref[every], col, **kw)
            _store_halves(rows_out[0], every, kcol, halves, dim=dim)

    @pl.when(h >= heads + kv_heads)
    def _():
        vcol = col - (heads + kv_heads) * dim
        lanes = jnp.arange(dim, dtype=jnp.int32)[None, :]
        shape = (block_t, dim)
        mask = jnp.broadcast_to(any_live, shape)
        s2, d2 = (jnp.broadcast_to(x[:, None], shape) for x in (src, dst))
        plgpu.store(v_pages.at[d2, vcol + lanes], qkv_ref[s2, col + lanes].astype(v_pages.dtype),
                    mask=mask)
        if new_rows:
            e2 = jnp.broadcast_to(every[:, None], shape)
            rows_out[1][e2, vcol + lanes] = qkv_ref[e2, col + lanes]


# ---------------------------------------------------------------- jitted function
@functools.partial(jax.jit, donate_argnums=(1, 2),
                   static_argnames=("heads", "new_rows", "block_t", "num_warps", "eps"))
def _rope_write(qkv, k_pages, v_pages, page_table, token_req, positions, inv_freq, norm_weights,
                *, heads, new_rows, block_t, num_warps, eps):
    num_pages, page_size, kv_heads, dim = k_pages.shape
    count = qkv.shape[0]
    block_t = min(block_t, pl.next_power_of_2(count))
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads * dim)  # noqa: E731  a bitcast
    normed = norm_weights is not None
    kernel = functools.partial(
        _kernel, normed=normed, new_rows=new_rows, block_t=block_t, count=count, dim=dim,
        heads=heads, kv_heads=kv_heads, page_size=page_size, max_pages=page_table.shape[1],
        eps=eps)
    args = (page_table.reshape(-1), token_req, positions, inv_freq, qkv, *(norm_weights or ()),
            flat(k_pages), flat(v_pages))
    out_shape = [jax.ShapeDtypeStruct((count, heads * dim), qkv.dtype),
                 jax.ShapeDtypeStruct((num_pages * page_size, kv_heads * dim), k_pages.dtype),
                 jax.ShapeDtypeStruct((num_pages * page_size, kv_heads * dim), v_pages.dtype)]
    if new_rows:
        out_shape += [jax.ShapeDtypeStruct((count, kv_heads * dim), qkv.dtype)] * 2
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(count, block_t), heads + 2 * kv_heads),
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        interpret=use_interpreter(), compiler_params=plgpu.CompilerParams(num_warps=num_warps),
    )(*args)
    q, k_flat, v_flat = out[:3]
    k, v = ((x.reshape(count, kv_heads, dim) for x in out[3:]) if new_rows else (None, None))
    return RopeWritten(q.reshape(count, heads, dim), k_flat.reshape(k_pages.shape),
                       v_flat.reshape(v_pages.shape), k, v)


def rope_write(
    qkv: jax.Array,  # [T, (H + 2 * KV) * D]: the QKV projection's rows, columns [q | k | v]
    k_pages: jax.Array,  # [num_pages, page_size, KV, D], donated
    v_pages: jax.Array,  # [num_pages, page_size, KV, D], donated
    page_table: jax.Array,  # [B, max_pages] int32
    token_req: jax.Array,  # [T] int32 request index per token, -1 = padding (not written)
    positions: jax.Array,  # [T] int32 position of each token in its request
    inv_freq: jax.Array,  # [D / 2] float32 RoPE inverse frequencies (`rope_inv_freq`)
    *,
    heads: int,  # query heads H
    norm: QKNorm | None = None,
    new_rows: bool = False,  # also return the new keys and values [T, KV, D]
    tokens_per_program: int = 16,
    num_warps: int = 4,
) -> RopeWritten:
    """Rotates the queries and keys (after `norm`, where given) by their positions and writes
    each token's key and value at page_table[req, pos // page_size], offset pos % page_size."""
    _validate(qkv, k_pages, v_pages, page_table, token_req, positions, inv_freq, heads, norm)
    kv_heads, dim = k_pages.shape[2:]
    # Nothing to write: no tokens, or no requests (every token pads, and padding rows may hold
    # anything), so the rows are passed on unrotated.
    if qkv.shape[0] == 0 or page_table.size == 0:
        q = qkv[:, :heads * dim].reshape(-1, heads, dim)
        empty = jnp.zeros((qkv.shape[0], kv_heads, dim), qkv.dtype) if new_rows else None
        return RopeWritten(q, k_pages, v_pages, empty, empty)
    weights = None if norm is None else (norm.q_weight, norm.k_weight)
    return _rope_write(qkv, k_pages, v_pages, page_table, token_req, positions, inv_freq,
                       weights, heads=heads, new_rows=new_rows,
                       block_t=pl.next_power_of_2(tokens_per_program), num_warps=num_warps,
                       eps=0.0 if norm is None else float(norm.eps))


def _validate(qkv, k_pages, v_pages, page_table, token_req, positions, inv_freq, heads,
              norm) -> None:
    check_pages_pair("rope_write pages", k_pages, v_pages)
    kv_heads, dim = k_pages.shape[2:]
    t = qkv.shape[0]
    check(dim % 2 == 0, f"head_dim must be even, got {dim}")
    check(heads >= kv_heads and heads % kv_heads == 0,
          f"query heads ({heads}) must be a multiple of the pages' kv heads ({kv_heads})")
    check(qkv.ndim == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * dim,
          f"qkv must be [T, {(heads + 2 * kv_heads) * dim}] (q | k | v), got {qkv.shape}")
    check(inv_freq.shape == (dim // 2,) and inv_freq.dtype == np.float32,
          f"inv_freq must be float32 [{dim // 2}], got {inv_freq.dtype} {inv_freq.shape}")
    check(page_table.ndim == 2 and page_table.dtype == np.int32,
          "page_table must be int32 [B, max_pages]")
    for name, x in (("token_req", token_req), ("positions", positions)):
        check(x.shape == (t,) and x.dtype == np.int32,
              f"{name} must be int32 [{t}], got {x.dtype} {x.shape}")
    if norm is not None:
        for name, w in (("q_weight", norm.q_weight), ("k_weight", norm.k_weight)):
            check(w.shape == (dim,) and w.dtype == qkv.dtype,
                  f"norm {name} must be {qkv.dtype} [{dim}], got {w.dtype} {w.shape}")
    if all(is_concrete(x) for x in (page_table, token_req, positions)):
        check_referenced_pages(np.asarray(page_table), np.asarray(token_req),
                               np.asarray(positions), *k_pages.shape[:2])


# ---------------------------------------------------------------- reference
def _rms(x, w, eps):
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * (xf * inv).astype(x.dtype)


def rope_write_reference(qkv, k_pages, v_pages, page_table, token_req, positions, inv_freq, *,
                         heads: int, norm: QKNorm | None = None) -> RopeWritten:
    """Pure-jnp reference: split the projection, norm, rotate in float32 with the tables cast
    to the rows' dtype, round once; write with `write_kv_reference`."""
    kv_heads, dim = k_pages.shape[2:]
    t = qkv.shape[0]
    q = qkv[:, :heads * dim].reshape(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].reshape(t, kv_heads, dim)
    if norm is not None:
        q, k = _rms(q, norm.q_weight, norm.eps), _rms(k, norm.k_weight, norm.eps)
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angle).astype(qkv.dtype).astype(jnp.float32)[:, None, :]
    sin = jnp.sin(angle).astype(qkv.dtype).astype(jnp.float32)[:, None, :]

    def rotate(x):
        x1, x2 = (h.astype(jnp.float32) for h in jnp.split(x, 2, axis=-1))
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)

    q, k = rotate(q), rotate(k)
    k_pages, v_pages = write_kv_reference(k_pages, v_pages, k, v, page_table, token_req,
                                          positions)
    return RopeWritten(q, k_pages, v_pages, k, v)
