"""The reference check: an attention case's output against the float32 pure-jnp references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jhicache.pallas_kernels.decode_attention import paged_decode_attention_reference
from jhicache.pallas_kernels.extend_attention import paged_attention_reference

from benchmarks.kernels.cases import AttnCase, CaseInputs, KernelConfig, kernel
from benchmarks.kernels.shapes import PAGE

REF_BYTES = 8 << 30  # float32 working set of one reference call at most ([rows, keys, H, D] x 3)
TOL = 2e-2  # bf16 output vs the float32 reference: atol = rtol, as in the kernel tests


def _chunk(total: int, limit: int) -> int:
    """The largest power of two <= limit (at least 1) that divides total."""
    n = 1
    while n * 2 <= limit and total % (n * 2) == 0:
        n *= 2
    return n


def _errors(got: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Max |got - ref| and max(|got - ref| - TOL * (1 + |ref|)) (> 0: out of tolerance)."""
    d = jnp.abs(got.astype(jnp.float32) - ref)
    return d.max(), (d - TOL * (1 + jnp.abs(ref))).max()


def _extend_errors(case: AttnCase, got: jax.Array, data: CaseInputs, n: int) -> list[tuple]:
    """Per chunk of n new tokens of one request: the reference over that chunk alone, its key bound
    set to the chunk's last position + 1 so that the reference's positions are the chunk's."""
    scale = case.dim**-0.5

    @jax.jit
    def err(got: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array,
            b: int, lo: int, seen: jax.Array) -> tuple[jax.Array, jax.Array]:
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, n)  # noqa: E731
        ref = paged_attention_reference(rows(q), k, v, jax.lax.dynamic_slice_in_dim(table, b, 1),
                                        seen[None], jnp.zeros((1,), jnp.int32),
                                        jnp.full((1,), n, jnp.int32), sm_scale=scale)
        return _errors(rows(got), ref)

    q32, prefix = data.q.astype(jnp.float32), case.seq_len - case.query_len  # f32 q: f32 output
    return [err(got, q32, data.ks[0], data.vs[0], data.meta[0], b, b * case.query_len + j,
                jnp.int32(prefix + j + n))
            for b in range(case.batch) for j in range(0, case.query_len, n)]


def _decode_errors(case: AttnCase, got: jax.Array, data: CaseInputs, n: int) -> list[tuple]:
    """Per chunk of n requests: paged_decode_attention_reference over those requests."""
    scale = case.dim**-0.5

    @jax.jit
    def err(got: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array,
            lens: jax.Array, b0: int) -> tuple[jax.Array, jax.Array]:
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, b0, n)  # noqa: E731
        ref = paged_decode_attention_reference(rows(q), k, v, rows(table), rows(lens),
                                               sm_scale=scale)
        return _errors(rows(got), ref)

    q32 = data.q.astype(jnp.float32)
    return [err(got, q32, data.ks[0], data.vs[0], *data.meta, b0)
            for b0 in range(0, case.batch, n)]


def reference_check(case: AttnCase, data: CaseInputs, cfg: KernelConfig) -> dict:
    """Layer 0's output under cfg against the pure-jnp reference in float32, run in chunks of rows
    that keep its [rows, keys, heads, dim] float32 copies of K and V under REF_BYTES."""
    got = jax.jit(kernel(case, cfg))(data.q, data.ks[0], data.vs[0], data.news[0], *data.meta)
    per_row = 3 * case.pages_per_request * PAGE * case.heads * case.dim * 4
    limit = REF_BYTES // per_row
    if case.kind == "decode":
        n = _chunk(case.batch, limit)
        errs = _decode_errors(case, got, data, n)
    else:
        n = _chunk(case.query_len, limit)
        errs = _extend_errors(case, got, data, n)
    worst = np.asarray([[float(a), float(e)] for a, e in errs]).max(axis=0)  # NaN propagates
    return {"max_abs_err": float(worst[0]), "within_tolerance": bool(worst[1] <= 0),
            "tolerance": f"|err| <= {TOL} * (1 + |ref|)", "layer": 0,
            "rows_per_reference_call": n,
            "reference": ("paged_decode_attention_reference" if case.kind == "decode"
                          else "paged_attention_reference") + ", float32"}

