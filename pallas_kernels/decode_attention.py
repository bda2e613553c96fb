"""Paged decode attention: one query token per request over all of its cached pages, split-K,
GQA."""

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
    validate_common,
)
from jhicache.pallas_kernels._common import check, is_concrete
from jhicache.pallas_kernels.backend import use_interpreter


def _decode_kernel(*refs, gated, sm_scale, block_k, page_size, splits):
    """Program (b, kv head, split): the padded query-head group of request b over split s of
    its own tokens (after the gate, when there is one). The splits share out each request's
    length, not the page table's width: a short request among long ones, or a table wider than
    any request, still spreads over every split."""
    pt_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref = split_gate(refs, gated)
    b, hk, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = lens_ref[b]
    split_tokens = pl.cdiv(pl.cdiv(seq, splits), block_k) * block_k  # whole blocks per split
    lo = s * split_tokens
    hi = jnp.minimum(seq, lo + split_tokens)
    q = q_ref[b, hk, :, :].astype(k_ref.dtype)
    acc, m, l = attend(pt_ref, k_ref, v_ref, q, b, hk, lo, hi,
                       lambda tok: jnp.full((1, tok.shape[0]), True), sm_scale=sm_scale,
                       block_k=block_k, page_size=page_size)
    o_ref[b, hk, s, :, :] = acc
    m_ref[b, hk, s, :] = m
    l_ref[b, hk, s, :] = l


def _decode_call(q_groups, k_flat, v_flat, page_table, seq_lens, gate, *, splits,
                 sm_scale, block_k, page_size, num_warps, num_stages):
    """q_groups: [B, Hkv, Gp, D] -> per-split (acc [B, Hkv, splits, Gp, D], m, l [B, Hkv, splits,
    Gp])."""
    batch, kv_heads, gp, dim = q_groups.shape
    kernel = functools.partial(_decode_kernel, gated=gate is not None, sm_scale=sm_scale,
                               block_k=block_k, page_size=page_size, splits=splits)
    stats = jax.ShapeDtypeStruct((batch, kv_heads, splits, gp), jnp.float32)
    return pl.pallas_call(
        kernel, grid=(batch, kv_heads, splits), interpret=use_interpreter(),
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, splits, gp, dim), jnp.float32),
                   stats, stats],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*gate_operands(gate), page_table, seq_lens, q_groups, k_flat, v_flat)


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "block_k", "splits", "num_warps", "num_stages"))
def _decode(q, k_pages, v_pages, page_table, seq_lens, gate, *, sm_scale, block_k, splits,
            num_warps, num_stages):
    batch, heads, dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    gp = max(16, pl.next_power_of_2(group))  # Triton dots need >= 16 rows
    q_groups = jnp.pad(q.reshape(batch, kv_heads, group, dim),
                       ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    # no more splits than key blocks of the longest request the table holds
    splits = min(splits, pl.cdiv(page_table.shape[1] * page_size, block_k))
    flat = lambda x: x.reshape(num_pages * page_size, kv_heads, dim)  # noqa: E731  a bitcast
    acc, m, l = _decode_call(q_groups, flat(k_pages), flat(v_pages), page_table, seq_lens, gate,
                             splits=splits,
                             sm_scale=sm_scale, block_k=block_k, page_size=page_size,
                             num_warps=num_warps, num_stages=num_stages)
    out = combine_splits(acc, m, l, axis=2)[:, :, :group]  # [B, Hkv, group, D]
    return out.reshape(batch, heads, dim).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [B, num_heads, head_dim]: one query token per request
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, max_pages] int32
    # [B] int32 tokens in the cache including this one; 0 = padding row -> zeros
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    block_k: int = 128,
    splits: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    gate: LayerGate | None = None,  # wait for this layer's loaded pages first (on the device)
) -> jax.Array:  # [B, num_heads, head_dim]
    """Decode attention: each request's single query over all of its cached tokens (split-K, merged
    in f32)."""
    check(q.ndim == 3 and q.shape[0] == page_table.shape[0],
          f"q must be [B, H, D] with B = {page_table.shape[0]}")
    validate_common(q, k_pages, v_pages, page_table, seq_lens, seq_lens)
    check_gate(gate)
    check(splits >= 1, f"splits must be >= 1, got {splits}")
    if all(is_concrete(x) for x in (page_table, seq_lens)):
        check_pages_in_range(np.asarray(page_table), np.asarray(seq_lens), *k_pages.shape[:2])
    if q.shape[0] == 0:
        return jnp.zeros_like(q)
    return _decode(q, k_pages, v_pages, page_table, seq_lens, gate, sm_scale=float(sm_scale),
                   block_k=block_k, splits=splits, num_warps=num_warps, num_stages=num_stages)


def paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale):
    """Pure-jnp reference for decode: the extend reference with one query row per request."""
    start = jnp.arange(q.shape[0], dtype=jnp.int32)
    lens = (seq_lens > 0).astype(jnp.int32)
    return paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, start, lens,
                                     sm_scale=sm_scale)
