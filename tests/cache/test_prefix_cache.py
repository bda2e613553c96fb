"""PrefixCache behaviours of spec §6.1 / §7.3 on real tiny pools, each write policy x page size."""

from __future__ import annotations

import numpy as np
import pytest

from jhicache.cache import PrefixCache
from jhicache.config import WritePolicy
from tests.cache._helpers import assert_device_kv, expected_kv, make_cache, prefill, write_kv

POLICIES = list(WritePolicy)
PAGE_SIZES = [1, 16, 64]


def seq(tag: int, pages: int, page_size: int) -> list[int]:
    return [tag * 10_000 + i for i in range(pages * page_size)]


def check(cache: PrefixCache) -> None:
    cache.check_invariants()


def host_pages_of(cache: PrefixCache, tokens: list[int]) -> list[int]:
    m = cache.match(tokens)
    run = cache._host_run(m.last_node)
    return [p for n in run for p in (n.host_pages or [])]


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("policy", POLICIES)
def test_round_trip_through_host(policy: WritePolicy, page: int) -> None:
    """Fill device past capacity, re-request the first prompt: host hit, load-back, right data,
    then a device hit. Under write_through_selective the first prompt needs a second visit."""
    cache = make_cache(page, device_pages=4, host_pages=8, policy=policy, load_back_threshold=page)
    a, b, c = (seq(t, 2, page) for t in (1, 2, 3))
    prefill(cache, a)
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        prefill(cache, a)  # second insert visit -> written through
    prefill(cache, b)
    check(cache)
    prefill(cache, c)  # evicts a (LRU)
    check(cache)
    m = cache.match(a)
    assert (m.device_len, m.host_len) == (0, len(a))
    ticket = cache.load_back(m)
    assert ticket is not None and len(ticket.device_pages) == 2
    check(cache)
    with cache.step() as transfers:
        assert transfers.start_loads([ticket]) == 1  # the first load's flag value
    ticket.wait_all()  # blocks until every layer has landed
    assert ticket.done()
    with cache.step() as transfers:
        assert transfers.poll() == 0  # retired on entering the step
    assert cache.stats()["loads_in_flight"] == 0
    assert_device_kv(cache, a, list(ticket.device_pages))
    again = cache.match(a)
    assert (again.device_len, again.host_len) == (len(a), 0)
    assert again.device_pages == list(ticket.device_pages)
    check(cache)


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_with_and_without_host_copy(policy: WritePolicy, page: int) -> None:
    cache = make_cache(page, device_pages=4, host_pages=8, policy=policy)
    a, b = seq(1, 2, page), seq(2, 2, page)
    prefill(cache, a)
    prefill(cache, b)
    cache.flush()
    before = cache.stats()["write_back_ops"]
    assert cache.evict_device(2) == 2  # a is LRU
    stats = cache.stats()
    m = cache.match(a)
    if policy is WritePolicy.WRITE_THROUGH:  # already on host: device pages dropped, no new copy
        assert stats["write_back_ops"] == before and m.host_len == len(a)
    elif policy is WritePolicy.WRITE_BACK:  # dirty: written back now
        assert stats["write_back_ops"] == before + 1 and m.host_len == len(a)
    else:  # selective, one visit only: not hot, deleted (KV lost by design)
        assert stats["dropped_nodes"] == 1 and (m.device_len, m.host_len) == (0, 0)
    check(cache)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_write_back_is_ordered_before_reuse_of_freed_pages(page: int) -> None:
    """The evicted pages are reused (and overwritten by a donating kernel) right after the
    write-back is dispatched, without waiting: the host copy still holds the old data."""
    cache = make_cache(page, device_pages=2, host_pages=4)
    a, b = seq(1, 2, page), seq(2, 2, page)
    prefill(cache, a)
    old_pages = cache.match(a).device_pages
    prefill(cache, b)  # evicts a, then writes b's KV into the same pages
    assert sorted(cache.match(b).device_pages) == sorted(old_pages)
    host = host_pages_of(cache, a)
    cache.flush()
    for layer in range(2):
        k, v = cache.host_pool.read_pages(layer, host)
        ek, ev = expected_kv(a, layer, page)
        np.testing.assert_array_equal(k, ek)
        np.testing.assert_array_equal(v, ev)


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("policy", POLICIES)
def test_insert_over_host_only_excludes_adopted_tokens(policy: WritePolicy, page: int) -> None:
    """Recomputing an evicted prompt instead of loading it: the tree adopts the new pages, keeps
    the host copy, returns only the on-device prefix, and the caller frees nothing twice."""
    cache = make_cache(page, device_pages=6, host_pages=8, policy=policy, load_back_threshold=10**9)
    root, a = seq(1, 1, page), seq(1, 3, page)
    prefill(cache, root)
    prefill(cache, root)
    prefill(cache, a)
    prefill(cache, a)
    tail = cache.match(a).last_node
    cache.flush()
    cache.evict_device(cache.tree.evictable_pages)  # everything leaves the device
    check(cache)
    m = cache.match(a)
    assert m.device_len + m.host_len == len(a)
    assert cache.load_back(m) is None  # threshold: recompute instead
    pages = cache.alloc_device(3)
    assert pages is not None
    write_kv(cache, a, pages)
    prefix = cache.insert(a, pages)
    assert prefix == m.device_len  # adopted tokens not counted
    cache.free_device(pages[:prefix // page])  # duplicates only
    check(cache)
    m2 = cache.match(a)
    assert (m2.device_len, m2.host_len) == (len(a), 0)
    assert_device_kv(cache, a, m2.device_pages)
    assert m2.last_node.host_pages is not None or tail.host_pages is not None


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_host_eviction_only_removes_host_only_leaves(page: int) -> None:
    cache = make_cache(page, device_pages=4, host_pages=4, policy=WritePolicy.WRITE_THROUGH)
    a, b, c = seq(1, 2, page), seq(2, 2, page), seq(3, 2, page)
    prefill(cache, a)
    prefill(cache, b)  # host: copies of a and b (both on device too)
    cache.flush()
    assert cache._evict_host(4) == 0  # host copies of on-device nodes are never host-evicted
    prefill(cache, c)  # device evicts a (host copy exists); c's write-through host-evicts a
    check(cache)
    assert cache.match(a).host_len == 0 and cache.stats()["evicted_host_tokens"] == len(a)
    m = cache.match(b)
    assert m.device_len == len(b) and m.last_node.host_pages is not None


@pytest.mark.parametrize("page", [1, 16])
def test_load_back_threshold_quota_and_all_or_nothing(page: int) -> None:
    cache = make_cache(page, device_pages=4, host_pages=8, load_back_threshold=2 * page)
    short, a, b = seq(1, 1, page), seq(2, 2, page), seq(3, 4, page)
    prefill(cache, short)
    prefill(cache, a)
    prefill(cache, b)  # evicts short and a to host
    check(cache)
    assert cache.load_back(cache.match(short)) is None  # below threshold
    assert cache.stats()["load_back_skipped"] == 1
    m = cache.match(a)
    assert cache.load_back(m, quota_pages=1) is None
    assert cache.stats()["load_back_over_quota"] == 1
    cache.lock(cache.match(b).last_node)  # no device page can be freed now
    assert cache.load_back(m) is None and cache.stats()["load_back_failures"] == 1
    assert cache.match(a).host_len == len(a)  # nothing partially loaded
    check(cache)
    cache.unlock(cache.match(b).last_node)
    ticket = cache.load_back(cache.match(a))
    assert ticket is not None
    assert cache.stats()["protected_tokens"] == len(a)  # locked until the load completes
    cache.flush()
    assert cache.stats()["protected_tokens"] == 0
    assert_device_kv(cache, a, list(ticket.device_pages))
    check(cache)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_dirty_node_without_host_room_is_dropped_with_its_host_only_descendants(page: int) -> None:
    cache = make_cache(page, device_pages=4, host_pages=1)
    p, c, d = seq(1, 2, page), seq(2, 1, page), seq(3, 1, page)
    prefill(cache, p + c)
    prefill(cache, p + d)  # P (2 pages) with children C and D: device full
    assert cache.evict_device(1) == 1  # C written back: host full
    check(cache)
    # D written back (host-evicts C), P has no room: dropped with D
    assert cache.evict_device(3) == 3
    stats = cache.stats()
    assert stats["dropped_nodes"] == 1 and stats["dropped_tokens"] == len(p)
    assert stats["evicted_host_tokens"] == 2 * page  # C by host eviction, D with P
    assert list(cache.tree.nodes()) == []  # no orphans
    check(cache)
    assert cache.host is not None and cache.host.pages.num_free == 1


def test_bad_input_and_graceful_degradation() -> None:
    cache = make_cache(4, device_pages=4, host_pages=2, policy=WritePolicy.WRITE_THROUGH)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1])
    with pytest.raises(ValueError):
        make_cache(4, 4, 2).alloc_device(-1)
    a, b = seq(1, 2, 4), seq(2, 2, 4)
    prefill(cache, a)
    prefill(cache, b)  # host pool full with a's copy: b stays device-only (counted)
    assert cache.stats()["write_through_failures"] == 1
    node = cache.match(a).last_node
    cache.lock(node)
    assert cache.alloc_device(3) is None  # only 2 evictable + 0 free: nothing evicted
    assert cache.stats()["alloc_failures"] == 1 and cache.match(b).device_len == len(b)
    assert cache.evict_device(10) == 2  # more than evictable: evicts what it can
    cache.unlock(node)
    with pytest.raises(ValueError, match="below zero"):
        cache.unlock(node)
    check(cache)
    with pytest.raises(ValueError, match="double free"):
        cache.free_device([cache.device.pages.free_pages().pop()])
    check(cache)


def test_page_counts_for_callers_outside_the_cache() -> None:
    """device.available = free + unlocked tree pages: exactly what alloc_device can get."""
    cache = make_cache(4, device_pages=6, host_pages=3)
    assert (cache.device.capacity, cache.host.capacity) == (6, 3)
    a, b = seq(1, 2, 4), seq(2, 1, 4)
    prefill(cache, a)
    prefill(cache, b)
    held = cache.alloc_device(1)  # a request's private page: neither free nor evictable
    assert held is not None
    node = cache.match(a).last_node
    cache.lock(node)  # a's 2 pages are protected now
    assert (cache.device.num_free, cache.device.evictable_pages) == (2, 1)
    assert cache.device.available == 3
    assert cache.alloc_device(4) is None
    got = cache.alloc_device(3)  # evicts b
    assert got is not None and cache.device.available == 0
    assert cache.host is not None and cache.host.num_free == 2  # b's write-back took a page
    cache.free_device(got + held)
    cache.unlock(node)
    check(cache)
    assert make_cache(4, device_pages=2, host_pages=None).host is None


def test_device_only_cache() -> None:
    cache = make_cache(2, device_pages=4, host_pages=None)
    a, b = seq(1, 2, 2), seq(2, 3, 2)
    prefill(cache, a)
    prefill(cache, b)  # drops a
    assert cache.match(a).device_len == 0 and cache.stats()["dropped_nodes"] == 1
    assert cache.load_back(cache.match(a)) is None and cache.flush() == 0
    check(cache)


def test_running_request_pages_in_invariants() -> None:
    cache = make_cache(1, device_pages=4, host_pages=4)
    held = cache.alloc_device(3)
    assert held is not None
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_invariants()
    cache.check_invariants(extra_owned_device_pages=held)
    with pytest.raises(AssertionError, match="owned twice"):
        cache.check_invariants(extra_owned_device_pages=held + held[:1])
