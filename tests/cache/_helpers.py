"""Shared helpers for the cache tests: tiny real pools whose page contents are derived from token ids."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.cache import CopyFns, DevicePool, PoolLayout, TieredCache, make_host_pool
from jhicache.config import TransferPath, WritePolicy

LAYERS, HEADS, HEAD_DIM = 2, 1, 4
PATHS = list(TransferPath)


@functools.partial(jax.jit, donate_argnums=(2, 3))
def _jnp_load(hk, hv, dk, dv, host_ids, device_ids):
    hk, hv = (jax.device_put(x, jax.memory.Space.Device) for x in (hk, hv))
    return dk.at[device_ids].set(hk[host_ids]), dv.at[device_ids].set(hv[host_ids])


@functools.partial(jax.jit, donate_argnums=(2, 3))
def _jnp_write_back(dk, dv, hk, hv, device_ids, host_ids):
    hk, hv = (jax.device_put(x, jax.memory.Space.Device) for x in (hk, hv))
    out = hk.at[host_ids].set(dk[device_ids]), hv.at[host_ids].set(dv[device_ids])
    return tuple(jax.device_put(x, jax.memory.Space.Host) for x in out)


JNP_COPY = CopyFns(_jnp_load, _jnp_write_back)


def make_cache(page_size: int, device_pages: int, host_pages: int | None,
               policy: WritePolicy = WritePolicy.WRITE_BACK, copy_fns: CopyFns | None = JNP_COPY,
               path: TransferPath = TransferPath.PAGES, layers: int = LAYERS, **kwargs: object) -> TieredCache:
    """A cache over real pools; device_pages/host_pages are usable pages (device page 0 extra);
    `path` picks the host layout (`copy_fns` only matter on the pages path)."""
    layout = PoolLayout(layers, device_pages + 1, page_size, HEADS, HEAD_DIM, jnp.float32)
    host_layout = PoolLayout(layers, host_pages or 1, page_size, HEADS, HEAD_DIM, jnp.float32)
    host = make_host_pool(host_layout, path) if host_pages else None
    return TieredCache(page_size, DevicePool(layout), host, policy, copy_fns=copy_fns, **kwargs)


def expected_kv(tokens: Sequence[int], layer: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The KV a 'forward' writes for `tokens`: a function of (token, position, layer), per page."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None, None]
    d = np.arange(HEAD_DIM, dtype=np.float32)[None, None, :]
    k = t * 1000 + pos * 10 + layer * 0.5 + d * 0.125 + np.zeros((1, HEADS, 1), np.float32)
    shape = (len(tokens) // page_size, page_size, HEADS, HEAD_DIM)
    return k.reshape(shape), (-k).reshape(shape)


def write_kv(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], start: int = 0) -> None:
    """Simulates the forward: writes tokens[start:]'s KV into pages[start // page_size:]."""
    p, pool = cache.page_size, cache.device_pool
    if start >= len(tokens):
        return
    ids = jnp.asarray(np.asarray(pages[start // p:], np.int32))
    for layer in range(pool.num_layers):
        k, v = expected_kv(tokens, layer, p)
        pool.set_layer(layer, pool.k[layer].at[ids].set(k[start // p:]), pool.v[layer].at[ids].set(v[start // p:]))


def assert_device_kv(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int]) -> None:
    """The device pages hold exactly the KV of `tokens` (a wrong page shows as wrong data)."""
    assert len(pages) * cache.page_size == len(tokens)
    for layer in range(cache.device_pool.num_layers):
        k, v = cache.device_pool.read_pages(layer, list(pages))
        ek, ev = expected_kv(tokens, layer, cache.page_size)
        np.testing.assert_array_equal(k, ek)
        np.testing.assert_array_equal(v, ev)


def prefill(cache: TieredCache, tokens: Sequence[int]) -> int:
    """One request end to end: match, lock, allocate, 'forward', insert, free duplicates, unlock.

    Returns the device prefix length that was reused. Raises if pages cannot be allocated."""
    m = cache.match(tokens)
    cache.lock(m.last_device_node)
    try:
        new = cache.alloc_device((len(tokens) - m.device_len) // cache.page_size)
        assert new is not None, "out of device pages"
        pages = m.device_pages + new
        write_kv(cache, tokens, pages, m.device_len)
        prefix = cache.insert(tokens, pages)
        cache.free_device(pages[m.device_len // cache.page_size:prefix // cache.page_size])
    finally:
        cache.unlock(m.last_device_node)
    return m.device_len
