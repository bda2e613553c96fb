"""A storage query asked on a request's arrival is waited for at the next step's entry, for a
bounded time: a request that arrived between two steps is scheduled on its answer in the first
of them, and a slow backend costs a step no more than the bound."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from jhicache.cache import PrefixCache
from jhicache.cache.fetches import FetchRule, Gate
from jhicache.cache.file_storage import FileStorage
from jhicache.cache.storage import StorageNamespace
from jhicache.config import WritePolicy
from tests.cache._helpers import make_cache, prefill

PAGE = 4
PROMPT = list(range(1, 4 * PAGE + 2))  # four whole pages past an empty cache, then one token


class HeldStorage(FileStorage):
    """File storage whose `exists` (or, with `hold_reads`, `get` instead) answers only once
    `release` is set."""

    release: threading.Event
    hold_reads = False

    def exists(self, keys: Sequence[bytes]) -> int:
        if not self.hold_reads:
            self.release.wait()
        return super().exists(keys)

    def get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        if self.hold_reads:
            self.release.wait()
        return super().get(keys, host_pages)


def held_cache(root: Path, query_wait_s: float, hold_reads: bool = False,
               io_threads: int = 8) -> tuple[PrefixCache, threading.Event]:
    cache = make_cache(PAGE, 8, 8, WritePolicy.WRITE_BACK)
    assert cache.host_pool is not None
    namespace = StorageNamespace(model="queries", dtype="float32", page_size=PAGE,
                                 layout="test", page_bytes=cache.host_pool.layout.page_bytes)
    storage = HeldStorage(root, namespace, cache.host_pool.page_views)
    storage.release, storage.hold_reads = threading.Event(), hold_reads
    rule = FetchRule(threshold=PAGE, timeout_s=60.0, query_wait_s=query_wait_s)
    return PrefixCache(PAGE, cache.device_pool, cache.host_pool, WritePolicy.WRITE_BACK,
                       storage=storage, storage_io_threads=io_threads,
                       fetch_rule=rule), storage.release


def test_a_query_answered_within_the_wait_is_taken_in_the_next_step(tmp_path: Path) -> None:
    cache, release = held_cache(tmp_path, query_wait_s=60.0)
    cache.fetches.arrive("r", PROMPT, PROMPT)
    assert cache.fetches.gate("r") == Gate(wait=True)  # asked, not answered
    timer = threading.Timer(0.05, release.set)
    timer.start()
    with cache.step():
        # the empty store's answer (nothing found) ended the fetch before the schedule
        assert cache.fetches.gate("r") == Gate()
    timer.join()
    assert cache.storage is not None
    assert cache.storage.counters["fetches"] == 1
    assert cache.storage.counters["fetch_revoked"] == 1
    cache.close()


def test_a_query_slower_than_the_wait_leaves_its_request_for_a_later_step(
        tmp_path: Path) -> None:
    cache, release = held_cache(tmp_path, query_wait_s=0.01)
    cache.fetches.arrive("r", PROMPT, PROMPT)
    with cache.step():
        assert cache.fetches.gate("r") == Gate(wait=True)  # the step went on without it
    with cache.step():  # the bound counts from the query's start: no second wait
        assert cache.fetches.gate("r") == Gate(wait=True)
    release.set()
    cache.fetches.wait(60.0)  # until the answer
    with cache.step():
        assert cache.fetches.gate("r") == Gate()
    cache.close()


def test_a_query_is_answered_while_every_reader_is_busy(tmp_path: Path) -> None:
    """Queries have threads of their own: one read holding the only reader thread does not
    keep another request's query, and so its schedule, waiting."""
    cache, release = held_cache(tmp_path, query_wait_s=5.0, hold_reads=True, io_threads=1)
    prefill(cache, PROMPT[:-1])  # its pages reach storage, then the device and host tiers empty
    cache.evict_device()
    cache.clear()
    cache.fetches.arrive("stored", PROMPT, PROMPT)
    try:
        with cache.step():  # answered (every page found): its read starts and holds the reader
            fetch = cache.fetches.in_flight("stored")
            assert fetch is not None and fetch.found == 4
        other = [100 + t for t in PROMPT]
        cache.fetches.arrive("new", other, other)
        with cache.step():
            assert cache.fetches.gate("new") == Gate()  # answered: nothing stored
            assert cache.fetches.gate("stored") == Gate(wait=True)  # still reading
    finally:
        release.set()
    cache.fetches.forget("stored")
    cache.close()
