"""Pieces shared by the extend and decode attention kernels: the wait for a layer's loaded pages,
paged key gather, online softmax, split merge, cheap argument validation, and the pure-jnp
reference both kernels are tested against."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._common import check, check_pages_pair
from jhicache.pallas_kernels.backend import use_interpreter

NEG = -1e30  # finite: a fully masked block then gives exp(-huge) = 0, never inf - inf = NaN
# Flag reads a program makes before it stops waiting and records a timeout: meant to lie far past
# any copy the engine queues, so that only a bug waits that long (the time it takes is unmeasured).
GATE_SPIN_LIMIT = 1 << 24


class LayerGate(NamedTuple):
    """What a kernel waits for before it reads a layer's pages: until `flags[layer] >= seq[0]`.

    A copy stream writes `flags[l]` (int32, one per layer plus a last slot for timeouts) with
    the load's sequence number once layer l's pages have landed, in layer order; `seq` is the
    newest load the step reads (0: none, so no wait). Arrays, not constants, so every layer's
    call is the same compiled kernel."""

    flags: jax.Array  # [num_layers + 1] int32
    seq: jax.Array  # [1] int32
    layer: jax.Array  # [1] int32


def await_layer(flags_ref, seq_ref, layer_ref) -> None:
    """Kernel piece, first thing in every program: spins on volatile reads of flags[layer] (a
    value another stream wrote must show, so no cached load) until it reaches seq, at most
    GATE_SPIN_LIMIT reads (read when the kernel is traced). A spin that runs out sets the flags'
    last slot to 1, which `gate_timeouts` callers check; the program then goes on (a hang would
    take the GPU with it)."""
    target, layer, limit = seq_ref[0], layer_ref[0], GATE_SPIN_LIMIT

    def read() -> jax.Array:
        # An atomic add of 0, the usual acquiring read, zeroed the flag on the H200 (jax
        # 0.11.2); a volatile load reads it correctly (benchmarks/spin_wait_probe.py).
        return plgpu.load(flags_ref.at[pl.ds(layer, 1)], volatile=True)[0]

    seen, _spins = jax.lax.while_loop(lambda c: (c[0] < target) & (c[1] < limit),
                                 lambda c: (read(), c[1] + 1), (read(), 0))

    @pl.when(seen < target)
    def _():
        flags_ref[pl.ds(flags_ref.shape[0] - 1, 1)] = jnp.ones((1,), jnp.int32)


def gate_operands(gate: LayerGate | None) -> tuple[jax.Array, ...]:
    """A gate's arrays as a kernel's leading operands (none without a gate)."""
    return () if gate is None else (gate.flags, gate.seq, gate.layer)


def split_gate(refs: tuple, gated: bool) -> tuple:
    """In a kernel: waits on the leading gate refs when `gated`, returns the other refs."""
    if not gated:
        return refs
    await_layer(*refs[:3])
    return refs[3:]


def check_gate(gate: LayerGate | None) -> None:
    if gate is None:
        return
    check(gate.flags.ndim == 1 and gate.flags.dtype == np.int32 and gate.flags.shape[0] >= 2,
          f"gate flags must be int32 [layers + 1], got {gate.flags.dtype}{gate.flags.shape}")
    for name, x in (("seq", gate.seq), ("layer", gate.layer)):
        check(x.shape == (1,) and x.dtype == np.int32, f"gate {name} must be int32 [1]")


# ---------------------------------------------------------------- kernel pieces
LOG2E = 1.4426950408889634  # scores are kept in base-2 units: exp2 is one instruction, exp more


def key_slots(pt_ref, b, start, *, block_k: int, page_size: int, max_pages: int, num_slots: int):
    """Flat slots of tokens start..start+block_k of request b; `start` is a multiple of block_k.
    Clamped so masked lanes stay in bounds."""
    # strongly typed: a weak-typed scalar (start = 0 + i * block_k) broke Pallas-Triton's lowering
    # of the scalar page arithmetic below
    start = jnp.asarray(start, jnp.int32)
    tok = start + jnp.arange(block_k, dtype=jnp.int32)
    if page_size % block_k == 0:
        # The block lies inside one page: one page-table read and contiguous slots (a scalar plus
        # a range, which Triton sees as contiguous rows), not a page lookup per key.
        page = pt_ref[b, jnp.minimum(start // page_size, max_pages - 1)]
        first = jnp.clip(page, 0, num_slots // page_size - 1) * page_size + start % page_size
        return first + jnp.arange(block_k, dtype=jnp.int32), tok
    page = pt_ref[b, jnp.minimum(tok // page_size, max_pages - 1)]
    return jnp.clip(page * page_size + tok % page_size, 0, num_slots - 1), tok


def online_softmax_step(q, k, v, visible, carry, *, sm_scale: float):
    """One key block of flash attention; acc, m, l in float32, m (the running max) in base-2 units
    (scores x log2 e). visible None: every key of the block is visible."""
    acc, m, l = carry
    exact = None if q.dtype != jnp.float32 else False  # f32 storage: no TF32 rounding
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=exact).astype(jnp.float32) * (sm_scale * LOG2E)
    if visible is not None:
        s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    acc = (acc * alpha[:, None]
           + plgpu.dot(p.astype(v.dtype), v, allow_tf32=exact).astype(jnp.float32))
    return acc, m_new, l * alpha + p.sum(axis=1)


def attend(pt_ref, k_ref, v_ref, q, b, kv_head, lo, hi, visible_fn, *, sm_scale, block_k, page_size,
           init=None):
    """Online softmax of q over request b's tokens [lo, hi) in blocks of block_k (lo a multiple of
    block_k), continuing from `init`. visible_fn None: the caller promises [lo, hi) is whole blocks
    all visible to every row (no mask work)."""
    max_pages, num_slots = pt_ref.shape[1], k_ref.shape[0]

    def body(i, carry):
        slots, tok = key_slots(pt_ref, b, lo + i * block_k, block_k=block_k, page_size=page_size,
                                max_pages=max_pages, num_slots=num_slots)
        k = k_ref[slots, kv_head, :].astype(q.dtype)
        v = v_ref[slots, kv_head, :].astype(q.dtype)
        visible = None if visible_fn is None else visible_fn(tok) & (tok < hi)[None, :]
        return online_softmax_step(q, k, v, visible, carry, sm_scale=sm_scale)

    rows, dim = q.shape
    if init is None:
        init = (jnp.zeros((rows, dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
    return jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), body, init)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, axis: int) -> jax.Array:
    """Merges per-split softmax states (acc [..., D], m (base 2) and l [...], splits on `axis`) in
    float32; rows that saw no key in any split (all l = 0) come out as zeros."""
    m_all = m.max(axis=axis, keepdims=True)
    w = jnp.exp2(m - m_all)
    total = (l * w).sum(axis=axis)
    out = (acc * w[..., None]).sum(axis=axis)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


# ---------------------------------------------------------------- validation (outside jit, cheap)
def validate_common(q, k_pages, v_pages, page_table, seq_lens, query_lens) -> None:
    check_pages_pair("attention pages", k_pages, v_pages)
    check(q.ndim == 3 and q.shape[2] == k_pages.shape[3],
          f"q {q.shape} head_dim != pages' {k_pages.shape[3]}")
    check(q.shape[1] % k_pages.shape[2] == 0,
          f"{q.shape[1]} query heads not a multiple of {k_pages.shape[2]}")
    # Triton's dots need inner dims >= 16: on the H200, bf16 with head_dim 8 gave wrong results.
    check(use_interpreter() or q.shape[2] >= 16,
          f"head_dim {q.shape[2]} < 16 is not supported by the Triton kernels")
    check(page_table.ndim == 2 and page_table.dtype == np.int32,
          "page_table must be int32 [B, max_pages]")
    for name, x in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        check(x.shape == page_table.shape[:1] and x.dtype == np.int32,
              f"{name} must be int32 [B], got {x.shape}")


def check_pages_in_range(table, seq_lens, num_pages: int, page_size: int) -> None:
    """Columns a request uses (ceil(seq_len / page_size)) must be in the table and in [0,
    num_pages)."""
    used = -(-seq_lens // page_size)
    check(bool((seq_lens >= 0).all()) and bool((used <= table.shape[1]).all()),
          "seq_lens beyond the page table")
    live = np.arange(table.shape[1])[None, :] < used[:, None]
    bad = table[live & ((table < 0) | (table >= num_pages))]
    check(bad.size == 0, f"page ids out of range [0, {num_pages}): {bad[:8].tolist()}")


# ---------------------------------------------------------------- references (pure jnp)
def token_requests(query_start: jax.Array, query_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Request index of each of `num_tokens` query rows, -1 for padding rows."""
    t = jnp.arange(num_tokens)[:, None]
    inside = (t >= query_start[None, :]) & (t < (query_start + query_lens)[None, :])
    return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)


def paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, query_start, query_lens, *,
                              sm_scale):
    """Pure-jnp reference: gathers every request's pages and runs a masked softmax in float32."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // num_kv_heads
    req = token_requests(query_start, query_lens, num_tokens)
    safe_req = jnp.maximum(req, 0)
    pos = (seq_lens[safe_req] - query_lens[safe_req]
           + (jnp.arange(num_tokens) - query_start[safe_req]))
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
