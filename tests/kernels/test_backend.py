"""The Pallas lowering switch: off the GPU nothing changes; on it, kernels lower to the FFI call
(which XLA's command buffers capture) and still compute what their references do."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jhicache.pallas_kernels.backend import lower_to_ffi_calls, use_interpreter
from jhicache.pallas_kernels.kv_write import write_kv, write_kv_reference

_REGISTRATION = "jax._src.pallas.triton.pallas_call_registration"


def test_off_the_gpu_the_switch_is_left_alone():
    if not use_interpreter():
        pytest.skip("a GPU backs the default device")
    registration = importlib.import_module(_REGISTRATION)
    before = getattr(registration, "USE_NEW_CUSTOM_CALL", None)
    assert lower_to_ffi_calls() is False
    assert getattr(registration, "USE_NEW_CUSTOM_CALL", None) == before


@pytest.mark.gpu
def test_gpu_write_kv_lowers_to_the_ffi_call_and_matches_its_reference():
    if not lower_to_ffi_calls():
        pytest.skip("this jax has no FFI lowering for Pallas-Triton")
    rng = np.random.default_rng(3)
    pages, page_size, heads, dim, tokens = 8, 16, 2, 64, 40
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((pages, page_size, heads, dim)),
                                    jnp.bfloat16) for _ in "kv")
    k_new, v_new = (jnp.asarray(rng.standard_normal((tokens, heads, dim)), jnp.bfloat16)
                    for _ in "kv")
    table = jnp.asarray(rng.permutation(pages)[None, :], jnp.int32)
    req, pos = jnp.zeros(tokens, jnp.int32), jnp.arange(tokens, dtype=jnp.int32) + 50
    args = (k_pages, v_pages, k_new, v_new, table, req, pos)
    hlo = jax.jit(write_kv).lower(*args).as_text()
    assert "triton_kernel_call" in hlo and "__gpu$xla.gpu.triton" not in hlo
    want = write_kv_reference(*args)
    got = jax.jit(write_kv)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
