"""The on-device page gather (a write-back's staging copy), against the jnp reference."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels import page_copy as pc

from tests.kernels.helpers import rand, same

DTYPES = [np.float32, jnp.bfloat16]


@settings(max_examples=10, deadline=None)
@given(page_size=st.sampled_from([1, 16, 64]), n=st.integers(0, 4), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_gather_matches_reference(page_size, n, dtype, seed):
    rng = np.random.default_rng(seed)
    k, v = (rand(rng, (6, page_size, 2, 4), dtype) for _ in range(2))
    ids = rng.choice(6, n, replace=True).astype(np.int32)  # repeats: a write-back's padding
    staging = pc.gather_pages_layers([jnp.asarray(k), jnp.asarray(v)], ids)
    chex.assert_shape(staging, (2, n, page_size, 2, 4))
    empty = np.zeros((n, page_size, 2, 4), dtype)
    assert same(staging[0], pc.copy_pages_reference(k, empty, ids, np.arange(n)))
    assert same(staging[1], pc.copy_pages_reference(v, empty, ids, np.arange(n)))
    assert same(pc.gather_pages(jnp.asarray(k), ids), np.asarray(k)[ids])


def _bad_calls():
    d = jnp.zeros((4, 16, 2, 8), jnp.float32)
    return [
        lambda: pc.gather_pages(d, np.array([4], np.int32)),  # id out of range
        lambda: pc.gather_pages(d, np.array([-1], np.int32)),  # negative id
        lambda: pc.gather_pages(d, np.array([0], np.int64)),  # wrong id dtype
        lambda: pc.gather_pages_layers([d, d[:, :8]], np.array([0], np.int32)),  # shapes differ
        lambda: pc.gather_pages_layers([], np.array([0], np.int32)),  # nothing to gather
    ]


@pytest.mark.parametrize("index", range(5))
def test_invalid_arguments_raise(index):
    with pytest.raises(ValueError):
        _bad_calls()[index]()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gather(dtype):
    test_gather_matches_reference.hypothesis.inner_test(page_size=64, n=4, dtype=dtype, seed=8)
