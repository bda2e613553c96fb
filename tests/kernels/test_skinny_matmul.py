"""Skinny matmul against its float32 reference on fresh random data, its grid plan, and its
refusals."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels.skinny_matmul import (
    MAX_ROWS,
    plan,
    skinny_applies,
    skinny_matmul,
    skinny_matmul_reference,
)
from jhicache.pallas_kernels.tuning import KernelTuning

H200 = KernelTuning(num_sms=132)


def _operands(seed: int, m: int, k: int, n: int, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) + 0.5  # a mean, so no output is near zero by symmetry
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def _assert_matches(got: jnp.ndarray, want: jnp.ndarray, k: int) -> None:
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    # float32 sums in another order, then one rounding to 16 bits: within 2 ulps of the output
    ulp = float(jnp.finfo(want.dtype).eps)
    scale = np.abs(np.asarray(want, np.float32)) + 1.0 / np.sqrt(k)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert (err <= 2 * ulp * scale).all(), float((err / scale).max())


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, MAX_ROWS), k_blocks=st.integers(1, 12),
       n=st.sampled_from([16, 48, 64, 192, 320]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_matches_reference(m, k_blocks, n, dtype, seed):
    x, w = _operands(seed, m, 64 * k_blocks, n, dtype)
    _assert_matches(skinny_matmul(x, w), skinny_matmul_reference(x, w), 64 * k_blocks)


def test_qwen2_7b_o_proj_shape():
    """The shape it was built for: 64 rows of 3584 through a 3584 x 3584 weight, split 7 ways."""
    assert plan(64, 3584, 3584, H200).splits * plan(64, 3584, 3584, H200).tiles >= 264
    x, w = _operands(0, 64, 3584, 3584, jnp.bfloat16)
    _assert_matches(skinny_matmul(x, w, tuning=H200), skinny_matmul_reference(x, w), 3584)


@pytest.mark.parametrize("m,k,n", [(64, 3584, 3584), (8, 896, 896), (1, 512, 64), (40, 128, 32)])
def test_plan_fills_the_gpu_with_whole_steps(m, k, n):
    p = plan(m, k, n, H200)
    assert p is not None
    assert p.rows >= max(m, 16) and p.rows & (p.rows - 1) == 0
    assert p.tiles * p.block_n == n and p.splits * p.chunk == k and p.chunk % 64 == 0
    smaller = [s for s in range(1, p.splits) if (k // 64) % s == 0]
    assert all(p.tiles * s < H200.target_programs for s in smaller)  # the fewest that fill it


@pytest.mark.parametrize("m,k,n,dtype", [
    (65, 128, 64, jnp.bfloat16),  # too many rows
    (8, 100, 64, jnp.bfloat16),  # k not a multiple of 64
    (8, 128, 8, jnp.bfloat16),  # n without a 16-column tile
    (8, 128, 64, jnp.float32),  # not 16-bit
])
def test_refuses_other_shapes_and_dtypes(m, k, n, dtype):
    x, w = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    assert not skinny_applies(x, w)
    with pytest.raises(ValueError, match="skinny_matmul"):
        skinny_matmul(x, w)


def test_mixed_dtypes_are_refused():
    x, w = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.float16)
    assert not skinny_applies(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_matches_reference_at_qwen2_shapes(m):
    for k, n in ((3584, 3584), (896, 896)):
        x, w = _operands(m, m, k, n, jnp.bfloat16)
        _assert_matches(skinny_matmul(x, w), skinny_matmul_reference(x, w), k)
