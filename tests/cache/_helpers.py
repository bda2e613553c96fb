"""Shared helpers for the cache tests: tiny real pools whose page contents are derived from token
ids."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.cache import Copier, DevicePool, HostPool, PoolLayout, PrefixCache, Transfers
from jhicache.cache.copier import Direction, Mark
from jhicache.config import TransferTuning, WritePolicy

LAYERS, HEADS, HEAD_DIM = 2, 1, 4


class DeferredCopier(Copier):
    """Two in-order queues whose copies run as late as they may: only when a mark is waited
    for (or a queue ordered after it runs). A reader that skips its wait sees stale bytes."""

    synchronous = False

    def __init__(self) -> None:
        self.queues: dict[Direction, list[tuple]] = {d: [] for d in Direction}
        self.copies = 0

    def copy(self, direction: Direction, dsts, srcs, sizes) -> None:
        self.queues[direction].append(("copy", dsts.tolist(), srcs.tolist(), sizes.tolist()))

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        mark = Mark(0, timed)
        self.queues[direction].append(("mark", mark))
        return mark

    def wait(self, mark: Mark) -> None:
        for direction, queue in self.queues.items():
            if any(item[0] == "mark" and item[1] is mark for item in queue):
                self._run(direction, mark)

    def order_after(self, direction: Direction, mark: Mark) -> None:
        if not mark.done:
            self.queues[direction].append(("after", mark))

    def signal(self, direction: Direction, addresses, value: int) -> None:
        self.queues[direction].append(("signal", addresses.tolist(), value))

    def _run(self, direction: Direction, until: Mark) -> None:
        queue = self.queues[direction]
        while not until.done:
            item = queue.pop(0)
            if item[0] == "copy":
                for dst, src, size in zip(*item[1:]):
                    ctypes.memmove(dst, src, size)
                self.copies += 1
            elif item[0] == "mark":
                item[1].done = True
            elif item[0] == "signal":
                for address in item[1]:
                    ctypes.c_int32.from_address(address).value = item[2]
            else:
                self.wait(item[1])


def make_cache(page_size: int, device_pages: int, host_pages: int | None,
               policy: WritePolicy = WritePolicy.WRITE_BACK, copier: Copier | None = None,
               layers: int = LAYERS, **kwargs: object) -> PrefixCache:
    """A cache over real pools; device_pages/host_pages are usable pages (device page 0 extra);
    `copier` None copies at once (the CPU's HostCopier)."""
    layout = PoolLayout(layers, device_pages + 1, page_size, HEADS, HEAD_DIM, jnp.float32)
    host_layout = PoolLayout(layers, host_pages or 1, page_size, HEADS, HEAD_DIM, jnp.float32)
    host = HostPool(host_layout) if host_pages else None
    pool = DevicePool(layout)
    transfers = (None if copier is None or host is None
                 else Transfers(pool, host, copier, TransferTuning()))
    return PrefixCache(page_size, pool, host, policy, transfers=transfers, **kwargs)


def expected_kv(tokens: Sequence[int], layer: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The KV a 'forward' writes for `tokens`: a function of (token, position, layer), per page."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None, None]
    d = np.arange(HEAD_DIM, dtype=np.float32)[None, None, :]
    k = t * 1000 + pos * 10 + layer * 0.5 + d * 0.125 + np.zeros((1, HEADS, 1), np.float32)
    shape = (len(tokens) // page_size, page_size, HEADS, HEAD_DIM)
    return k.reshape(shape), (-k).reshape(shape)


def write_kv(cache: PrefixCache, tokens: Sequence[int], pages: Sequence[int],
             start: int = 0) -> None:
    """Simulates the forward: writes tokens[start:]'s KV into pages[start // page_size:]."""
    p, pool = cache.page_size, cache.device_pool
    if start >= len(tokens):
        return
    ids = jnp.asarray(np.asarray(pages[start // p:], np.int32))
    for layer in range(pool.num_layers):
        k, v = expected_kv(tokens, layer, p)
        pool.set_layer(layer, *_set_pages(pool.k[layer], pool.v[layer], ids, k[start // p:],
                                          v[start // p:]))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_pages(k_pages, v_pages, ids, k, v):
    """In place, as the model's kernels write (copies in flight target the pool's buffers)."""
    return k_pages.at[ids].set(k), v_pages.at[ids].set(v)


def assert_device_kv(cache: PrefixCache, tokens: Sequence[int], pages: Sequence[int]) -> None:
    """The device pages hold exactly the KV of `tokens` (a wrong page shows as wrong data)."""
    assert len(pages) * cache.page_size == len(tokens)
    for layer in range(cache.device_pool.num_layers):
        k, v = cache.device_pool.read_pages(layer, list(pages))
        ek, ev = expected_kv(tokens, layer, cache.page_size)
        np.testing.assert_array_equal(k, ek)
        np.testing.assert_array_equal(v, ev)


def prefill(cache: PrefixCache, tokens: Sequence[int]) -> int:
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
