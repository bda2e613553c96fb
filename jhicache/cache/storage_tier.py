"""StorageTier: the background threads between the host tier and a `Storage` backend: backups of
host pages (in the order they were planned, each after the copy that fills its pages) and
fetches of stored pages into host pages. The scheduler's thread plans and polls; it never
waits on storage."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence

from jhicache.cache.storage import Storage

STORAGE_TIER_COUNTERS = ("backup_pages", "backup_failures", "fetches", "fetch_revoked",
                         "fetch_full", "fetch_partial", "fetch_no_host", "fetched_pages",
                         "fetch_read_s")
FETCH_CHUNK_PAGES = 8  # pages one read task takes: several tasks keep the disk's queue full
# A fetch from the tail reads one page a task, with as many tasks in flight as the pool has
# threads, the next started as one ends: the disk's queue stays as full as a fetch from the
# first keeps it, while the pages end about in order, so that those read from the last grow
# steadily (every chunk started at once would share the disk and end at about the same time;
# two chunks of 8 pages in flight kept the disk's queue short: benchmarks/LOG.md, 2026-12-04).
TAIL_CHUNK_PAGES = 1
# Pages a backup writes between looks at whether the tier is closing: a closing tier whose
# deadline passed stops within this many pages, not at the end of a long prefix's backup.
WRITE_CHUNK_PAGES = 8
QUERY_THREADS = 2  # a query is one short batch call: few threads suffice


class FetchState(enum.Enum):
    QUERYING = "querying"  # a thread asks the backend how many of the keys it holds
    FETCHING = "fetching"  # threads read the found pages into host pages
    ENDED = "ended"  # terminated: the pages read are in the tree, the rest are freed


@dataclasses.dataclass(eq=False)
class StorageFetch:
    """One request's read of stored pages past its cached prefix. `keys` are the candidate
    pages' keys; `found` (set by a thread) how many of them, from the first, are stored; the
    scheduler then gives `host_pages` and threads read them in chunks, from the first, or with
    `from_tail` from the last (the request computes the head meanwhile). Only the pages read
    without a gap from the first (`completed`), or from the last (`tail_completed`), count."""

    keys: list[bytes]
    first_page: int  # index of keys[0] among the prompt's pages
    anchor: object  # the tree node the pages go under, held once the reads are to start
    started_s: float
    from_tail: bool = False
    chunk_pages: int = FETCH_CHUNK_PAGES  # pages a read task takes (from the tail: one)
    state: FetchState = FetchState.QUERYING
    found: int | None = None
    host_pages: list[int] = dataclasses.field(default_factory=list)
    kept = (0, 0)  # once ended: the range of `host_pages` handed to the tree
    read_s = 0.0  # the reads' wall time, start of the first to end of the last
    _read: list[int] = dataclasses.field(default_factory=list)  # per chunk: pages read, or -1
    _pending = 1  # tasks not yet ended (at first, its query)
    _queued: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=collections.deque)  # from the tail: (chunk, first page) not yet started
    _cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def queried(self) -> bool:
        return self.found is not None

    @property
    def completed(self) -> int:
        """Pages read, from the first, up to the first chunk not (fully) read."""
        with self._lock:
            done = 0
            for i, read in enumerate(self._read):
                size = min(self.chunk_pages, len(self.host_pages) - i * self.chunk_pages)
                done += max(read, 0)
                if read != size:
                    break
            return done

    @property
    def tail_completed(self) -> int:
        """Pages read, from the last, down to the first chunk not fully read (a chunk read in
        part holds the pages at its start: they do not join the tail)."""
        with self._lock:
            done = 0
            for i in reversed(range(len(self._read))):
                size = min(self.chunk_pages, len(self.host_pages) - i * self.chunk_pages)
                if self._read[i] != size:
                    break
                done += size
            return done

    @property
    def read_from(self) -> int | None:
        """From the tail: the prompt page from which every found page has been read (None
        until the reads start)."""
        if self.state is not FetchState.FETCHING:
            return None
        return self.first_page + len(self.host_pages) - self.tail_completed

    @property
    def finished(self) -> bool:
        """No thread touches its host pages any more."""
        with self._lock:
            return self.queried and self._pending == 0

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def answer(self, found: int) -> None:
        """Its query has ended: `found` of its keys, from the first, are stored."""
        with self._lock:
            self.found, self._pending = found, 0

    def begin(self, host_pages: list[int], held: bool) -> None:
        """Its found pages are to be read into `host_pages`; `held`: not before host copies
        into them end (it is not finished meanwhile: its pages stay held)."""
        assert self.state is FetchState.QUERYING and self.queried
        self.state, self.host_pages = FetchState.FETCHING, host_pages
        if held:
            with self._lock:
                self._pending = 1

    def chunks(self, io_threads: int) -> list[tuple[int, int]]:
        """Starts its reads: the (chunk, first page) tasks to submit now (from the tail, as many
        as `io_threads`, the rest queued behind them; none once cancelled)."""
        if self.cancelled:  # ended while its copies ran: it reads nothing
            with self._lock:
                self._pending = 0
            return []
        order = list(enumerate(range(0, len(self.host_pages), self.chunk_pages)))
        with self._lock:
            self._read = [0] * len(order)
            self._pending = len(order)
            self.read_s = -time.perf_counter()  # the last read to end adds its end time
            if self.from_tail:
                self._queued.extend(reversed(order))
                order = [self._queued.popleft()
                         for _ in range(min(io_threads, len(self._queued)))]
        return order

    def chunk_done(self, i: int, read: int) -> tuple[int, int] | None:
        """Chunk `i`'s task has ended, with `read` pages read (-1: not tried); returns the next
        queued task to submit (from the tail), if any."""
        with self._lock:
            self._read[i] = read
            self._pending -= 1
            if self.cancelled:  # an ended fetch starts no more reads
                self._pending -= len(self._queued)
                self._queued.clear()
            if self._pending == 0:
                self.read_s += time.perf_counter()
            return self._queued.popleft() if self._queued else None

    def end(self, first: int | None) -> tuple[int, int]:
        """Terminates it: the range of `host_pages` handed to the caller (see
        `StorageTier.end_fetch`)."""
        self._cancel.set()
        if self.state is FetchState.FETCHING:
            n = len(self.host_pages)
            if first is None:
                self.kept = (0, self.completed)
            elif n - self.tail_completed <= first < n:
                self.kept = (first, n)
            else:
                self.kept = (n, n)
        self.state = FetchState.ENDED
        return self.kept


@dataclasses.dataclass(eq=False)
class _Backup:
    keys: list[bytes]
    host_pages: list[int]
    after: set[int]  # host copies (op ids) that fill the pages; it waits for them


class StorageTier:
    """Threads over `storage`: one writer (backups in plan order: a prefix's head pages reach
    storage before its tail), a pool of readers for fetches' reads and a small one for their
    queries (a query never waits behind reads: the next step waits for its answer, briefly,
    `FetchRule.query_wait_s`). `lock`/`unlock` are the host tier's page locks: a page is locked
    from its backup's plan until it is written (the host tier frees a page the tree let go of
    meanwhile once it is unlocked)."""

    def __init__(self, storage: Storage, lock: Callable[[Sequence[int]], None],
                 unlock: Callable[[Sequence[int]], None], io_threads: int = 8) -> None:
        self.storage = storage
        self._lock_pages, self._unlock_pages = lock, unlock
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jhicache-storage-write")
        self._readers = concurrent.futures.ThreadPoolExecutor(io_threads, "jhicache-storage-read")
        self._queries = concurrent.futures.ThreadPoolExecutor(QUERY_THREADS,
                                                              "jhicache-storage-query")
        self._io_threads = io_threads
        self._planned: collections.deque[_Backup] = collections.deque()
        self._writing: collections.deque[tuple[_Backup, concurrent.futures.Future[int]]] = (
            collections.deque())
        self._known: set[bytes] = set()  # keys planned, not yet written
        # fetches holding host pages: reading, or ended with pages a thread may still write
        self._holding: list[StorageFetch] = []
        # fetches whose reads wait for host copies into their pages (op ids) to end
        self._reads_after: list[tuple[StorageFetch, set[int]]] = []
        self.counters: dict[str, float] = dict.fromkeys(STORAGE_TIER_COUNTERS, 0)
        self._progress = threading.Event()  # set when a fetch's query or read task ends
        self._stopping = threading.Event()  # set at close: backups write no more pages

    # -- backups -------------------------------------------------------------------------
    def known(self, key: bytes) -> bool:
        """Whether the page `key` is stored or planned to be (a page evicted from storage since
        is not: it is planned again)."""
        return key in self._known or self.storage.contains(key)

    def plan_backup(self, keys: Sequence[bytes], host_pages: Sequence[int],
                    after: set[int]) -> None:
        """Writes `host_pages` as `keys` once the host copies `after` are done, after every
        backup planned before it. The pages stay locked until written."""
        self._lock_pages(host_pages)
        self._known.update(keys)
        self._planned.append(_Backup(list(keys), list(host_pages), set(after)))

    def copies_done(self, op_ids: set[int]) -> None:
        """Host copies that have completed: backups and fetch reads waiting only for them may
        start."""
        for backup in self._planned:
            backup.after -= op_ids
        for _, after in self._reads_after:
            after -= op_ids
        ready = [fetch for fetch, after in self._reads_after if not after]
        self._reads_after = [(f, after) for f, after in self._reads_after if after]
        for fetch in ready:
            self._start_reads(fetch)

    def poll(self) -> list[int]:
        """Starts the backups that are ready, ends the writes that are done; returns the host
        pages of fetches that ended and whose threads have stopped (the caller frees them)."""
        while self._planned and not self._planned[0].after:
            backup = self._planned.popleft()
            self._writing.append((backup, self._writer.submit(self._write, backup.keys,
                                                                backup.host_pages)))
        freed: list[int] = []
        while self._writing and self._writing[0][1].done():
            backup, future = self._writing.popleft()
            self._end_backup(backup, _result(future))
        for fetch in [f for f in self._holding if f.state is FetchState.ENDED and f.finished]:
            self._holding.remove(fetch)
            self.counters["fetch_read_s"] += fetch.read_s
            freed += _outside(fetch.host_pages, fetch.kept)
        return freed

    def _write(self, keys: list[bytes], host_pages: list[int]) -> int:
        """Stores a backup's pages, a few at a time until the tier closes; how many it did."""
        stored = 0
        for start in range(0, len(keys), WRITE_CHUNK_PAGES):
            if self._stopping.is_set():
                break
            end = start + WRITE_CHUNK_PAGES
            done = self.storage.set(keys[start:end], host_pages[start:end])
            stored += done
            if done < len(keys[start:end]):
                break
        return stored

    def _end_backup(self, backup: _Backup, stored: int) -> None:
        self._unlock_pages(backup.host_pages)
        self.counters["backup_pages"] += stored
        if stored < len(backup.keys):
            self.counters["backup_failures"] += 1
        # written: the backend's index knows them now; failed: planned again next time
        self._known.difference_update(backup.keys)

    def wait_backups(self, deadline: float | None = None) -> list[int]:
        """Blocks until every planned backup whose copies are done has been written (the
        caller flushes the copies first), or `deadline` (`time.monotonic()`) passes, and until
        no ended fetch's thread still reads; returns what `poll` did meanwhile."""
        freed: list[int] = []
        while self._planned and not self._planned[0].after or self._writing:
            freed += self.poll()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if self._writing:
                concurrent.futures.wait([self._writing[0][1]], timeout=left)
        while any(f.state is FetchState.ENDED and not f.finished for f in self._holding):
            self.wait_for_progress(0.01)
        return freed + self.poll()

    def unwritten_pages(self) -> int:
        """Pages of the backups planned and not yet written."""
        return (sum(len(b.keys) for b in self._planned)
                + sum(len(b.keys) for b, _ in self._writing))

    def clear(self) -> int:
        """Deletes every stored page (no backup may be in flight); returns how many."""
        assert not self._writing, "backups still in flight"
        self._known = {k for b in self._planned for k in b.keys}  # planned, not yet written
        return self.storage.clear()

    # -- fetches -------------------------------------------------------------------------
    def start_fetch(self, keys: list[bytes], first_page: int, anchor: object,
                    from_tail: bool = False) -> StorageFetch:
        """Asks the backend, on a thread, how many of `keys` it holds."""
        fetch = StorageFetch(keys, first_page, anchor, time.perf_counter(), from_tail,
                             TAIL_CHUNK_PAGES if from_tail else FETCH_CHUNK_PAGES)
        self.counters["fetches"] += 1

        def query() -> None:
            try:
                found = self.storage.exists(keys) if not fetch.cancelled else 0
            except Exception:  # noqa: BLE001 (a backend failure is a miss, not a crash)
                found = 0
            fetch.answer(found)
            self._progress.set()

        self._queries.submit(query)
        return fetch

    def read(self, fetch: StorageFetch, host_pages: list[int], after: set[int]) -> None:
        """Reads the first `len(host_pages)` found pages into `host_pages`, in chunks, on the
        reader threads (the last chunk first with `from_tail`), once the host copies `after`
        are done: freed pages may still be the target of a copy queued before they were."""
        fetch.begin(host_pages, held=bool(after))
        self._holding.append(fetch)
        if after:
            self._reads_after.append((fetch, set(after)))
        else:
            self._start_reads(fetch)

    def _start_reads(self, fetch: StorageFetch) -> None:
        order = fetch.chunks(self._io_threads)
        if not order:
            self._progress.set()
        for i, start in order:
            self._readers.submit(self._read_chunk, fetch, i, start)

    def _read_chunk(self, fetch: StorageFetch, i: int, start: int) -> None:
        end = min(start + fetch.chunk_pages, len(fetch.host_pages))
        read = -1
        try:
            if not fetch.cancelled:
                read = self.storage.get(fetch.keys[start:end], fetch.host_pages[start:end])
        except Exception:  # noqa: BLE001 (a backend failure is a miss, not a crash)
            read = 0
        queued = fetch.chunk_done(i, read)
        self._progress.set()
        if queued is not None:
            try:
                self._readers.submit(self._read_chunk, fetch, *queued)
            except RuntimeError:  # the tier is closing: its pages are let go with it
                pass

    def wait_for_progress(self, timeout_s: float) -> None:
        """Blocks until a fetch task has ended since the last call, or `timeout_s` passes."""
        self._progress.wait(timeout_s)
        self._progress.clear()

    def end_fetch(self, fetch: StorageFetch, first: int | None = None) -> tuple[int, int]:
        """Terminates `fetch`: the pages read so far become the caller's, those read without a
        gap from the first or, with `first` (a fetch from the tail), those from index `first`
        to the last if all of them were read; the rest are freed by a later `poll` once no
        thread writes them. Returns the range of `host_pages` that is the caller's."""
        reading = fetch.state is FetchState.FETCHING
        lo, hi = fetch.end(first)
        if reading:
            self.counters["fetched_pages"] += hi - lo
            self.counters["fetch_full" if hi - lo == len(fetch.host_pages) else
                          "fetch_partial"] += 1
        return lo, hi

    def held_pages(self) -> list[int]:
        """Host pages this tier holds: fetches' (being read, or ended and not yet freed)."""
        return [p for f in self._holding for p in _outside(f.host_pages, f.kept)]

    def close(self) -> list[int]:
        """Stops the threads: a backup being written stops within WRITE_CHUNK_PAGES pages,
        those not started are dropped (call `wait_backups` first to write them), their pages
        unlocked; ends the backend. Returns the host pages its fetches still held (the caller
        frees them: no thread touches them any more)."""
        self._stopping.set()
        for pool in (self._writer, self._queries, self._readers):
            pool.shutdown(wait=True, cancel_futures=True)
        for backup in [*self._planned, *(b for b, _ in self._writing)]:
            self._unlock_pages(backup.host_pages)
        self._planned.clear()
        self._writing.clear()
        held = self.held_pages()
        self._holding.clear()
        self._reads_after.clear()
        self.storage.close()
        return held


def _outside(pages: list[int], kept: tuple[int, int]) -> list[int]:
    return pages[:kept[0]] + pages[kept[1]:]


def _result(future: concurrent.futures.Future[int]) -> int:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 (a backend failure writes nothing; counted by the caller)
        return 0
