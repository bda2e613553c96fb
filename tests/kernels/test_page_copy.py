"""Page transfers between tiers and on-device staging, against the jnp reference."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels import page_copy as pc

from tests.kernels.helpers import pinned, poisoned, rand, same

DTYPES = [np.float32, jnp.bfloat16]


def _pools(rng, host_pages, device_pages, page_size, heads, dim, dtype):
    shape = (page_size, heads, dim)
    host = [rand(rng, (host_pages, *shape), dtype) for _ in range(2)]
    dev = [poisoned((device_pages, *shape), np.float32).astype(dtype) for _ in range(2)]
    return host, dev


def _pairs(rng, n, host_pages, device_pages):
    return (rng.choice(host_pages, n, replace=False).astype(np.int32),
            rng.choice(device_pages, n, replace=False).astype(np.int32))


@settings(max_examples=12, deadline=None)
@given(page_size=st.sampled_from([1, 16, 64]), n=st.integers(0, 5), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1))
def test_load_and_write_back_roundtrip(page_size, n, dtype, seed):
    rng = np.random.default_rng(seed)
    host, dev = _pools(rng, 7, 6, page_size, 2, 8, dtype)
    hid, did = _pairs(rng, n, 7, 6)
    k, v = pc.load_pages(pinned(host[0]), pinned(host[1]), jnp.asarray(dev[0]), jnp.asarray(dev[1]), hid, did)
    chex.assert_shape([k, v], dev[0].shape)
    assert same(k, pc.copy_pages_reference(host[0], dev[0], hid, did))
    assert same(v, pc.copy_pages_reference(host[1], dev[1], hid, did))
    back_ids = rng.choice(7, n, replace=False).astype(np.int32)
    hk, hv = pc.write_back_pages(k, v, pinned(host[0]), pinned(host[1]), did, back_ids)
    assert hk.sharding.memory_kind == "pinned_host"
    assert same(hk, pc.copy_pages_reference(np.asarray(k), host[0], did, back_ids))
    assert same(hv, pc.copy_pages_reference(np.asarray(v), host[1], did, back_ids))


@pytest.mark.parametrize("num_programs", [1, 3, 64])
def test_all_layers_forms_match_per_layer(num_programs):
    rng = np.random.default_rng(1)
    layers, shape = 3, (5, 16, 2, 8)
    host = [rand(rng, shape, np.float32) for _ in range(2 * layers)]
    dev = [poisoned((4, *shape[1:]), np.float32) for _ in range(2 * layers)]
    hid, did = np.array([4, 0, 2], np.int32), np.array([1, 3, 0], np.int32)
    ks, vs = pc.load_pages_layers([pinned(h) for h in host[0::2]], [pinned(h) for h in host[1::2]],
                                  [jnp.asarray(d) for d in dev[0::2]], [jnp.asarray(d) for d in dev[1::2]],
                                  hid, did, num_programs=num_programs)
    for got, h, d in zip((*ks, *vs), (*host[0::2], *host[1::2]), (*dev[0::2], *dev[1::2])):
        assert same(got, pc.copy_pages_reference(h, d, hid, did))
    hks, hvs = pc.write_back_pages_layers(ks, vs, [pinned(h) for h in host[0::2]], [pinned(h) for h in host[1::2]],
                                          did, hid[::-1].copy(), num_programs=num_programs)
    for got, src, h in zip((*hks, *hvs), (*ks, *vs), (*host[0::2], *host[1::2])):
        assert got.sharding.memory_kind == "pinned_host"
        assert same(got, pc.copy_pages_reference(np.asarray(src), h, did, hid[::-1].copy()))


@settings(max_examples=10, deadline=None)
@given(page_size=st.sampled_from([1, 16, 64]), n=st.integers(0, 4), seed=st.integers(0, 2**31 - 1))
def test_gather_then_scatter(page_size, n, seed):
    rng = np.random.default_rng(seed)
    src = rand(rng, (6, page_size, 2, 4), np.float32)
    ids = rng.choice(6, n, replace=False).astype(np.int32)
    staging = pc.gather_pages(jnp.asarray(src), ids)
    chex.assert_shape(staging, (n, page_size, 2, 4))
    assert same(staging, src[ids])
    dst = poisoned((5, page_size, 2, 4), np.float32)
    to = rng.choice(5, n, replace=False).astype(np.int32)
    out = pc.scatter_pages(jnp.asarray(dst), staging, to)
    assert same(out, pc.copy_pages_reference(src[ids], dst, np.arange(n), to))


def test_staging_through_pinned_host_roundtrip():
    """The engine's path: gather on device, one device_put each way, scatter on device."""
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rand(rng, (8, 16, 2, 8), jnp.bfloat16)) for _ in range(2))
    ids = np.array([6, 1, 3], np.int32)
    host = jax.device_put(pc.gather_pages_layers([k, v], ids),
                          jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    back = jax.device_put(host, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device"))
    dk, dv = pc.scatter_pages_layers([jnp.zeros_like(k), jnp.zeros_like(v)], back, np.array([0, 2, 4], np.int32))
    assert same(np.asarray(dk)[[0, 2, 4]], np.asarray(k)[ids]) and same(np.asarray(dv)[[0, 2, 4]], np.asarray(v)[ids])


def test_repeated_identical_pairs_pad_a_transfer():
    rng = np.random.default_rng(5)
    h = pinned(rand(rng, (4, 16, 2, 8), np.float32))
    d = jnp.asarray(rand(rng, (5, 16, 2, 8), np.float32))
    expected = np.asarray(d).copy()
    expected[[3, 1]] = np.asarray(h)[[2, 0]]
    k, _ = pc.load_pages(h, h, jnp.array(d), jnp.array(d), np.array([2, 0, 0, 0], np.int32),
                         np.array([3, 1, 1, 1], np.int32))
    np.testing.assert_array_equal(np.asarray(k), expected)


def _bad_calls():
    rng = np.random.default_rng(3)
    h = pinned(rand(rng, (4, 16, 2, 8), np.float32))
    d = jnp.asarray(rand(rng, (3, 16, 2, 8), np.float32))
    ok = np.array([0, 1], np.int32)
    return [
        lambda: pc.load_pages(h, h, d, d, np.array([0, 4], np.int32), ok),  # host id out of range
        lambda: pc.load_pages(h, h, d, d, ok, np.array([-1, 0], np.int32)),  # negative device id
        lambda: pc.load_pages(h, h, d, d, ok, np.array([0], np.int32)),  # lengths differ
        lambda: pc.load_pages(h, h, d, d, ok.astype(np.int64), ok),  # wrong id dtype
        lambda: pc.load_pages(h, h, d, d, ok, np.array([1, 1], np.int32)),  # repeated destination
        lambda: pc.load_pages(h, h, d.astype(jnp.bfloat16), d.astype(jnp.bfloat16), ok, ok),  # dtype
        lambda: pc.load_pages(h, h, d[:, :8], d[:, :8], ok, ok),  # page shape
        lambda: pc.write_back_pages(d, d, h, h, ok, np.array([0, 9], np.int32)),
        lambda: pc.gather_pages(d, np.array([3], np.int32)),
        lambda: pc.scatter_pages(d, d[:1], ok),  # staging length != ids
    ]


@pytest.mark.parametrize("index", range(10))
def test_invalid_arguments_raise(index):
    with pytest.raises(ValueError):
        _bad_calls()[index]()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_load_write_back_staging(dtype):
    test_load_and_write_back_roundtrip.hypothesis.inner_test(page_size=64, n=5, dtype=dtype, seed=7)
    test_all_layers_forms_match_per_layer(num_programs=2)
    test_gather_then_scatter.hypothesis.inner_test(page_size=64, n=4, seed=8)
    test_staging_through_pinned_host_roundtrip()


@pytest.mark.gpu
def test_gpu_large_load_is_bit_exact():
    rng = np.random.default_rng(4)
    host = [rand(rng, (1024, 64, 2, 64), jnp.bfloat16) for _ in range(2)]
    dev = [jnp.asarray(rand(rng, (1024, 64, 2, 64), jnp.bfloat16)) for _ in range(2)]
    keep = [np.asarray(d) for d in dev]
    hid, did = _pairs(rng, 700, 1024, 1024)
    k, v = pc.load_pages(pinned(host[0]), pinned(host[1]), dev[0], dev[1], hid, did)
    assert same(k, pc.copy_pages_reference(host[0], keep[0], hid, did))
    assert same(v, pc.copy_pages_reference(host[1], keep[1], hid, did))


@settings(max_examples=10, deadline=None)
@given(page_size=st.sampled_from([1, 16, 64]), n=st.integers(0, 5), pad=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_scatter_rows_places_chosen_staging_rows(page_size, n, pad, seed):
    """The segments path's load placement: any rows of a staged segment -> any pages, padded pairs."""
    rng = np.random.default_rng(seed)
    staging = rand(rng, (2, 6, page_size, 2, 4), np.float32)
    rows = rng.choice(6, n, replace=False).astype(np.int32)
    pages = rng.choice(7, n, replace=False).astype(np.int32)
    if n:
        rows, pages = (np.concatenate([x, np.repeat(x[-1:], pad)]) for x in (rows, pages))
    k, v = (poisoned((7, page_size, 2, 4), np.float32) for _ in range(2))
    got = pc.scatter_rows_layers([jnp.asarray(k), jnp.asarray(v)], jnp.asarray(staging), rows, pages)
    for out, ref, src in zip(got, (k, v), staging):
        assert same(out, pc.copy_pages_reference(src, ref, rows, pages))


def test_scatter_rows_rejects_a_page_fed_by_two_rows():
    staging = jnp.ones((2, 4, 16, 2, 8), jnp.float32)
    k = jnp.zeros((5, 16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="two different source"):
        pc.scatter_rows_layers([k, k], staging, np.array([0, 1], np.int32), np.array([3, 3], np.int32))
