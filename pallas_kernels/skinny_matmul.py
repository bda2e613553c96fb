"""Skinny matmul: a few rows (a short turn, a decode batch) times a large 16-bit weight, split
over the contracting axis so that every SM streams its share of the weight.

Why a kernel of ours for this one shape: XLA autotunes each matmul on its own, with the weight
likely resident in the 50 MB L2 of an H200, so for a weight that fits there (Qwen2-7B's o_proj,
25.7 MB) it picks a grid that reads HBM far below its speed inside the forward, where the
weight comes from HBM (the figures: BENCHMARKS.md, the forward against its floor). This kernel
sizes its grid for HBM: `tiles x splits` programs of `block_n` columns and `chunk` rows of the
weight each, every program summing its chunk in float32; XLA then adds the splits' partial sums
(fused with whatever follows), in a fixed order, so results do not depend on timing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._common import check
from jhicache.pallas_kernels.backend import use_interpreter
from jhicache.pallas_kernels.tuning import KernelTuning, default_tuning

BLOCK_K = 64  # weight rows a loop step reads: one 128-byte row segment per column tile of 64
MAX_BLOCK_N = 64
MIN_ROWS = 16  # Triton's dot needs at least 16 rows; fewer are padded
MAX_ROWS = 64  # above this the matmul is no longer skinny: XLA's own kernels take it
MIN_CHUNK_BLOCKS = 2  # loop steps a program runs at least, so its loads can pipeline


@dataclasses.dataclass(frozen=True)
class SkinnyPlan:
    """One skinny matmul's grid: `tiles` column tiles of `block_n` by `splits` chunks of the
    contracting axis, `chunk` weight rows each, over `rows` padded rows."""

    rows: int
    block_n: int
    tiles: int
    splits: int
    chunk: int


def plan(m: int, k: int, n: int, tuning: KernelTuning | None = None) -> SkinnyPlan | None:
    """The grid for x [m, k] @ w [k, n], or None when the shape is not one this kernel takes
    (too many rows, or axes that its blocks do not divide)."""
    block_n = min(n & -n, MAX_BLOCK_N)
    if m > MAX_ROWS or k % BLOCK_K or block_n < 16:
        return None
    tuning = tuning or default_tuning()
    tiles, blocks = n // block_n, k // BLOCK_K
    # the fewest splits that fill the GPU, each a whole number of loop steps
    splits = [s for s in range(1, blocks // MIN_CHUNK_BLOCKS + 1) if blocks % s == 0] or [1]
    filling = [s for s in splits if tiles * s >= tuning.target_programs]
    split = filling[0] if filling else splits[-1]
    return SkinnyPlan(rows=max(MIN_ROWS, pl.next_power_of_2(m)), block_n=block_n, tiles=tiles,
                      splits=split, chunk=k // split)


# ---------------------------------------------------------------- kernel
def _skinny_kernel(x_ref, w_ref, out_ref, *, block_n: int, chunk: int):
    """Program (tile j, split s): out[s, :, j's columns] = x[:, s's chunk] @ w[s's chunk, j's
    columns], in float32."""
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    start = pl.program_id(1) * chunk

    def step(i, acc):
        k0 = pl.ds(pl.multiple_of(start + i * BLOCK_K, BLOCK_K), BLOCK_K)
        # a float32 product: a 16-bit one would round each step's partial sum
        return acc + jnp.dot(x_ref[:, k0], w_ref[k0, cols], preferred_element_type=jnp.float32)

    acc = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    out_ref[...] = jax.lax.fori_loop(0, chunk // BLOCK_K, step, acc)


@functools.partial(jax.jit, static_argnames=("p", "num_warps", "num_stages"))
def _skinny(x: jax.Array, w: jax.Array, *, p: SkinnyPlan, num_warps: int,
            num_stages: int) -> jax.Array:
    m = x.shape[0]
    padded = jnp.pad(x, ((0, p.rows - m), (0, 0)))
    partial = pl.pallas_call(
        functools.partial(_skinny_kernel, block_n=p.block_n, chunk=p.chunk),
        out_shape=jax.ShapeDtypeStruct((p.splits, p.rows, w.shape[1]), jnp.float32),
        grid=(p.tiles, p.splits),
        out_specs=pl.BlockSpec((None, p.rows, p.block_n), lambda j, s: (s, 0, j)),
        interpret=use_interpreter(),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(padded, w)
    return partial.sum(axis=0)[:m].astype(x.dtype)


# ---------------------------------------------------------------- public function
def skinny_applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether `skinny_matmul` takes x @ w: one 16-bit dtype, and a shape `plan` takes."""
    return (x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[0] and x.dtype == w.dtype
            and jnp.dtype(x.dtype).itemsize == 2
            and plan(x.shape[0], x.shape[1], w.shape[1]) is not None)


def skinny_matmul(x: jax.Array, w: jax.Array, *, num_warps: int = 4, num_stages: int = 4,
                  tuning: KernelTuning | None = None) -> jax.Array:
    """x [m, k] @ w [k, n] in x's dtype with float32 accumulation, where `skinny_applies`."""
    check(skinny_applies(x, w),
          f"skinny_matmul: takes [m <= {MAX_ROWS}, k] @ [k, n] of one 16-bit dtype with k a "
          f"multiple of {BLOCK_K} and n of 16; got {x.dtype}{list(x.shape)} @ "
          f"{w.dtype}{list(w.shape)}")
    p = plan(x.shape[0], x.shape[1], w.shape[1], tuning)
    assert p is not None
    return _skinny(x, w, p=p, num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------- reference
def skinny_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """Pure-jnp reference: the product in float32, cast to x's dtype."""
    product = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return product.astype(x.dtype)
