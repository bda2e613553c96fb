"""Transfers (write-backs, load-backs) and LoadTicket: merged launches, per-layer landing, and
the fences that order copies JAX does not see (HostCopier copies at once; DeferredCopier as
late as it may)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.buckets import pow2_bucket
from jhicache.cache import Transfers, make_copier, write_back
from jhicache.cache.copier import CudaCopier, Direction, Mark
from jhicache.cache.cuda_driver import CudaDriver
from jhicache.config import TransferTuning, WritePolicy
from tests.cache._helpers import (
    DeferredCopier,
    assert_device_kv,
    expected_kv,
    make_cache,
    prefill,
    write_kv,
)
from tests.cache.fake_cuda import FakeCudaLib

# None: the CPU's HostCopier; "fake_cuda": CudaCopier and CudaDriver over a stand-in for libcuda
# whose streams run lazily (tests.cache.fake_cuda), so the driver path runs on the CPU too
COPIERS = [None, DeferredCopier, "fake_cuda", pytest.param("gpu", marks=pytest.mark.gpu)]


def _copier(kind):
    if kind == "gpu":
        return make_copier("gpu")[0]
    if kind == "fake_cuda":
        return CudaCopier(CudaDriver(FakeCudaLib()))
    return kind() if kind is not None else None


def _written_back(cache, tokens: list[int], host_pages: list[int]) -> list[int]:
    """Device pages holding `tokens`' KV, copied to `host_pages` and the copy finished."""
    pages = cache.alloc_device(len(host_pages))
    write_kv(cache, tokens, pages)
    cache.transfers.queue_write_back(pages, host_pages)
    cache.transfers.flush()
    return pages


@pytest.mark.parametrize("copier", COPIERS)
def test_controller_merges_launches_and_reports_completion(copier) -> None:
    _controller_round_trip(_copier(copier))


def _controller_round_trip(copier) -> None:
    cache = make_cache(4, device_pages=6, host_pages=6, copier=copier)
    ctl = cache.transfers
    assert isinstance(ctl, Transfers)
    a, b = list(range(8)), list(range(100, 108))
    pages = cache.alloc_device(4)
    assert pages is not None
    write_kv(cache, a, pages[:2])
    write_kv(cache, b, pages[2:])
    ctl.queue_write_back(pages[:2], [4, 5])
    ctl.queue_write_back(pages[2:], [0, 1])
    assert ctl.poll() == [] and (len(ctl.writes.queued) + len(ctl.loads.queued)) == 2
    ctl.launch()
    assert (ctl.counters["write_back_launches"] == 1
            and ctl.counters["write_back_ops"] == 2)  # merged
    done = ctl.flush()
    assert [op.kind.value for op in done] == ["write_back", "write_back"]
    for layer in range(2):
        k, v = cache.host_pool.read_pages(layer, [4, 5, 0, 1])
        np.testing.assert_array_equal(k[:2], expected_kv(a, layer, 4)[0])
        np.testing.assert_array_equal(v[2:], expected_kv(b, layer, 4)[1])
    ticket = ctl.queue_load_back([0, 1, 4, 5], pages)
    with pytest.raises(RuntimeError, match="not launched"):
        ticket.wait_all()
    with pytest.raises(RuntimeError, match="not launched"):
        ticket.gate_seq()
    assert not ticket.done()
    ctl.launch()
    ticket.wait_all()
    assert ticket.done() and [op.op_id for op in ctl.poll()] == [ticket.op_id]
    assert_device_kv(cache, b, pages[:2])
    assert_device_kv(cache, a, pages[2:])


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_cache_round_trip(policy: WritePolicy, copier) -> None:
    _cache_round_trip(policy, _copier(copier))


def _cache_round_trip(policy: WritePolicy, copier) -> None:
    cache = make_cache(16, device_pages=4, host_pages=8, policy=policy, copier=copier)
    prompts = [[t * 1000 + i for i in range(32)] for t in range(3)]
    for tokens in prompts:
        prefill(cache, tokens)
        prefill(cache, tokens)
        cache.check_invariants()
    m = cache.match(prompts[0])
    assert m.host_len == 32
    ticket = cache.load_back(m)
    assert ticket is not None
    cache.transfers.launch()
    ticket.wait_all()
    assert_device_kv(cache, prompts[0], list(ticket.device_pages))
    cache.flush()
    cache.check_invariants()


def _launched_load_of_host_only(cache, tokens: list[int]):
    """`tokens` cached, pushed to host only, every free device page overwritten with other data
    (so a load must replace it), then their load launched: its ticket."""
    prefill(cache, tokens)
    cache.evict_device(cache.tree.evictable_pages)
    cache.flush()
    free = cache.device.pages.num_free
    junk = cache.alloc_device(free)
    write_kv(cache, list(range(10_000, 10_000 + free * cache.page_size)), junk)
    cache.free_device(junk)
    ticket = cache.load_back(cache.match(tokens))
    assert ticket is not None
    cache.transfers.launch()
    return ticket


def test_each_layer_flag_is_set_only_after_that_layers_copies() -> None:
    """Stepping a deferred copy queue one item at a time: when layer l's flag first reads the
    load's number, layer l's pages have landed and layer l + 1's have not, and its flag is
    unset: a kernel that waits for its layer's flag reads whole pages."""
    cache = make_cache(4, device_pages=2, host_pages=4, copier=DeferredCopier(),
                       load_back_threshold=0)
    a = list(range(8))
    ticket = _launched_load_of_host_only(cache, a)
    pages, pool = list(ticket.device_pages), cache.device_pool
    copier = cache.transfers.copier
    queue = copier.queues[Direction.TO_DEVICE]
    flags = lambda: np.asarray(jnp.copy(pool.load_flags))  # noqa: E731
    seen = []
    while queue:
        item = queue[0]
        copier._run(Direction.TO_DEVICE, _after(queue))
        if item[0] != "signal":
            continue
        layer = len(seen)
        seen.append(layer)
        assert list(flags()[:pool.num_layers] > 0) == [i <= layer for i in range(pool.num_layers)]
        k, _ = pool.read_pages(layer, pages)
        np.testing.assert_array_equal(k, expected_kv(a, layer, 4)[0])
        if layer + 1 < pool.num_layers:
            k_next, _ = pool.read_pages(layer + 1, pages)
            assert not np.array_equal(k_next, expected_kv(a, layer + 1, 4)[0])
    assert seen == list(range(pool.num_layers)) and ticket.done()
    assert_device_kv(cache, a, pages)


class _BesideComputeCopier(DeferredCopier):
    """A deferred copier whose copies the device could wait for, as a GPU's are."""

    beside_compute = True


def _two_loads_on_host(layers: int = 3):
    """A cache whose copies the device could wait for, with two 8-token prompts on host only."""
    cache = make_cache(4, device_pages=4, host_pages=8, copier=_BesideComputeCopier(),
                       load_back_threshold=0, layers=layers)
    a, b = list(range(8)), list(range(100, 108))
    for tokens in (a, b):
        prefill(cache, tokens)
    cache.evict_device(cache.tree.evictable_pages)
    cache.flush()
    return cache, a, b


def test_a_load_launched_by_its_first_layers_queues_the_rest_at_finish() -> None:
    """launch_loads(first_layers=1) queues layer 0's copies and flag only (the head's byte
    floor lowered below a layer); a forward can gate on the load's number at once, without
    queuing more. finish_loads queues the other layers and the landed mark. A later load first
    queues the rest of one still part-queued: flags only grow, so layer 1 must not see the
    later load's number before its own pages landed."""
    cache, a, b = _two_loads_on_host()
    ctl = cache.transfers
    ctl.tuning = dataclasses.replace(ctl.tuning, load_head_bytes=1)
    queue = cache.transfers.copier.queues[Direction.TO_DEVICE]
    signals = lambda: [item[2] for item in queue if item[0] == "signal"]  # noqa: E731
    first = cache.load_back(cache.match(a))
    assert first is not None
    cache.transfers.launch_loads(first_layers=1)
    assert [item[0] for item in queue].count("copy") == 1 and len(signals()) == 1
    assert first.gate_seq() == 1 and len(signals()) == 1 and not first.done()
    second = cache.load_back(cache.match(b))
    assert second is not None
    cache.transfers.launch_loads(first_layers=1)
    assert signals() == [1, 1, 1, 2]  # the first load's 3 layers first
    cache.transfers.loads.finish()
    assert signals() == [1, 1, 1, 2, 2, 2]
    first.wait_all()
    second.wait_all()
    assert_device_kv(cache, a, list(first.device_pages))
    assert_device_kv(cache, b, list(second.device_pages))
    cache.flush()
    cache.check_invariants()


def test_a_write_back_piece_is_one_batch_of_whole_layers() -> None:
    """A write-back's host copies go out in pieces of whole layers, each piece one batched copy
    (every layer's K and V runs): with a piece budget of one layer's bytes, one batch per layer
    and poll; unbounded (flush), one batch for what is left. The host gets every page."""
    cache = make_cache(4, device_pages=4, host_pages=8, copier=DeferredCopier(), layers=4)
    ctl = cache.transfers
    tokens = list(range(16))
    pages = cache.alloc_device(4)
    assert pages is not None
    write_kv(cache, tokens, pages)
    ctl.queue_write_back(pages[:2], [6, 7])
    ctl.queue_write_back(pages[2:], [0, 1])  # two runs: host pages 6-7 and 0-1
    ctl.tuning = dataclasses.replace(ctl.tuning, write_piece_bytes=1)  # a piece: one layer
    queue = ctl.copier.queues[Direction.TO_HOST]
    copies = lambda: [item for item in queue if item[0] == "copy"]  # noqa: E731
    ctl.launch()  # the gather, then the first piece (the staging is ready on the CPU)
    assert [len(c[1]) for c in copies()] == [4]  # one layer: K and V of both runs
    ctl.poll()
    assert [len(c[1]) for c in copies()] == [4, 4]
    ctl.flush()  # the last two layers in one batch, then every copy has run
    ran = ctl.copier.copies
    assert ran == 3, ran
    for layer in range(4):
        k, v = cache.host_pool.read_pages(layer, [6, 7, 0, 1])
        np.testing.assert_array_equal(k, expected_kv(tokens, layer, 4)[0])
        np.testing.assert_array_equal(v, expected_kv(tokens, layer, 4)[1])


def test_a_load_under_the_head_bytes_is_queued_whole() -> None:
    """A load smaller than `load_head_bytes` is queued at once, first_layers or not: the copy
    engine would otherwise idle until the rest is queued."""
    cache, a, _ = _two_loads_on_host()
    ticket = cache.load_back(cache.match(a))
    assert ticket is not None
    cache.transfers.launch_loads(first_layers=1)
    queue = cache.transfers.copier.queues[Direction.TO_DEVICE]
    assert [item[2] for item in queue if item[0] == "signal"] == [1, 1, 1]
    assert queue[-1][0] == "mark"  # the landed mark: nothing left for finish_loads


def _after(queue: list) -> Mark:
    """A mark placed right after the queue's first item, so running to it runs that item."""
    mark = Mark(0)
    queue.insert(1, ("mark", mark))
    return mark


class _Compute:
    """Stands for a dispatched computation that has not finished yet."""

    def __init__(self) -> None:
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self) -> _Compute:
        self.ready = True
        return self


@pytest.mark.parametrize("copier", COPIERS)
def test_a_load_into_a_fenced_page_waits_for_the_compute(copier) -> None:
    cache = make_cache(4, device_pages=4, host_pages=4, copier=_copier(copier))
    ctl = cache.transfers
    a = list(range(8))
    pages = _written_back(cache, a, [0, 1])
    compute = _Compute()
    ctl.fence_device_pages(pages, [compute])
    write_kv(cache, list(range(50, 58)), pages)  # the fenced compute's own writes
    ticket = ctl.queue_load_back([0, 1], pages)
    ctl.launch()
    ctl.poll()
    assert not ticket.done() and not compute.ready  # held: nothing copied yet
    ticket.wait_all()  # a forward needs it: waits for the compute, then copies
    assert compute.ready and ticket.done()
    assert_device_kv(cache, a, pages)
    compute2 = _Compute()
    ctl.fence_device_pages(pages, [compute2])
    compute2.ready = True
    ticket = ctl.queue_load_back([0, 1], pages)
    ctl.launch()  # the fence's compute is done: starts at once
    assert ticket.launched and ctl.poll() is not None


def test_a_fence_holds_only_loads_into_its_own_pages() -> None:
    """A compute fencing one page does not hold a load into another page back."""
    cache = make_cache(4, device_pages=4, host_pages=4)
    ctl = cache.transfers
    pages = _written_back(cache, list(range(8)), [0, 1])
    running = _Compute()
    ctl.fence_device_pages(pages[:1], [running])
    assert ctl.loads.fences_on(pages[0]) == [running] and ctl.loads.fences_on(pages[1]) == []
    other = ctl.queue_load_back([1], pages[1:])
    ctl.launch()
    assert other.launched and not running.ready
    held = ctl.queue_load_back([0], pages[:1])
    ctl.launch()
    ctl.poll()
    assert not held.launched or not held.done()
    held.wait_all()
    assert running.ready and held.done()


def test_fences_on_one_page_add_up() -> None:
    """A page freed twice keeps both fences: a later, finished compute does not lift an
    earlier one that is still running."""
    cache = make_cache(4, device_pages=4, host_pages=4)
    ctl = cache.transfers
    pages = _written_back(cache, list(range(8)), [0, 1])
    running, finished = _Compute(), _Compute()
    finished.ready = True
    ctl.fence_device_pages(pages, [running])
    ctl.fence_device_pages(pages[:1], [finished])
    ticket = ctl.queue_load_back([0, 1], pages)
    ctl.launch()
    ctl.poll()
    assert not ticket.launched or not ticket.done()
    assert not running.ready
    ticket.wait_all()
    assert running.ready and ticket.done()


@pytest.mark.parametrize("copier", [DeferredCopier, pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_host_page_rewritten_after_a_load_is_read_by_the_load_first(copier) -> None:
    """A write-back into host pages an earlier load still reads runs after that load."""
    cache = make_cache(4, device_pages=6, host_pages=2, copier=_copier(copier))
    ctl = cache.transfers
    a, b = list(range(8)), list(range(200, 208))
    src = _written_back(cache, a, [0, 1])
    dst = cache.alloc_device(2)
    ticket = ctl.queue_load_back([0, 1], dst)
    ctl.launch()  # deferred: nothing has landed
    write_kv(cache, b, src)
    ctl.queue_write_back(src, [0, 1])  # host pages 0, 1 reused for other data
    ctl.launch()
    ctl.flush()
    assert ticket.done()
    assert_device_kv(cache, a, dst)  # the load read the old contents
    for layer in range(2):
        k, _ = cache.host_pool.read_pages(layer, [0, 1])
        np.testing.assert_array_equal(k, expected_kv(b, layer, 4)[0])


@pytest.mark.parametrize("copier", COPIERS)
def test_loads_launched_alone_first_launch_a_write_they_read(copier) -> None:
    """`launch_loads` ahead of the queued write-backs: a load of host pages that a queued
    write-back fills launches that write first and reads what it wrote; a load of other pages
    leaves the writes queued."""
    cache = make_cache(4, device_pages=6, host_pages=4, copier=_copier(copier))
    ctl = cache.transfers
    a, b = list(range(8)), list(range(300, 308))
    src = _written_back(cache, a, [0, 1])
    other = cache.alloc_device(2)
    write_kv(cache, b, other)
    ctl.queue_write_back(other, [2, 3])
    dst = cache.alloc_device(2)
    ticket = ctl.queue_load_back([0, 1], dst)
    ctl.launch_loads()
    # the write into 2, 3 still queued
    assert ticket.launched and (len(ctl.writes.queued) + len(ctl.loads.queued)) == 1
    ticket.wait_all()
    assert_device_kv(cache, a, dst)
    ticket = ctl.queue_load_back([2, 3], src)  # pages 2, 3 are what the queued write fills
    ctl.launch_loads()
    assert (len(ctl.writes.queued) + len(ctl.loads.queued)) == 0
    ticket.wait_all()
    ctl.flush()
    assert_device_kv(cache, b, src)


def test_a_match_that_splits_a_loading_node_still_finds_its_load() -> None:
    """A request sharing part of a prefix whose load is in flight splits its node: the forward
    must still find (and wait on) that load."""
    cache = make_cache(2, device_pages=8, host_pages=16, copier=DeferredCopier(),
                       load_back_threshold=0)
    tokens = list(range(100, 108))  # 4 pages, one node
    ticket = _launched_load_of_host_only(cache, tokens)
    shared = cache.match(tokens[:4])  # splits the loading node
    assert shared.loading == (ticket,)
    ticket.wait_all()
    assert_device_kv(cache, tokens[:4], shared.device_pages)
    cache.flush()
    assert cache.match(tokens).loading == ()


def test_fences_do_not_pile_up_on_finished_computes() -> None:
    """A page freed again and again keeps no more than the computes still running."""
    cache = make_cache(4, device_pages=4, host_pages=4)
    ctl = cache.transfers
    finished = []
    for _ in range(20):
        compute = _Compute()
        ctl.fence_device_pages([1, 2], [compute])
        compute.ready = True  # the step ended
        finished.append(compute)
    assert len(ctl.loads.fences_on(1)) == 1  # each new fence let the finished ones go
    ctl.poll()
    assert not ctl.loads.fences_on(1) and not ctl.loads.fences_on(2)  # a poll lets go of the rest
    running = _Compute()
    ctl.fence_device_pages([1], [running])
    ctl.fence_device_pages([1], [finished[0]])
    assert ctl.loads.fences_on(1) == [running]


def test_gather_pieces_cover_a_write_in_order_and_never_gather_more() -> None:
    assert write_back.gather_pieces(129) == [(0, 128), (128, 1)]  # 144 pages gathered, not 256
    assert write_back.gather_pieces(17) == [(0, 17)]  # 16 + 16 would gather no fewer than 32
    for pages in range(1, 2100):
        pieces = write_back.gather_pieces(pages)
        starts = [start for start, _ in pieces]
        assert starts == list(np.cumsum([0] + [size for _, size in pieces[:-1]]))
        assert sum(size for _, size in pieces) == pages and all(size > 0 for _, size in pieces)
        gathered = sum(pow2_bucket(size) for _, size in pieces)
        assert gathered <= pow2_bucket(pages)
        assert len(pieces) == 1 or gathered < pow2_bucket(pages)  # a split must pay for itself
        assert gathered - pages <= max(15, pages // 8)


def test_transfer_tuning_refuses_sizes_that_are_not_positive_ints() -> None:
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="TransferTuning.write_piece_bytes"):
            TransferTuning(write_piece_bytes=bad)


def test_gather_pieces_start_with_the_head_then_double() -> None:
    assert write_back.gather_pieces(513, head=64) == [(0, 64), (64, 128), (192, 256), (448, 64),
                                                    (512, 1)]
    assert write_back.gather_pieces(64, head=64) == [(0, 64)]
    for head in (16, 32, 64):
        for pages in range(1, 1200):
            pieces = write_back.gather_pieces(pages, head=head)
            starts = [start for start, _ in pieces]
            assert starts == list(np.cumsum([0] + [size for _, size in pieces[:-1]]))
            assert sum(size for _, size in pieces) == pages
            if pages <= head:
                assert pieces == write_back.gather_pieces(pages)
                continue
            assert pieces[0] == (0, head)
            for (_, before), (_, size) in zip(pieces, pieces[1:]):
                assert pow2_bucket(size) <= 2 * before  # its gather hides under those copies
    # a head in pages is rounded down to a power of two, and to the smallest piece at least
    assert write_back.gather_pieces(100, head=48) == write_back.gather_pieces(100, head=32)
    assert write_back.gather_pieces(100, head=3) == write_back.gather_pieces(100, head=16)
    with pytest.raises(ValueError, match="at least one page"):
        write_back.gather_pieces(100, head=0)


def _assert_host_holds(cache, tokens: list[int], host: list[int]) -> None:
    """Host pages `host` hold `tokens`' KV (one token a page) in every layer."""
    for layer in range(cache.device_pool.num_layers):
        k, v = cache.host_pool.read_pages(layer, host)
        want_k, want_v = expected_kv(tokens, layer, 1)
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)


@pytest.mark.parametrize("copier", COPIERS)
def test_a_write_back_piece_is_copied_while_the_next_gathers(copier, monkeypatch) -> None:
    """A write-back larger than GATHER_PIECE_BYTES gathers in pieces; the copies of a piece
    already gathered are queued when the next piece is dispatched, not after the last. Every
    page lands and the op is reported once."""
    cache = make_cache(1, device_pages=50, host_pages=50, copier=_copier(copier))
    ctl = cache.transfers
    page_bytes = 2 * cache.device_pool.num_layers * ctl.writes.layer_bytes
    ctl.tuning = dataclasses.replace(ctl.tuning, gather_head_bytes=16 * page_bytes)  # 16, 24
    tokens = list(range(700, 740))
    pages = cache.alloc_device(40)
    assert pages is not None
    write_kv(cache, tokens, pages)
    host = list(range(49, 9, -1))
    ctl.queue_write_back(pages, host)
    # Each gather is waited for as it is dispatched, and reads as finished from then on
    # whatever the runtime's readiness query says, so that nothing depends on the device's
    # speed: what is checked is the order, that a gathered piece's copies are queued before
    # the next piece's gather is dispatched.
    monkeypatch.setattr(write_back, "is_ready", lambda array: True)
    started, real = [], ctl.writes._gather  # per gather: its size, the pieces with copies queued
    ctl.writes._gather = lambda ks, vs, ids: started.append(
        (len(ids), sum(w.rows is not None for w in ctl.writes.launched))) or (
        jax.block_until_ready(real(ks, vs, ids)))
    ctl.launch()
    # the head's copies queued before the next gather (24 pages: padded to 32 gathers fewer)
    assert started == [(16, 0), (32, 1)]
    done = ctl.flush()
    assert [op.kind.value for op in done] == ["write_back"] and not ctl.writes.launched
    _assert_host_holds(cache, tokens, host)


@pytest.mark.parametrize("copier", COPIERS)
def test_a_write_back_gathered_in_pieces_lands_whole_and_reports_once(copier) -> None:
    """33 pages: gathered as 32 + 1 (two staging arrays, two pieces of copies); the op is
    reported once, after both, and every page lands where it belongs."""
    cache = make_cache(1, device_pages=40, host_pages=40, copier=_copier(copier))
    ctl = cache.transfers
    tokens = list(range(500, 533))
    pages = cache.alloc_device(33)
    assert pages is not None
    write_kv(cache, tokens, pages)
    host = list(range(39, 6, -1))  # reversed: no run to coalesce across the pieces' seam
    ctl.queue_write_back(pages, host)
    gathered, real = [], ctl.writes._gather
    ctl.writes._gather = lambda ks, vs, ids: gathered.append(len(ids)) or real(ks, vs, ids)
    ctl.launch()
    assert gathered == [32, 16]  # the second piece, one page, padded to the smallest bucket
    done = ctl.flush()
    assert [op.kind.value for op in done] == ["write_back"] and not ctl.writes.launched
    _assert_host_holds(cache, tokens, host)


def test_coalesced_runs() -> None:
    from jhicache.cache.transfer_op import runs

    src, dst, n = runs(np.array([3, 4, 5, 9, 10, 2]), np.array([7, 8, 9, 1, 2, 3]))
    assert src.tolist() == [3, 9, 2] and dst.tolist() == [7, 1, 3] and n.tolist() == [3, 2, 1]
    src, dst, n = runs(np.array([1, 2]), np.array([5, 7]))
    assert n.tolist() == [1, 1]


def test_host_pool_shards_split_heads_into_blocks() -> None:
    """Block i holds heads [i*h, (i+1)*h) of every page; view() joins the blocks on heads."""
    import jax.numpy as jnp

    from jhicache.cache import HostPool, PoolLayout

    pool = HostPool(PoolLayout(2, 3, 4, 4, 2, jnp.float32), shards=2)  # 2 heads per block
    assert pool.layer_page_bytes == 4 * 2 * 2 * 4 and len(pool.blocks) == 2
    addrs = pool.layer_addresses(np.array([2, 0]))[:, 1, 2:]  # layer 1's V of pages 2 and 0
    assert addrs.shape == (2, 2)
    for shard, block in enumerate(pool.blocks):
        assert addrs[shard].tolist() == [
            block.address + ((1 * 2 + 1) * 3 + p) * pool.layer_page_bytes for p in (2, 0)]
        block.array.view(np.float32)[:] = shard + 1
    heads = pool.view()[1, 1, 2]  # [S, H, D]
    assert heads.shape == (4, 4, 2) and heads[:, :2].min() == 1 and heads[:, 2:].min() == 2
    every = pool.layer_addresses(np.array([1, 2]))  # [shards, layers, K pages then V pages]
    for shard, block in enumerate(pool.blocks):
        for layer in range(2):
            assert every[shard, layer].tolist() == [
                block.address + ((layer * 2 + kv) * 3 + p) * pool.layer_page_bytes
                for kv in (0, 1) for p in (1, 2)]
    with pytest.raises(ValueError, match="shards=3"):
        HostPool(PoolLayout(2, 3, 4, 4, 2, jnp.float32), shards=3)
    pool.close()


def test_sharded_copier_marks_are_done_when_every_device_is() -> None:
    """Row i of a copy goes to copier i; a mark waits for every device's part."""
    import ctypes

    from jhicache.cache.copier import Direction, ShardedCopier

    parts = [DeferredCopier(), DeferredCopier()]
    copier = ShardedCopier(parts)
    src = (ctypes.c_uint8 * 2)(7, 9)
    dst = (ctypes.c_uint8 * 2)()
    base_src, base_dst = ctypes.addressof(src), ctypes.addressof(dst)
    dsts = np.array([[base_dst], [base_dst + 1]], np.uint64)
    srcs = np.array([[base_src], [base_src + 1]], np.uint64)
    copier.copy(Direction.TO_DEVICE, dsts, srcs, np.array([1], np.uint64))
    mark = copier.mark(Direction.TO_DEVICE)
    parts[0].wait(mark.parts[0])  # one device's copies done, not the other's
    assert list(dst) == [7, 0] and not copier.is_done(mark)
    copier.wait(mark)
    assert list(dst) == [7, 9] and copier.is_done(mark)
    with pytest.raises(ValueError, match=">= 2 copiers"):
        ShardedCopier(parts[:1])


def test_controller_refuses_mismatched_shards() -> None:
    """A host pool, or copier, that is not split as the device pool is cannot be used."""
    import jax.numpy as jnp

    from jhicache.cache import DevicePool, HostCopier, HostPool, PoolLayout

    layout = PoolLayout(1, 3, 4, 2, 2, jnp.float32)
    with pytest.raises(ValueError, match="host pool has 2 shards"):
        Transfers(DevicePool(layout), HostPool(layout, shards=2), HostCopier())


def _gpu_copier():
    return make_copier("gpu")[0]


@pytest.mark.gpu
def test_gpu_controller_round_trip() -> None:
    _controller_round_trip(_gpu_copier())


@pytest.mark.gpu
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_gpu_cache_round_trip(policy: WritePolicy) -> None:
    _cache_round_trip(policy, _gpu_copier())


@pytest.mark.gpu
def test_gpu_random_pages_round_trip_bit_exact() -> None:
    """bf16 random pages, scattered ids: device -> host -> other device pages, bit for bit."""
    import jax
    import jax.numpy as jnp

    from jhicache.cache import DevicePool, HostPool, PoolLayout

    layout = PoolLayout(3, 65, 16, 2, 64, jnp.bfloat16)
    device = DevicePool(layout)
    host = HostPool(PoolLayout(3, 40, 16, 2, 64, jnp.bfloat16), make_copier("gpu")[1])
    rng = np.random.default_rng(0)
    for layer in range(3):
        k, v = (jnp.asarray(rng.standard_normal(layout.page_shape), jnp.bfloat16) for _ in range(2))
        device.set_layer(layer, jax.device_put(k), jax.device_put(v))
    ctl = Transfers(device, host, _gpu_copier())
    src, hosts, dst = rng.permutation(64)[:24] + 1, rng.permutation(40)[:24], None
    ctl.queue_write_back(src.tolist(), hosts.tolist())
    ctl.flush()
    dst = [p for p in range(1, 65) if p not in set(src.tolist())][:24]
    ticket = ctl.queue_load_back(hosts.tolist(), dst)
    ctl.launch()
    ticket.wait_all()
    for layer in range(3):
        got_k, got_v = device.read_pages(layer, dst)
        want_k, want_v = device.read_pages(layer, src.tolist())
        assert np.array_equal(got_k.view(np.uint16), want_k.view(np.uint16))
        assert np.array_equal(got_v.view(np.uint16), want_v.view(np.uint16))



@pytest.mark.gpu
def test_gpu_kernels_wait_on_the_device_for_layers_still_landing() -> None:
    """Attention kernels dispatched right after a 1 GB load was issued, each gated on its
    layer's flag, read the loaded pages: they give what the same kernels give once the load has
    landed, and no gate timed out. An ungated read dispatched at the same moment (the control)
    sees pages not yet copied, so the comparison can fail."""
    import jax
    import jax.numpy as jnp
    from jhicache.pallas_kernels import LayerGate, paged_decode_attention

    from jhicache.cache import DevicePool, HostPool, PoolLayout

    layers, pages = 8, 1024
    layout = PoolLayout(layers, pages + 1, 64, 4, 128, jnp.bfloat16)
    device = DevicePool(layout)
    host = HostPool(dataclasses.replace(layout, num_pages=pages), make_copier("gpu")[1])
    rng = np.random.default_rng(3)
    for layer in range(layers):
        k, v = (jnp.asarray(rng.standard_normal(layout.page_shape), jnp.bfloat16) for _ in "kv")
        device.set_layer(layer, k, v)
    ctl = Transfers(device, host, _gpu_copier())
    ids = list(range(1, pages + 1))
    ctl.queue_write_back(ids, list(range(pages)))
    ctl.flush()
    for layer in range(layers):  # the device copy gone: only the load can bring it back
        device.set_layer(layer, jnp.zeros(layout.page_shape, layout.dtype),
                         jnp.zeros(layout.page_shape, layout.dtype))
    jax.block_until_ready((device.k, device.v))
    q = jnp.asarray(rng.standard_normal((1, 28, 128)), jnp.bfloat16)
    table, lens = jnp.asarray([ids], jnp.int32), jnp.asarray([pages * 64], jnp.int32)

    def attend(gate_seq: int | None) -> list[jax.Array]:
        return [paged_decode_attention(
            q, device.k[layer], device.v[layer], table, lens, sm_scale=0.1,
            gate=None if gate_seq is None else LayerGate(
                device.load_flags, jnp.array([gate_seq], jnp.int32),
                jnp.array([layer], jnp.int32))) for layer in range(layers)]

    jax.block_until_ready((attend(None), attend(0)))  # compiled before the load starts
    ticket = ctl.queue_load_back(list(range(pages)), ids)
    ctl.launch()
    control, gated = attend(None), attend(ticket.gate_seq())
    ticket.wait_all()
    landed = attend(None)
    same = [np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(gated, landed)]
    early = [np.array_equal(np.asarray(c), np.asarray(w)) for c, w in zip(control, landed)]
    assert all(same), f"gated reads equal to the landed pages, per layer: {same}"
    assert not all(early), f"the control saw every layer landed already: {early}"
    assert device.gate_timeouts() == 0
    ctl.flush()
