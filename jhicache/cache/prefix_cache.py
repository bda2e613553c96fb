"""PrefixCache: the radix tree over the device and host tiers: match, lock, insert, eviction and
load-back decisions, and the transfer step; the only object the engine talks to for prefix
caching. Ours (`jhicache.scheduler`) and another engine's loop (`examples/own_loop.py`) make the
same calls, in the order `jhicache.cache.cache_tiers` gives: match, lock, load_back,
alloc_device, the step's `start_loads` gate for the forward, then insert, free_device, unlock.

Page regions of the device tier (page 0 is the reserved padding sink and belongs to none):
| region     | owner                         | leaves it by                                  |
|------------|-------------------------------|-----------------------------------------------|
| free       | DeviceTier                    | alloc_device / load_back                      |
| held       | running requests (engine)     | insert (tree takes it) / free_device          |
| evictable  | unlocked tree nodes           | evict_device (write-back or drop)             |
| protected  | locked tree nodes             | unlock                                        |
Host tier: free, or host copy of a tree node (device+host or host-only); only host-only leaves
are host-evicted, and only when a host allocation would otherwise fail.

Rule that keeps copies correct, kept in one place (`_release_device`): before device pages
leave the tree, queued write-backs are launched (their gather is dispatched), so compute that
reuses a page is ordered after the gather read it; loads are copies JAX does not see, so every
device page freed while compute that may touch it is in flight is fenced until that compute is
done (`Transfers.fence_device_pages`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from jhicache.cache.copier import make_copier
from jhicache.cache.device_pool import DevicePool
from jhicache.cache.fetches import Fetches, FetchRule
from jhicache.cache.host_pool import HostPool
from jhicache.cache.invariants import InvariantError, check_invariants
from jhicache.cache.radix_tree import MatchResult, Node, RadixTree
from jhicache.cache.step import TransferStep
from jhicache.cache.storage import WRITE_FAILURE_REASONS, Storage
from jhicache.cache.storage_tier import STORAGE_TIER_COUNTERS, StorageTier
from jhicache.cache.ticket import LoadTicket
from jhicache.cache.tiers import DeviceTier, HostTier
from jhicache.cache.transfer_op import TransferKind, TransferOp
from jhicache.cache.transfers import Transfers
from jhicache.config import StorageWritePolicy, TransferTuning, WritePolicy

logger = logging.getLogger("jhicache.storage")

_STATS = ("evicted_device_tokens", "dropped_nodes", "dropped_tokens", "write_through_failures",
          "load_back_skipped", "load_back_over_quota", "load_back_failures", "load_back_stale",
          "alloc_failures", "storage_backup_skipped")


class PoolPages(NamedTuple):
    """Each tier's pages now: its pool's size and free list, and (device) what an allocation
    could get by evicting too."""

    device: int
    device_free: int
    device_available: int  # free plus evictable
    host: int
    host_free: int


class PrefixCache:
    """Prefix cache over device pages with an optional pinned-host tier (None: device only)."""

    def __init__(self, page_size: int, device_pool: DevicePool, host_pool: HostPool | None = None,
                 policy: WritePolicy | str = WritePolicy.WRITE_BACK, load_back_threshold: int = 10,
                 write_through_threshold: int = 2, transfers: Transfers | None = None,
                 storage: Storage | None = None, storage_io_threads: int = 8,
                 storage_policy: StorageWritePolicy | str = StorageWritePolicy.WRITE_THROUGH,
                 fetch_rule: FetchRule = FetchRule()) -> None:
        if page_size != device_pool.layout.page_size:
            raise ValueError(f"page_size {page_size} != device pool's "
                             f"{device_pool.layout.page_size}")
        if write_through_threshold < 1 or load_back_threshold < 0:
            raise ValueError("write_through_threshold must be >= 1, load_back_threshold >= 0")
        self.page_size, self.policy = page_size, WritePolicy(policy)
        self.load_back_threshold = load_back_threshold
        self.write_threshold = (1 if self.policy is WritePolicy.WRITE_THROUGH
                                else write_through_threshold)
        self.tree = RadixTree(page_size)
        self.device_pool, self.host_pool = device_pool, host_pool
        self.device = DeviceTier(self.tree, device_pool.layout.num_pages)
        self._stats = dict.fromkeys(_STATS, 0)
        if transfers is None and host_pool is not None:  # copies at once, one memmove per
            # device shard (the CPU's way)
            copier = make_copier("cpu", range(device_pool.num_shards))[0]
            transfers = Transfers(device_pool, host_pool, copier, TransferTuning())
        self.transfers = transfers if host_pool is not None else None
        self.host = HostTier(self.tree, host_pool.layout.num_pages) if host_pool else None
        self._loading: dict[int, Node] = {}  # load op id -> deepest loaded node, locked until done
        # device page -> the load in flight into it (page ids survive node splits; nodes do not)
        self._loading_pages: dict[int, LoadTicket] = {}
        if storage is not None and self.host is None:
            raise ValueError("a storage tier needs the host tier")
        self._io_threads = storage_io_threads
        self.storage = self._tier(storage)
        self.storage_policy = StorageWritePolicy(storage_policy)
        self._filling: dict[int, int] = {}  # host page -> the write-back op copying into it
        self.fetches = Fetches(self.storage, self.tree, self.host, fetch_rule, self._alloc_host,
                               self._filling)

    # -- match / lock / insert -----------------------------------------------------------
    def match(self, tokens: Sequence[int], *, leave_last: bool = False) -> MatchResult:
        """Longest cached prefix; `tokens` is floored to whole pages (after dropping the last
        token when `leave_last`, so at least one token is always left to compute)."""
        n = len(tokens) - (1 if leave_last and tokens else 0)
        match = self.tree.match(tokens[:n - n % self.page_size])
        if self._loading_pages:
            match = match._replace(loading=self._loads_under(match.last_device_node))
        return match

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int],
               counted: int = 0) -> int:
        """Caches `tokens` (page-aligned) whose KV is in `device_pages`; returns the prefix length
        that was already on device. `counted`: the caller's earlier insert of its first
        `counted` tokens counted their hits (they are not counted twice).

        Ownership after the call, with `old` = the device_len the caller matched and locked:
        pages `[0, old)` were the tree's already; pages `[old, ret)` (ret = returned length, in
        pages `ret // page_size`) duplicate tree pages and the caller must `free_device` them;
        pages from `ret` on now belong to the tree (adopted by host-only nodes or a new leaf)
        and must never be freed by the caller.
        """
        result = self.tree.insert(tokens, device_pages, counted)
        if self.policy is not WritePolicy.WRITE_BACK and self.host is not None:
            for node in result.touched:
                if node.host_pages is None and node.hit_count >= self.write_threshold:
                    if not self._write_back(node):
                        self._stats["write_through_failures"] += 1  # retried on a later visit
        return result.prefix_len

    def _write_back(self, node: Node) -> bool:
        """Gives `node` host pages and queues the copy of its device pages into them; False
        (nothing done) when the host tier cannot free enough."""
        assert (node.device_pages is not None and self.transfers is not None
                and self.host is not None)
        host = self._alloc_host(len(node.device_pages))
        if host is None:
            return False
        node.host_pages = host
        op = self.transfers.queue_write_back(node.device_pages, host)
        if self.storage is not None:
            self._filling.update(dict.fromkeys(host, op))
            if self.storage_policy is StorageWritePolicy.WRITE_THROUGH:
                self._plan_backup(node)
        return True

    def _plan_backup(self, node: Node, evicted: bool = False) -> bool:
        """Plans the storage backup of `node`'s pages and of every ancestor not yet planned,
        head first, so that no stored prefix misses its head. An ancestor without a host copy
        gets one (its backup is written from it); when the host tier has no room for one, the
        backup is skipped (counted) and planned again when the node is next written. With
        `evicted`, `node` is a host-only leaf leaving the tree: its pages go to the backup,
        which the host tier frees once written, and a missing host copy takes only free pages
        (no eviction inside an eviction). Returns whether `node`'s own backup was planned."""
        assert self.storage is not None and self.host is not None and self.transfers
        chain: list[Node] = []
        walk: Node | None = node
        while walk is not None and walk is not self.tree.root:
            chain.append(walk)
            walk = walk.parent
        chain.reverse()
        for ancestor in chain:
            node_keys = self.tree.page_keys(ancestor)
            if self.storage.known(node_keys[-1]):
                continue
            if ancestor.host_pages is None:
                assert ancestor.device_pages is not None  # host-only nodes have host pages
                n_pages = len(ancestor.device_pages)
                host = (self.host.alloc(n_pages) if evicted
                        else self._alloc_host(n_pages))
                if host is None:
                    self._stats["storage_backup_skipped"] += 1
                    return False
                ancestor.host_pages = host
                op = self.transfers.queue_write_back(ancestor.device_pages, host)
                self._filling.update(dict.fromkeys(host, op))
            after = {self._filling[p] for p in ancestor.host_pages if p in self._filling}
            self.storage.plan_backup(node_keys, ancestor.host_pages, after)
            if ancestor is node:
                return True
        return False

    # -- device pages --------------------------------------------------------------------
    def alloc_device(self, n_pages: int) -> list[int] | None:
        """`n_pages` device pages for the caller, evicting LRU unlocked leaves if needed; None
        (nothing evicted) when free + evictable pages cannot cover the request."""
        if n_pages < 0:
            raise ValueError(f"cannot allocate {n_pages} pages")
        short = n_pages - self.device.num_free
        if short > self.device.evictable_pages:
            self._stats["alloc_failures"] += 1
            return None
        if short > 0:
            self.evict_device(short)
        return self.device.alloc(n_pages)

    def free_device(self, pages: Iterable[int]) -> None:
        """Returns pages the caller holds (never pages the tree owns) to the free list. The newest
        dispatched step may still write them (a request's step beyond its end), so no load
        copies into them before that step is done."""
        pages = list(pages)
        self.device.free(pages)
        if self.transfers is not None and pages and self.device_pool.last_compute is not None:
            self.transfers.fence_device_pages(pages, [self.device_pool.last_compute])

    def evict_device(self, n_pages: int | None = None) -> int:
        """Evicts LRU unlocked device leaves until `n_pages` (None: every evictable one) are
        free or nothing is evictable: each is written back under the write policy (or
        dropped). Returns the device pages freed (may overshoot: whole nodes)."""
        if n_pages is None:
            n_pages = self.device.evictable_pages
        freed: list[int] = []
        for node in self.device.lru_leaves():
            if len(freed) >= n_pages:
                break
            freed += self._evict_one(node)
        self._release_device(freed)
        return len(freed)

    def _evict_one(self, node: Node) -> list[int]:
        """Device copy out: drop it if on host, else write back (write_back policy) or drop."""
        assert node.device_pages is not None
        self._stats["evicted_device_tokens"] += len(node.key)
        if node.host_pages is None and self.policy is WritePolicy.WRITE_BACK and self.host:
            self._write_back(node)
        if node.host_pages is not None:
            return self.tree.detach_device_pages(node)
        return self._drop(node)

    def _drop(self, node: Node) -> list[int]:
        """Deletes a node that has no host copy, with its host-only descendants (never
        orphaned); their host pages that a storage backup still reads are freed once written."""
        device, host, host_tokens = self.tree.remove_subtree(node)
        self._stats["dropped_nodes"] += 1
        self._stats["dropped_tokens"] += len(node.key)
        if self.host is not None:
            self.host.evicted_tokens += host_tokens
            self.host.free(host)
        return device

    def _release_device(self, pages: list[int]) -> None:
        """Frees device pages that left the tree: the one place write-backs are launched before
        their pages can be reused."""
        if self.transfers is not None:
            self.transfers.launch_writes()  # every gather reading these pages first ...
            # ... and no load copies into them before the gathers ran (this one or an earlier
            # one, still queued behind the step in flight), nor before the step in flight ends:
            # an aborted prefill's pages enter the tree while that step still writes them.
            computes = self.transfers.writes.pending_gathers()
            if self.device_pool.last_compute is not None:
                computes.append(self.device_pool.last_compute)
            self.transfers.fence_device_pages(pages, computes)
        self.device.free(pages)

    # -- host pages ----------------------------------------------------------------------
    def _alloc_host(self, n_pages: int) -> list[int] | None:
        """`n_pages` host pages, evicting host-only leaves if the free list is short; None
        (nothing evicted) when that cannot cover them."""
        assert self.host is not None
        short = n_pages - self.host.num_free
        if short > 0:
            if short > self.host.evictable_pages:
                return None
            self._evict_host(short)
        return self.host.alloc(n_pages)

    def _evict_host(self, n_pages: int) -> int:
        """Deletes LRU host-only leaves until `n_pages` host pages are freed or held by the
        storage backups of the evicted (the storage write-back policy plans them; they are
        freed once written); returns the pages freed now. Their writes were dispatched when
        their device pages left the tree."""
        if self.host is None:
            return 0
        backup = self.storage is not None and self.storage_policy is StorageWritePolicy.WRITE_BACK
        removed: list[int] = []
        for node in self.host.lru_leaves():
            if len(removed) >= n_pages:
                break
            if backup:
                self._plan_backup(node, evicted=True)
            _, host, tokens = self.tree.remove_subtree(node)
            removed += host
            self.host.evicted_tokens += tokens
        before = self.host.num_free
        self.host.free(removed)
        return self.host.num_free - before

    # -- load-back -----------------------------------------------------------------------
    def load_back(self, match: MatchResult, quota_pages: int | None = None) -> LoadTicket | None:
        """Brings the whole host-only run after `match.last_device_node` back to device, or
        nothing. None (counted) when: no host tier or host hit, the run is shorter than
        `load_back_threshold` tokens, it needs more than `quota_pages`, device pages cannot be
        freed, or the match is stale. On success the nodes are on device at once and locked
        until the copy completes (released by a later step); a forward reads them after
        `TransferStep.start_loads` gave it their gate. Matched pages = match.device_pages +
        ticket.device_pages.
        """
        run = self._host_run(match.last_node) if self.transfers and match.host_len else []
        if not run:
            if match.host_len and self.transfers:
                self._stats["load_back_stale"] += 1
            return None
        tokens = sum(len(n.key) for n in run)
        if tokens < self.load_back_threshold:
            self._stats["load_back_skipped"] += 1
            return None
        if quota_pages is not None and tokens // self.page_size > quota_pages:
            self._stats["load_back_over_quota"] += 1
            return None
        device = self._alloc_for_run(run, tokens // self.page_size)
        if device is None:
            self._stats["load_back_failures"] += 1
            return None
        return self._start_load(run, device)

    def _host_run(self, last: Node) -> list[Node]:
        """Host-only nodes from below the deepest device ancestor down to `last` (top-down)."""
        run: list[Node] = []
        node: Node | None = last
        while node is not None and node.device_pages is None:
            run.append(node)
            node = node.parent
        return run[::-1] if node is not None else []  # None: `last` was removed from the tree

    def _alloc_for_run(self, run: list[Node], n_pages: int) -> list[int] | None:
        anchor = run[0].parent
        assert anchor is not None and self.host is not None
        self.tree.lock(anchor)  # the eviction below must keep the device prefix
        self.host.pin(run)  # ... and the host pages we are about to read
        try:
            return self.alloc_device(n_pages)
        finally:
            self.host.unpin(run)
            self.tree.unlock(anchor)

    def _start_load(self, run: list[Node], device: list[int]) -> LoadTicket:
        assert self.transfers is not None
        host: list[int] = []
        offset = 0
        for node in run:
            assert node.host_pages is not None
            self.tree.attach_device_pages(node, device[offset:offset + len(node.host_pages)])
            offset += len(node.host_pages)
            host += node.host_pages
        self.tree.lock(run[-1])
        ticket = self.transfers.queue_load_back(host, device)
        self._loading[ticket.op_id] = run[-1]
        self._loading_pages.update(dict.fromkeys(device, ticket))
        return ticket

    def _loads_under(self, node: Node) -> tuple[LoadTicket, ...]:
        """Tickets of the loads in flight into `node` and its ancestors: a forward reading that
        prefix waits on them (a prefix loaded ahead, or by another request, may not have landed).
        Looked up by page: a match may have split a loading node since its load started."""
        tickets: dict[int, LoadTicket] = {}
        walk: Node | None = node
        while walk is not None and self._loading_pages:
            for page in walk.device_pages or ():
                ticket = self._loading_pages.get(page)
                if ticket is not None:
                    tickets[ticket.op_id] = ticket
            walk = walk.parent
        return tuple(tickets.values())

    # -- stepping ------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[TransferStep]:
        """One engine step's transfers: on entry, finished copies retire (loaded nodes unlock)
        and storage queries just asked are given a moment to answer (`FetchRule.query_wait_s`);
        inside, `start_loads` and `finish_loads` place the step's loads around its forward; on
        exit, every write-back and load-back queued meanwhile starts (the next step's
        prefetched loads among them)."""
        step = TransferStep(self.transfers, self._retire)
        step.poll()
        self._poll_storage()
        self.fetches.await_queries()
        self.fetches.advance_all(time.perf_counter())
        yield step
        if self.transfers is not None:
            self.transfers.launch()

    def flush(self, backups: bool = False) -> int:
        """Launches and waits for every transfer, then retires them (the storage backups they
        held back start: an idle engine still writes them); with `backups`, also waits until
        every storage backup planned so far has been written and no ended fetch still reads.
        Returns the transfers retired."""
        if self.transfers is None:
            return 0
        retired = self._retire(self.transfers.flush())
        self._poll_storage()
        if backups and self.storage is not None and self.host is not None:
            self.host.free(self.storage.wait_backups())
        return retired

    @property
    def pages(self) -> PoolPages:
        """Each tier's pool size, free and (device) available pages now."""
        host = self.host
        return PoolPages(self.device.capacity, self.device.num_free, self.device.available,
                         host.capacity if host else 0, host.num_free if host else 0)

    def set_storage(self, storage: Storage | None, timeout_s: float | None = None) -> None:
        """Attaches `storage` as the storage tier, or with None detaches the one attached, while
        requests are served (between steps). The tier attached before ends first: its reads in
        flight end, the pages read so far going into the tree (their requests are admitted on
        what they have); its planned backups are written until `timeout_s` (None: all), the
        rest dropped; its threads stop. The pages it stored stay in its backend."""
        if storage is not None and self.host is None:
            raise ValueError("a storage tier needs the host tier")
        self.flush()  # no host copy in flight: no fetch read may overtake one
        if self.storage is not None:
            self.fetches.end_all()
            self.flush()
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self._free_host(self.storage.wait_backups(deadline))
            self._free_host(self.storage.close())
        self.storage = self.fetches.storage = self._tier(storage)

    def _tier(self, storage: Storage | None) -> StorageTier | None:
        if storage is None or self.host is None:
            return None
        return StorageTier(storage, self.host.lock, self.host.unlock, self._io_threads)

    def _free_host(self, pages: list[int]) -> None:
        if self.host is not None:
            self.host.free(pages)

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for every copy; with a storage tier, stores every cached page it lacks
        (`_store_all`), within `timeout_s` (None: however long it takes); stops the storage
        tier's threads and unpins the host pool: the cache serves nothing afterwards."""
        if self.storage is not None:
            self._store_all(None if timeout_s is None else time.monotonic() + timeout_s)
            self.storage.close()
        else:
            self.flush()
        if self.host_pool is not None:
            self.host_pool.close()

    def _store_all(self, deadline: float | None) -> None:
        """Plans the backup of every cached page storage lacks, whatever the write policies
        (a page only on device is copied to host for it), the most recently used prefixes
        first (under a storage cap, last: its eviction keeps the last written), and writes
        them until `deadline`. A prefix that finds no host room (its pages are locked by
        backups in flight) is tried again once those are written."""
        assert self.storage is not None and self.host is not None
        before, skipped = self.storage.counters["backup_pages"], None
        newest_first = self.storage.storage.usage().capacity_bytes is None
        while True:
            leaves = sorted((n for n in self.tree.nodes() if not n.children),
                            key=lambda n: (n.last_access, n.node_id), reverse=newest_first)
            was, skipped = skipped, 0
            for leaf in leaves:  # (a host eviction for an earlier one may remove a leaf)
                if (leaf.parent is not None
                        and not self.storage.known(self.tree.page_keys(leaf)[-1])):
                    skipped += not self._plan_backup(leaf)
            self.flush()
            self.host.free(self.storage.wait_backups(deadline))
            out_of_time = deadline is not None and time.monotonic() >= deadline
            if not skipped or was is not None and skipped >= was or out_of_time:
                break
        left = self.storage.unwritten_pages()
        logger.info("storage: %d pages written at close%s", self.storage.counters["backup_pages"]
                    - before, f", {left} not (out of time)" if left else "")

    def _retire(self, ops: list[TransferOp]) -> int:
        if self.storage is not None:
            written = {op.op_id for op in ops if op.kind is TransferKind.WRITE_BACK}
            for op in ops:
                if op.kind is TransferKind.WRITE_BACK:
                    for page in op.host_pages:
                        if self._filling.get(page) == op.op_id:
                            del self._filling[page]
            self.storage.copies_done(written)
        for op in ops:
            if op.kind is TransferKind.LOAD_BACK:
                self.tree.unlock(self._loading.pop(op.op_id))
                for page in op.device_pages:
                    if self._loading_pages.get(page) is op.ticket:
                        del self._loading_pages[page]
        return len(ops)

    def clear(self, storage: bool = False) -> int:
        """Empties the device and host tiers (a flush of the whole cache; storage keeps its
        pages), or with `storage` the storage tier alone (the device and host tiers keep
        theirs). Every transfer and storage backup ends first (backups planned would store
        pages again). Nothing may be locked: the caller holds no request. Returns the pages
        freed or deleted."""
        self.flush(backups=True)
        if storage:
            return 0 if self.storage is None else self.storage.clear()
        device, host = self.tree.clear()
        if self.host is not None:
            self.host.free(host)
        self._release_device(device)
        return len(device) + len(host)

    # -- storage -------------------------------------------------------------------------
    def _poll_storage(self) -> None:
        """Starts the backups whose copies are done, and frees fetched pages no one uses."""
        if self.storage is not None and self.host is not None:
            self.host.free(self.storage.poll())

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:  # counts, and seconds spent copying
        host = self.host
        stats: dict[str, Any] = {
            **self._stats, "write_back_ops": 0, "write_back_bytes": 0, "load_back_ops": 0,
            "load_back_bytes": 0, "write_back_s": 0.0, "load_back_s": 0.0,
            "evicted_host_tokens": host.evicted_tokens if host is not None else 0}
        if self.transfers is not None:
            c, page_bytes = self.transfers.counters, self.device_pool.layout.page_bytes
            write_s, load_s = self.transfers.seconds()
            stats.update(write_back_ops=c["write_back_ops"], load_back_ops=c["load_back_ops"],
                         write_back_bytes=c["write_back_pages"] * page_bytes,
                         load_back_bytes=c["load_back_pages"] * page_bytes,
                         write_back_s=write_s, load_back_s=load_s)
        stats.update(self._storage_stats())
        stats.update(device_free_pages=self.device.num_free,
                     evictable_tokens=self.device.evictable_pages * self.page_size,
                     protected_tokens=self.tree.protected_pages * self.page_size,
                     host_free_pages=host.num_free if host is not None else 0,
                     loads_in_flight=len(self._loading))
        return stats

    def _storage_stats(self) -> dict[str, Any]:
        """The storage tier's counters (zeros without one), each named storage_*."""
        tier: dict[str, float] = {} if self.storage is None else self.storage.counters
        backend = None if self.storage is None else self.storage.storage.counters()
        usage = None if self.storage is None else self.storage.storage.usage()
        stats: dict[str, Any] = {f"storage_{k}": tier.get(k, 0) for k in STORAGE_TIER_COUNTERS}
        for k in ("written_bytes", "write_s", "read_bytes", "read_s", "missing_pages",
                  "truncated_pages", "corrupt_pages", "evicted_pages",
                  *(f"write_failures_{reason}" for reason in WRITE_FAILURE_REASONS)):
            stats[f"storage_{k}"] = getattr(backend, k) if backend is not None else 0
        reachable = self.storage is None or self.storage.storage.reachable()
        stats.update(storage_reachable=int(reachable),
                     storage_pages=usage.pages if usage else 0,
                     storage_bytes=usage.bytes if usage else 0,
                     storage_capacity_bytes=(usage.capacity_bytes or 0) if usage else 0)
        return stats

    def check_invariants(self, extra_owned_device_pages: Iterable[int] = (),
                         extra_owned_host_pages: Iterable[int] = ()) -> None:
        """Raises InvariantError on any page-accounting error in either tier (pass the device
        pages held by running requests), when a layer's device pages are not split over the
        devices as the pool's sharding says, when any shard of a layer left the buffer the
        host tier's copies target, or when a kernel ever stopped waiting for loaded pages before
        they landed (this reads the device: it waits for the compute queued so far)."""
        if self.storage is not None and self.host is not None:
            extra_owned_host_pages = [*extra_owned_host_pages, *self.storage.held_pages(),
                                      *self.host.releasing]
        check_invariants(self.tree, self.device.pages,
                         self.host.pages if self.host is not None else None,
                         extra_owned_device_pages, extra_owned_host_pages)
        misplaced = self.device_pool.misplaced_layers()
        if misplaced:
            raise InvariantError(f"device pages of layers {misplaced} are not laid out as "
                                 f"{self.device_pool.sharding}")
        if self.transfers is not None:
            try:
                self.transfers.loads.check_buffers()
            except RuntimeError as e:
                raise InvariantError(str(e)) from e
            if self.device_pool.gate_timeouts():
                raise InvariantError("an attention kernel stopped waiting for a layer's loaded "
                                     "pages before they landed (its forward read stale pages)")
