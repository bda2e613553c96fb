"""Fetches, backups and evictions at once (issue 54, item 8). A device eviction that drops a node
with no host copy takes its host-only descendants with it, and a descendant's host pages may
still be read by a storage backup: they must not be reused before that backup has written them,
and letting go of them must not raise. A state machine over the three tiers, whose storage
threads run one task at a time when a rule says so, finds such interleavings; a regression test
walks the one first seen (a restart on damaged page files)."""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import initialize, precondition, rule

from jhicache.cache import PrefixCache
from jhicache.cache.file_storage import CONFIG_FILE, USAGE_FILE, FileStorage
from jhicache.cache.page_keys import chain_keys
from jhicache.cache.storage import StorageNamespace
from jhicache.cache.storage_tier import StorageFetch
from jhicache.config import StorageWritePolicy, WritePolicy
from tests.cache._helpers import make_cache, prefill
from tests.cache.test_stateful import prompts
from tests.cache.test_stateful_storage import StorageMachine

PAGE = 4
P, C = [1, 2, 3, 4], [5, 6, 7, 8]
Q = [20, 21, 22, 23, 24, 25, 26, 27]


def storage_cache(root: Path, device_pages: int, host_pages: int) -> PrefixCache:
    """A write-back cache (device 2 pages, host 3) backing every host copy up to `root`."""
    cache = make_cache(PAGE, device_pages, host_pages, WritePolicy.WRITE_BACK,
                       load_back_threshold=PAGE)
    assert cache.host_pool is not None
    namespace = StorageNamespace(model="race", dtype="float32", page_size=PAGE, layout="test",
                                 page_bytes=cache.host_pool.layout.page_bytes)
    storage = FileStorage(root, namespace, cache.host_pool.page_views)
    return PrefixCache(PAGE, cache.device_pool, cache.host_pool, WritePolicy.WRITE_BACK,
                       load_back_threshold=PAGE, storage=storage,
                       storage_policy=StorageWritePolicy.WRITE_THROUGH)


def test_a_dropped_nodes_host_only_child_whose_backup_is_in_flight(tmp_path: Path) -> None:
    cache = storage_cache(tmp_path, device_pages=2, host_pages=3)
    assert cache.storage is not None and cache.host is not None
    # P reaches storage (written back on eviction, backed up), then the tiers are flushed
    prefill(cache, P)
    cache.evict_device(2)
    cache.clear()
    assert cache.storage.known(chain_keys(P, PAGE)[0])
    # Q on host only (its backup written), P and its child C on device with no host copy
    prefill(cache, Q)
    cache.evict_device(2)
    cache.flush(backups=True)
    prefill(cache, P)
    prefill(cache, P + C)
    # Loading Q back needs both device pages: C is written back (P is stored already, so only
    # C's backup is planned: its page is locked until written), then P, which has no host
    # copy and no host room, is dropped with its host-only child C
    match = cache.match(Q)
    ticket = cache.load_back(match)
    assert ticket is not None and cache.stats()["dropped_nodes"] == 1
    assert cache.match(P + C).device_len + cache.match(P + C).host_len == 0
    cache.check_invariants()  # C's page is held for its backup: neither free nor leaked
    assert cache.host.num_free == 0
    cache.flush(backups=True)
    assert cache.host.num_free == 1  # written, then freed
    assert cache.storage.known(chain_keys(P + C, PAGE)[1])
    cache.check_invariants()
    cache.storage.close()


def test_a_read_under_a_host_only_prefix_takes_the_host_room_left_beside_it(
        tmp_path: Path) -> None:
    """The host tier full with the request's host-only prefix (4 pages) and another prefix (6):
    its read from storage holds its prefix first, then takes the other's 6 pages for as many
    of the 10 pages found (the prefix's own pages are no room: all-or-nothing, counting them
    would leave it none)."""
    a, r, b = list(range(1, 17)), list(range(100, 140)), list(range(200, 224))
    writer = storage_cache(tmp_path, device_pages=16, host_pages=16)
    prefill(writer, a + r)
    writer.evict_device()
    writer.flush(backups=True)
    assert writer.storage is not None and writer.storage.known(chain_keys(a + r, PAGE)[-1])
    writer.storage.close()
    cache = storage_cache(tmp_path, device_pages=16, host_pages=10)
    assert cache.storage is not None and cache.host is not None
    prefill(cache, a)
    prefill(cache, b)
    cache.evict_device()
    cache.flush(backups=True)
    assert cache.host.num_free == 0
    tokens = a + r + [999]
    fetch = cache.fetches.start(tokens, cache.match(tokens, leave_last=True), PAGE)
    assert fetch is not None and fetch.first_page == 4
    got = None
    while got is None:
        cache.fetches.wait(1.0)
        got = cache.fetches.advance(fetch, tokens, PAGE, stop=False)
    assert got == 6 * PAGE and len(fetch.host_pages) == 6
    assert cache.storage.counters["fetch_no_host"] == 0
    match = cache.match(tokens, leave_last=True)
    assert match.host_len == (4 + 6) * PAGE and match.device_len == 0
    cache.check_invariants()
    cache.storage.close()


class ManualIO:
    """Stands in for a storage tier's thread pool: tasks run only when `run` says (in order,
    or the `i`th waiting one), or at once while `auto` (a rule that waits on storage)."""

    def __init__(self) -> None:
        self.tasks: collections.deque[tuple[concurrent.futures.Future[object],
                                            Callable[..., object], tuple[object, ...]]] = (
            collections.deque())
        self.auto = False

    def submit(self, fn: Callable[..., object], *args: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self.tasks.append((future, fn, args))
        if self.auto:
            self.run(len(self.tasks))
        return future

    def run(self, n: int, i: int = 0) -> None:
        """Runs `n` waiting tasks, each the `i`th waiting one (0: the oldest)."""
        for _ in range(n):
            if not self.tasks:  # (a task run may have run the rest: `auto`)
                return
            future, fn, args = self.tasks[i % len(self.tasks)]
            del self.tasks[i % len(self.tasks)]
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (the future carries it, as a pool's)
                future.set_exception(e)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        for future, _, _ in self.tasks:
            future.cancel()
        self.tasks.clear()


class RaceMachine(StorageMachine):
    """The storage machine with fetches that stay in flight across rules (moved on, ended or
    aborted one rule at a time, beside holds, prefills, evictions of both tiers, load-backs,
    restarts and backups), storage tasks (queries, reads, backup writes) that end when a rule
    runs them, and page files damaged on disk (truncated, or a byte flipped). No interleaving
    may free a page a backup still reads, and every page a fetch puts in the tree holds its
    prefix's KV (the data check reads every node's pages)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[tuple[StorageFetch, list[int]]] = []
        self.history: list[list[int]] = []  # prompts prefilled, in order
        self.writer, self.readers = ManualIO(), ManualIO()

    # small host tiers: host copies fail for want of room while backups hold pages locked
    @initialize(page=st.sampled_from([1, 4]), policy=st.sampled_from(list(WritePolicy)),
                host=st.sampled_from([2, 4]), deferred=st.booleans(),
                storage_policy=st.sampled_from(list(StorageWritePolicy)))
    def setup(self, page: int, policy: WritePolicy, host: int, deferred: bool,
              storage_policy: StorageWritePolicy) -> None:
        self._setup(page, policy, host, deferred, storage_policy)
        tier = self.cache.storage
        assert tier is not None
        for pool in (tier._writer, tier._readers, tier._queries):
            pool.shutdown()
        # the tier's threads, replaced: a task ends when a rule runs it (deterministic runs);
        # queries and reads share one stand-in, run in any order
        tier._writer = self.writer  # type: ignore[assignment]
        tier._readers = tier._queries = self.readers  # type: ignore[assignment]

    @rule(writer=st.booleans(), n=st.integers(1, 4), i=st.integers(0, 3))
    def run_io(self, writer: bool, n: int, i: int) -> None:
        """Storage tasks end: backup writes in their order, queries and reads in any."""
        if writer:
            self.writer.run(n)
        else:
            self.readers.run(n, i)

    def _waiting(self, call: Callable[[], object]) -> object:
        """Runs `call`, which may wait on storage, with every storage task run at once."""
        was, self.writer.auto = self.writer.auto, True
        self.readers.auto = True
        try:
            self.writer.run(len(self.writer.tasks))
            self.readers.run(len(self.readers.tasks))
            return call()
        finally:
            self.writer.auto = self.readers.auto = was

    def fetch(self, tokens: list[int], abort: bool, clear_first: bool,
              tail: int | None = None) -> None:
        self._waiting(lambda: super(RaceMachine, self).fetch(tokens, abort, clear_first, tail))

    @rule(tokens=prompts(), more=st.lists(st.integers(900, 902), min_size=1, max_size=8),
          evict=st.booleans())
    def conversation(self, tokens: list[int], more: list[int], evict: bool) -> None:
        """Two turns of a chat, the second extending the first (a node and its child), maybe
        then evicted from device: children first, each written back or dropped."""
        self.prefill(tokens)
        self.prefill(tokens + more)
        if evict:
            self.evict(30, False)

    def prefill(self, tokens: list[int]) -> None:
        self.history.append(tokens)
        super().prefill(tokens)

    @rule(tokens=prompts(), tail=st.booleans())
    def start_fetch(self, tokens: list[int], tail: bool) -> None:
        tokens = self._aligned(tokens) + [999]  # the last token is left to compute
        match = self.cache.match(tokens, leave_last=True)
        fetch = self.cache.fetches.start(tokens, match, self.page, from_tail=tail)
        if fetch is not None:
            self.in_flight.append((fetch, tokens))

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 10), stop=st.booleans())
    def advance_fetch(self, i: int, stop: bool) -> None:
        """Moves one fetch on as the scheduler does, ending it with `stop` or once read; a
        fetch from the tail ends once read, from its first page."""
        fetch, tokens = self.in_flight[i % len(self.in_flight)]
        got = self.cache.fetches.advance(fetch, tokens, self.page, stop=stop)
        if got is None and fetch.from_tail and fetch.finished:
            got = self.cache.fetches.end(fetch, tokens, fetch.first_page)
        if got is not None:
            self.in_flight.remove((fetch, tokens))
            event(f"fetch ended with pages: {got > 0}")
            if got:
                self._check_match(tokens[:-1])

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 10))
    def abort_fetch(self, i: int) -> None:
        fetch, _ = self.in_flight.pop(i % len(self.in_flight))
        self.cache.fetches.end(fetch, None)

    @rule(i=st.integers(0, 100), truncate=st.booleans())
    def damage(self, i: int, truncate: bool) -> None:
        """Damages one stored page file: cut short, or one byte of its payload flipped."""
        files = sorted(p for p in Path(self.root).rglob("*")
                       if p.is_file() and p.name not in (CONFIG_FILE, USAGE_FILE))
        if not files:
            return
        path = files[i % len(files)]
        data = bytearray(path.read_bytes())
        if truncate:
            data = data[:len(data) // 2]
        else:
            data[-1 - i % 8] ^= 0xFF
        path.write_bytes(bytes(data))
        self.damaged = True
        event(f"damaged: {'truncated' if truncate else 'flipped'}")

    @precondition(lambda self: not self.held and not self.locks and not self.in_flight)
    @rule()
    def clear(self) -> None:
        """A flush of the device and host tiers (storage keeps its pages); none while a fetch
        holds its prefix."""
        if not self.in_flight:
            self._waiting(super().clear)

    @precondition(lambda self: not self.held and not self.locks and not self.in_flight)
    @rule(turns=st.integers(1, 6), evict=st.booleans())
    def restart(self, turns: int, evict: bool) -> None:
        """As a new engine on the same directory: the device and host tiers empty, storage
        keeps its pages (damaged ones too); the last `turns` prompts run again, then maybe
        leave the device (their backups still in flight)."""
        self.clear()
        for tokens in self.history[-turns:]:
            self.prefill(tokens)
        if evict:
            self.evict(30, False)

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            for fetch, _ in self.in_flight:
                self.cache.fetches.end(fetch, None)
            self.in_flight.clear()
            self._waiting(lambda: None)
        super().teardown()


# 60 examples miss the find above (about 1 in 12 set-ups can reach it); 500 find it at e89a12b
RaceMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CACHE_FUZZ_EXAMPLES", "60")), stateful_step_count=50,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestRaceMachine = RaceMachine.TestCase


def test_the_machines_shrunk_find_on_e89a12b(monkeypatch) -> None:
    """The sequence the machine shrank its find to at e89a12b (CACHE_FUZZ_EXAMPLES=500, six
    minutes): a chat, evicted; a restart that runs its last turn again; another chat, evicted
    (`host pages [...] are locked` there)."""
    import tests.cache.test_stateful as stateful
    import tests.cache.test_stateful_storage as stateful_storage
    for module in (stateful, stateful_storage, __import__(__name__, fromlist=["event"])):
        monkeypatch.setattr(module, "event", lambda _: None)  # outside a Hypothesis run
    machine = RaceMachine()
    machine.setup(page=1, policy=WritePolicy.WRITE_BACK, host=2, deferred=False,
                  storage_policy=StorageWritePolicy.WRITE_THROUGH)
    machine.conversation(evict=True, more=[900] * 8, tokens=[900])
    machine.invariants_hold()
    machine.restart(evict=False, turns=1)
    machine.invariants_hold()
    machine.conversation(evict=True, more=[900], tokens=[])
    machine.invariants_hold()
    machine.flush_and_verify_all()
    machine.teardown()
