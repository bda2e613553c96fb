"""The segmented host tier: node splits, per-half loads, segment refcounts, tickets that never run."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from jhicache.cache import InvariantError, TieredCache, layer_groups
from jhicache.cache.segment_transfer import STAGING_BYTES, SegmentLoad, segment_chunks, segment_rows
from jhicache.config import TransferPath
from tests.cache._helpers import PATHS, assert_device_kv, expected_kv, make_cache, prefill, write_kv


def seq(tag: int, pages: int, page_size: int) -> list[int]:
    return [tag * 10_000 + i for i in range(pages * page_size)]


def to_host(cache: TieredCache) -> None:
    cache.evict_device(cache.tree.evictable_pages)
    cache.flush()
    cache.check_invariants()


def load(cache: TieredCache, tokens: list[int]) -> list[int]:
    """Loads the host run of `tokens` back; returns every device page of the match."""
    m = cache.match(tokens)
    ticket = cache.load_back(m)
    assert ticket is not None
    cache.check_invariants()
    cache.launch()
    ticket.wait_all()
    assert cache.poll() >= 1
    cache.check_invariants()
    return m.device_pages + list(ticket.device_pages)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page", [1, 16])
def test_host_only_split_then_load_of_each_half(page: int, path: TransferPath) -> None:
    cache = make_cache(page, device_pages=4, host_pages=8, load_back_threshold=0, path=path)
    a = seq(1, 4, page)
    prefill(cache, a)
    to_host(cache)  # one host-only node, one segment
    half = a[:2 * page]
    assert cache.match(half).host_len == len(half)  # the partial match splits the node
    assert len(list(cache.tree.nodes())) == 2
    cache.check_invariants()
    assert_device_kv(cache, half, load(cache, half))
    pages = load(cache, a)  # the second half, from the middle rows of the same segment
    assert_device_kv(cache, a, pages)
    to_host(cache)
    assert_device_kv(cache, a, load(cache, a))


@pytest.mark.parametrize("page", [1, 4])
def test_segment_refcounts_follow_host_pages(page: int) -> None:
    cache = make_cache(page, device_pages=4, host_pages=6, load_back_threshold=0, path=TransferPath.SEGMENTS)
    a, b = seq(1, 2, page), seq(2, 2, page)
    prefill(cache, a)
    prefill(cache, b)
    to_host(cache)  # a and b written back in one launch: one segment each, 2 live pages each
    assert cache.stats()["host_segments"] == 2
    cache.match(a[:page])  # split a: its segment is shared by two nodes
    assert cache.evict_host(1) == 1  # host-evicts one page of an LRU leaf: the segments stay
    assert cache.stats()["host_segments"] == 2
    cache.check_invariants()
    assert cache.evict_host(6) == 3 and cache.stats()["host_segments"] == 0  # all gone: dropped
    cache.check_invariants()
    c = seq(3, 2, page)
    prefill(cache, c)
    to_host(cache)
    assert_device_kv(cache, c, load(cache, c))


def test_invariants_catch_broken_segment_accounting() -> None:
    cache = make_cache(2, device_pages=4, host_pages=4, path=TransferPath.SEGMENTS)
    prefill(cache, seq(1, 2, 2))
    to_host(cache)
    segment = next(iter(cache.host_pool._segments.values()))
    segment.live += 1
    with pytest.raises(InvariantError, match="refcount"):
        cache.check_invariants()
    segment.live -= 1
    cache.host_pool.release([cache.match(seq(1, 2, 2)).last_node.host_pages[0]])
    with pytest.raises(InvariantError, match="no data"):
        cache.check_invariants()


def test_ticket_of_a_batch_that_never_ran_is_completed_by_poll() -> None:
    """Admission failed after the load was queued: poll dispatches every layer, the lock goes."""
    cache = make_cache(4, device_pages=4, host_pages=8, load_back_threshold=0, path=TransferPath.SEGMENTS)
    a, b = seq(1, 2, 4), seq(2, 2, 4)
    prefill(cache, a)
    to_host(cache)
    ticket = cache.load_back(cache.match(a))
    assert ticket is not None
    cache.launch()
    assert not ticket.done() and cache.stats()["protected_tokens"] == len(a)
    cache.poll()  # drives the orphan: all layers dispatched
    ticket.wait_all()
    cache.poll()
    assert cache.stats()["protected_tokens"] == 0 and cache.stats()["loads_in_flight"] == 0
    assert_device_kv(cache, a, cache.match(a).device_pages)
    prefill(cache, b)  # the pool keeps working
    cache.check_invariants()


def test_drive_loads_dispatches_without_waiting_and_survives_donation() -> None:
    cache = make_cache(4, device_pages=4, host_pages=8, load_back_threshold=0, path=TransferPath.SEGMENTS)
    a = seq(1, 3, 4)
    prefill(cache, a)
    to_host(cache)
    ticket = cache.load_back(cache.match(a))
    assert ticket is not None
    cache.launch()
    ticket.wait(0)  # layer group 0 (layer 0) scattered, group 1's DMA queued
    load_ = cache.controller._in_flight[-1].copies
    assert isinstance(load_, SegmentLoad) and len(load_.outputs) == 1 and list(load_._staged) == [1]
    cache.drive_loads()
    assert load_.dispatched
    write_kv(cache, a[:4], [0])  # a 'forward' donating every layer (writes the sink page 0)
    ticket.wait_all()
    assert ticket.done()
    assert_device_kv(cache, a, list(ticket.device_pages))


@pytest.mark.parametrize("staging_bytes", [1, STAGING_BYTES])  # two groups ahead only / all DMAs at launch
def test_merged_load_of_two_segments_over_layer_groups_lands_layer_by_layer(staging_bytes: int) -> None:
    """7 layers load in groups 1, 2, 4 from two segments; a 'forward' donates each layer in between."""
    cache = make_cache(4, device_pages=8, host_pages=8, load_back_threshold=0, path=TransferPath.SEGMENTS, layers=7)
    cache.controller.staging_bytes = staging_bytes
    a, c = seq(1, 3, 4), seq(2, 2, 4)
    for tokens in (a, c):  # two write-back launches: two segments
        prefill(cache, tokens)
        to_host(cache)
    tickets = [cache.load_back(cache.match(tokens)) for tokens in (a, c)]
    assert all(t is not None for t in tickets)
    cache.launch()
    load_ = cache.controller._in_flight[-1].copies
    assert isinstance(load_, SegmentLoad) and len(load_.parts) == 2
    pool = cache.device_pool
    bump_sink = jax.jit(lambda k, v: (k.at[0].add(1.0), v.at[0].add(1.0)), donate_argnums=(0, 1))
    for layer in range(7):
        for ticket in tickets:
            ticket.wait(layer)  # must have dispatched this layer's scatter, whatever its group
        for tokens, ticket in zip((a, c), tickets):
            k, v = pool.read_pages(layer, list(ticket.device_pages))
            np.testing.assert_array_equal(k, expected_kv(tokens, layer, 4)[0])
        pool.set_layer(layer, *bump_sink(pool.k[layer], pool.v[layer]))  # a 'forward' donating the layer
    for ticket in tickets:
        ticket.wait_all()
    assert cache.poll() >= 1
    assert_device_kv(cache, a, list(tickets[0].device_pages))
    assert_device_kv(cache, c, list(tickets[1].device_pages))
    cache.check_invariants()


def test_staging_window_bounds_the_dmas_queued_ahead_of_the_scatters() -> None:
    """Groups (1, 2, 4 layers) are DMA'd while their staged bytes fit, never fewer than two ahead."""
    a = seq(1, 3, 4)
    for staging_bytes, at_launch, after_group_0 in ((1, [0, 1], [1, 2]), (1 << 30, [0, 1, 2], [1, 2])):
        cache = make_cache(4, device_pages=4, host_pages=8, load_back_threshold=0, path=TransferPath.SEGMENTS, layers=7)
        cache.controller.staging_bytes = staging_bytes
        prefill(cache, a)
        to_host(cache)
        ticket = cache.load_back(cache.match(a))
        cache.launch()
        load_ = cache.controller._in_flight[-1].copies
        assert sorted(load_._staged) == at_launch
        ticket.wait(0)
        assert sorted(load_._staged) == after_group_0
        ticket.wait_all()
        assert not load_._staged
        assert_device_kv(cache, a, list(ticket.device_pages))


def test_layer_groups_cover_every_layer_once_growing_to_four() -> None:
    expected = {1: [1], 2: [1, 1], 3: [1, 2], 7: [1, 2, 4], 24: [1, 2, 4, 4, 4, 4, 4, 1], 28: [1, 2] + [4] * 6 + [1]}
    for n, sizes in expected.items():
        groups = layer_groups(n)
        assert [len(g) for g in groups] == sizes
        assert [layer for g in groups for layer in g] == list(range(n))


def test_a_load_moves_only_its_own_nodes_segments() -> None:
    """Two nodes evicted in one write-back launch land in separate segments, so loading one moves
    (over PCIe, as whole arrays) only its own pages' segment."""
    cache = make_cache(4, device_pages=8, host_pages=8, load_back_threshold=0, path=TransferPath.SEGMENTS)
    a, b = seq(1, 3, 4), seq(2, 2, 4)
    prefill(cache, a)
    prefill(cache, b)
    to_host(cache)
    assert cache.stats()["host_segments"] == 2
    assert_device_kv(cache, b, load(cache, b))
    stats = cache.stats()
    segment_bytes = segment_rows(2) * cache.device_pool.layout.page_bytes
    assert stats["load_back_bytes"] == 2 * cache.device_pool.layout.page_bytes
    assert stats["load_back_moved_bytes"] == segment_bytes  # not a's 3 pages as well


@pytest.mark.parametrize("path", PATHS)
def test_write_backs_are_timed_once_from_launch_to_done(path: TransferPath) -> None:
    cache = make_cache(4, device_pages=4, host_pages=8, path=path)
    prefill(cache, seq(1, 3, 4))
    start = time.perf_counter()
    cache.evict_device(cache.tree.evictable_pages)
    cache.launch()
    for _ in range(10_000):  # what the engine does while a forward runs
        cache.time_writes()
        if cache.stats()["write_back_s"] > 0:
            break
    timed = cache.stats()["write_back_s"]
    assert 0 < timed <= time.perf_counter() - start
    cache.flush()
    cache.time_writes()
    assert cache.stats()["write_back_s"] == timed  # counted once


def test_op_over_16_pages_is_cut_into_segments_and_loads_back_exactly() -> None:
    """A 45-page node becomes segments of 32 and 13 pages; a split across their boundary still
    loads back bit-exact, moving both segments whole."""
    n = 45
    cache = make_cache(1, device_pages=64, host_pages=64, load_back_threshold=0, path=TransferPath.SEGMENTS, layers=7)
    a = seq(1, n, 1)
    prefill(cache, a)
    to_host(cache)
    assert segment_chunks(n) == [32, 13] and cache.stats()["host_segments"] == 2
    cache.match(a[:20])  # splits the node inside the first segment
    assert_device_kv(cache, a, load(cache, a))
    moved = sum(segment_rows(size) for size in segment_chunks(n)) * cache.device_pool.layout.page_bytes
    assert cache.stats()["load_back_moved_bytes"] == moved
    cache.check_invariants()


def test_segment_chunks_cover_n_with_little_padding() -> None:
    assert segment_chunks(129) == [128, 1] and segment_chunks(16) == [16] and segment_chunks(200) == [128, 64, 8]
    for n in range(1, 3000):
        sizes = segment_chunks(n)
        assert sum(sizes) == n and len(sizes) <= 4
        padded = sum(segment_rows(size) for size in sizes)
        assert padded - n <= max(4, 0.04 * n), (n, sizes)


def test_segment_rows_buckets() -> None:
    assert [segment_rows(n) for n in (1, 3, 4, 5, 9, 17, 33, 128, 129)] == [1, 4, 4, 5, 10, 20, 40, 128, 160]
    assert all(n <= segment_rows(n) <= 1.25 * n + 1 for n in range(1, 2000))
