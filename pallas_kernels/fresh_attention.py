"""Causal attention of each request's new tokens over its new tokens only (no cached prefix), with
each row's log-sum-exp: cuDNN's fused flash attention on GPUs that have it, a pure-jnp reference
elsewhere. Extend attention continues from it over the cached pages (`paged_attention(...,
new_kv=...)`), so that a long chunk of new tokens runs its causal part at cuDNN's speed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jhicache.pallas_kernels._attention import LOG2E, NEG
from jhicache.pallas_kernels._common import check
from jhicache.pallas_kernels.backend import use_interpreter
from jhicache.pallas_kernels.tuning import KernelTuning, default_tuning

__all__ = ["attend_fresh_apart", "cudnn_available", "fresh_attention",
           "fresh_attention_reference"]

# cuDNN's ragged (packed) layout, which lays requests back to back as the engine does, needs a
# Hopper GPU; the flash kernels need cuDNN 9.
_MIN_COMPUTE = (9, 0)
_MIN_CUDNN = 90000
_MIN_JAX = (0, 11)


@functools.cache
def cudnn_available() -> bool:
    """True on a CUDA GPU of compute capability 9.0 or newer with cuDNN 9 or newer, under jax
    0.11 or newer: jax 0.10's packed layout placed each later request's K/V by the query's head
    count, wrong under GQA (0.11.2's is right: benchmarks/cudnn_attention_probe.py)."""
    if use_interpreter() or jax.__version_info__ < _MIN_JAX:
        return False
    device = jax.devices()[0]
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        version = fa.check_cudnn_version()
        compute = tuple(int(x) for x in device.compute_capability.split("."))
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return False
    return version >= _MIN_CUDNN and compute >= _MIN_COMPUTE


def attend_fresh_apart(num_tokens: int, dtype: jnp.dtype,
                       tuning: KernelTuning | None = None) -> bool:
    """Whether an extend batch of `num_tokens` rows in `dtype` should compute its new tokens'
    attention among themselves apart (`paged_attention(..., new_kv=...)`): on cuDNN (16-bit
    floats only), from tuning.fresh_apart_tokens rows on (tuning None: the default device's)."""
    tuning = default_tuning() if tuning is None else tuning
    return (cudnn_available() and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                                       jnp.dtype(jnp.float16))
            and num_tokens >= tuning.fresh_apart_tokens)


def fresh_attention(q: jax.Array, k: jax.Array, v: jax.Array, query_start: jax.Array,
                    query_lens: jax.Array, *, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """q [T, H, D], k/v [T, KV, D]: request b's rows are [query_start[b], + query_lens[b]), in
    request order (`check_request_order`), requests of length 0 skipped. Returns (out
    [T, H, D] in q's dtype, base-2 log-sum-exp [T, H] float32) of each row over its request's
    rows up to itself; padding rows hold anything. cuDNN where `cudnn_available()` (16-bit q)."""
    check(q.ndim == 3 and k.shape == v.shape and k.shape[0] == q.shape[0]
          and k.shape[2] == q.shape[2] and q.shape[1] % k.shape[1] == 0,
          f"fresh_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit")
    if cudnn_available() and q.dtype.itemsize == 2:
        return _cudnn(q, k, v, query_start, query_lens, sm_scale=sm_scale)
    return fresh_attention_reference(q, k, v, query_start, query_lens, sm_scale=sm_scale)


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, query_start: jax.Array,
           query_lens: jax.Array, *, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """cuDNN, packed layout (one batch row, a segment per request; one request: padded layout).
    Its softmax statistics are natural-log sums per (segment, head, row within the segment)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    live = query_lens > 0
    if query_lens.shape[0] == 1:
        seqlens, offsets = query_lens, None
    else:
        end = jnp.sum(query_lens, dtype=jnp.int32)[None]
        seqlens = jnp.where(live, query_lens, -1)[None]
        offsets = jnp.concatenate([jnp.where(live, query_start, -1), end])[None]
    out, stats = fa.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
        kv_offsets=offsets, scale=sm_scale, mask_type=fa.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH", return_residual=True)
    seg, local = _row_segments(query_start, query_lens, q.shape[0])
    lse = stats[seg, :, local]  # [T, H]: stats are [segments, H, rows within a segment]
    return out[0], lse.astype(jnp.float32) * LOG2E


def _row_segments(query_start: jax.Array, query_lens: jax.Array,
                  num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(segment, row within it) of each row: cuDNN numbers only the requests with rows, so a
    request's segment is its rank among those. Padding rows get the last such request's last row
    (valid indices; their values are unused)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    live = query_lens > 0
    inside = ((rows[:, None] >= query_start[None, :])
              & (rows[:, None] < (query_start + query_lens)[None, :]) & live[None, :])
    last = jnp.max(jnp.where(live, jnp.arange(live.shape[0], dtype=jnp.int32), 0))
    req = jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1).astype(jnp.int32), last)
    seg = jnp.maximum(jnp.cumsum(live, dtype=jnp.int32)[req] - 1, 0)
    local = jnp.clip(rows - query_start[req], 0, jnp.maximum(query_lens[req] - 1, 0))
    return seg, local


def fresh_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, query_start: jax.Array,
                              query_lens: jax.Array, *,
                              sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """Pure jnp, float32: a [H, T, T] masked softmax (for tests and the CPU)."""
    t, heads, _ = q.shape
    group = heads // k.shape[1]
    rows = jnp.arange(t)
    ends = query_start + query_lens
    req = jnp.argmax((rows[:, None] >= query_start[None, :]) & (rows[:, None] < ends[None, :]),
                     axis=1)
    live = (rows >= query_start[req]) & (rows < ends[req])
    visible = ((req[:, None] == req[None, :]) & (rows[None, :] <= rows[:, None])
               & live[:, None] & live[None, :])
    kf, vf = (jnp.repeat(x.astype(jnp.float32), group, axis=1) for x in (k, v))
    exact = jax.lax.Precision.HIGHEST  # no TF32 on a GPU: this is the reference
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kf, precision=exact) * (sm_scale * LOG2E)
    s = jnp.where(visible[None], s, -jnp.inf)
    top = jnp.where(live[None, :], jnp.max(s, axis=-1), 0.0)  # [H, T]
    p = jnp.where(visible[None], jnp.exp2(s - top[..., None]), 0.0)
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("hts,shd->thd", p / jnp.where(total > 0, total, 1.0)[..., None], vf,
                     precision=exact)
    lse = jnp.where(live[None, :], top + jnp.log2(jnp.where(total > 0, total, 1.0)), NEG)
    return out.astype(q.dtype), lse.T.astype(jnp.float32)


def check_request_order(query_start: np.ndarray, query_lens: np.ndarray) -> None:
    """Concrete metadata as `fresh_attention` needs it: the live requests' rows in request order,
    none overlapping the next; a batch of one request starts at row 0."""
    live = query_lens > 0
    starts, ends = query_start[live], (query_start + query_lens)[live]
    check(bool((ends[:-1] <= starts[1:]).all()),
          "fresh attention needs the requests' rows in request order, not overlapping")
    check(len(query_start) != 1 or not live[0] or query_start[0] == 0,
          "fresh attention needs a lone request's rows to start at row 0")
