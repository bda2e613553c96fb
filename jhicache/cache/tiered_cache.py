"""TieredCache: the radix tree joined with the device and host page allocators, the write policy
and the transfer controller; the only object the engine talks to for prefix caching.

Page regions of the device tier (page 0 is the reserved padding sink and belongs to none):
| region     | owner                         | leaves it by                                  |
|------------|-------------------------------|-----------------------------------------------|
| free       | device PageAllocator          | alloc_device / load_back                      |
| held       | running requests (engine)     | insert (tree takes it) / free_device          |
| evictable  | unlocked tree nodes           | evict_device (write-back or drop)             |
| protected  | locked tree nodes             | unlock                                        |
Host tier: free, or host copy of a tree node (device+host or host-only); only host-only leaves
are host-evicted, and only when a host allocation would otherwise fail.

Rule that keeps copies correct: before any page leaves the tree, queued write-backs are launched
(their gather is dispatched), so compute that reuses a page is ordered after the gather read it;
loads are copies JAX does not see, so every device page freed while compute that may touch it is
in flight is fenced until that compute is done (`TransferController.fence_device_pages`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from jhicache.cache.copier import Copier, make_copier
from jhicache.cache.device_pool import RESERVED_PAGES, DevicePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.host_tier import HostTier
from jhicache.cache.invariants import InvariantError, check_invariants
from jhicache.cache.pages import PageAllocator
from jhicache.cache.radix_tree import MatchResult, Node, RadixTree
from jhicache.cache.ticket import LoadTicket
from jhicache.cache.transfer import TransferController, TransferKind, TransferOp
from jhicache.config import WritePolicy

_STATS = ("write_back_ops", "write_back_bytes", "load_back_ops", "load_back_bytes",
          "evicted_device_tokens", "evicted_host_tokens", "dropped_nodes", "dropped_tokens",
          "write_through_failures", "load_back_skipped", "load_back_over_quota",
          "load_back_failures", "load_back_stale", "alloc_failures")


class TieredCache:
    """Prefix cache over device pages with an optional pinned-host tier (None: device only)."""

    def __init__(self, page_size: int, device_pool: DevicePool, host_pool: HostPool | None = None,
                 policy: WritePolicy | str = WritePolicy.WRITE_BACK, load_back_threshold: int = 10,
                 write_through_threshold: int = 2, copier: Copier | None = None) -> None:
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
        self.device_alloc = PageAllocator(device_pool.layout.num_pages, RESERVED_PAGES)
        self._stats = dict.fromkeys(_STATS, 0)
        if copier is None:  # copies at once, one memmove per device shard (the CPU's way)
            copier = make_copier("cpu", range(device_pool.num_shards))[0]
        self.controller = (TransferController(device_pool, host_pool, copier)
                           if host_pool is not None else None)
        self.host = (HostTier(host_pool, self.tree, self.controller, self._stats)
                     if host_pool is not None and self.controller is not None else None)
        self._loading: dict[int, Node] = {}  # load op id -> deepest loaded node, locked until done
        # device page -> the load in flight into it (page ids survive node splits; nodes do not)
        self._loading_pages: dict[int, LoadTicket] = {}

    # -- match / lock / insert -----------------------------------------------------------
    def match(self, tokens: Sequence[int], *, leave_last: bool = False) -> MatchResult:
        """Longest cached prefix; `tokens` is floored to whole pages (after dropping the last
        token when `leave_last`, so at least one token is always left to compute)."""
        n = len(tokens) - (1 if leave_last and tokens else 0)
        return self.tree.match(tokens[:n - n % self.page_size])

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> int:
        """Caches `tokens` (page-aligned) whose KV is in `device_pages`; returns the prefix length
        that was already on device.

        Ownership after the call, with `old` = the device_len the caller matched and locked:
        pages `[0, old)` were the tree's already; pages `[old, ret)` (ret = returned length, in
        pages `ret // page_size`) duplicate tree pages and the caller must `free_device` them;
        pages from `ret` on now belong to the tree (adopted by host-only nodes or a new leaf)
        and must never be freed by the caller.
        """
        result = self.tree.insert(tokens, device_pages)
        if self.policy is not WritePolicy.WRITE_BACK and self.host is not None:
            for node in result.touched:
                if node.host_pages is None and node.hit_count >= self.write_threshold:
                    self._write_through(node)
        return result.prefix_len

    def _write_through(self, node: Node) -> None:
        assert (node.device_pages is not None and self.controller is not None
                and self.host is not None)
        host = self.host.alloc_pages(len(node.device_pages))
        if host is None:
            # stays device-only; retried on a later visit
            self._stats["write_through_failures"] += 1
            return
        node.host_pages = host
        self.controller.queue_write_back(node.device_pages, host)

    # -- device pages --------------------------------------------------------------------
    def alloc_device(self, n_pages: int) -> list[int] | None:
        """`n_pages` device pages for the caller, evicting LRU unlocked leaves if needed; None
        (nothing evicted) when free + evictable pages cannot cover the request."""
        if n_pages < 0:
            raise ValueError(f"cannot allocate {n_pages} pages")
        short = n_pages - self.device_alloc.num_free
        if short > self.tree.evictable_pages:
            self._stats["alloc_failures"] += 1
            return None
        if short > 0:
            self.evict_device(short)
        return self.device_alloc.alloc(n_pages)

    def free_device(self, pages: Iterable[int]) -> None:
        """Returns pages the caller holds (never pages the tree owns) to the free list. The newest
        dispatched step may still write them (a request's step beyond its end), so no load
        copies into them before that step is done."""
        pages = list(pages)
        self.device_alloc.free(pages)
        if self.controller is not None and pages and self.device_pool.last_compute is not None:
            self.controller.fence_device_pages(pages, [self.device_pool.last_compute])

    def evict_device(self, n_pages: int) -> int:
        """Evicts LRU unlocked device leaves until `n_pages` are free or nothing is evictable;
        returns the number of device pages freed (may overshoot: whole nodes)."""
        heap = [(n.last_access, n.node_id, n) for n in self.tree.device_eviction_candidates()]
        freed: list[int] = []
        while len(freed) < n_pages and heap:
            node = heapq.heappop(heap)[2]
            if node.parent is None or node.lock_count or not self.tree.is_device_leaf(node):
                continue  # stale heap entry
            parent = node.parent
            freed += self._evict_one(node)
            if parent.lock_count == 0 and self.tree.is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._release_device(freed)
        return len(freed)

    def _evict_one(self, node: Node) -> list[int]:
        """Device copy out: drop it if on host, else write back (write_back policy) or drop."""
        assert node.device_pages is not None
        self._stats["evicted_device_tokens"] += len(node.key)
        if node.host_pages is None and self.policy is WritePolicy.WRITE_BACK and self.host:
            assert self.controller is not None
            host = self.host.alloc_pages(len(node.device_pages))
            if host is not None:
                node.host_pages = host
                self.controller.queue_write_back(node.device_pages, host)
        if node.host_pages is not None:
            return self.tree.detach_device_pages(node)
        return self._drop(node)

    def _drop(self, node: Node) -> list[int]:
        """Deletes a node that has no host copy, with its host-only descendants (never orphaned)."""
        device, host, host_tokens = self.tree.remove_subtree(node)
        self._stats["dropped_nodes"] += 1
        self._stats["dropped_tokens"] += len(node.key)
        self._stats["evicted_host_tokens"] += host_tokens
        if self.host is not None:
            self.host.release(host)
        return device

    def _release_device(self, pages: list[int]) -> None:
        if self.controller is not None:
            self.controller.launch_writes()  # every gather reading these pages first ...
            # ... and no load copies into them before the gathers ran (this one or an earlier
            # one, still queued behind the step in flight), nor before the step in flight ends:
            # an aborted prefill's pages enter the tree while that step still writes them.
            computes = self.controller.pending_gathers()
            if self.device_pool.last_compute is not None:
                computes.append(self.device_pool.last_compute)
            self.controller.fence_device_pages(pages, computes)
        self.device_alloc.free(pages)

    # -- host pages ----------------------------------------------------------------------
    @property
    def host_alloc(self) -> PageAllocator | None:
        return self.host.alloc if self.host is not None else None

    def evict_host(self, n_pages: int) -> int:
        """Deletes LRU host-only leaves until `n_pages` host pages are freed; returns pages
        freed."""
        return self.host.evict(n_pages) if self.host is not None else 0

    # -- load-back -----------------------------------------------------------------------
    def load_back(self, match: MatchResult, quota_pages: int | None = None) -> LoadTicket | None:
        """Brings the whole host-only run after `match.last_device_node` back to device, or
        nothing. None (counted) when: no host tier or host hit, the run is shorter than
        `load_back_threshold` tokens, it needs more than `quota_pages`, device pages cannot be
        freed, or the match is stale. On success the nodes are on device at once and locked
        until the copy completes (released by `poll`); the caller reads the data only after
        `launch()`, in a forward gated on `ticket.gate_seq()` or after `ticket.wait_all()`.
        Matched pages = match.device_pages +
        ticket.device_pages.
        """
        run = self._host_run(match.last_node) if self.controller and match.host_len else []
        if not run:
            if match.host_len and self.controller:
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
        assert anchor is not None
        self.tree.lock(anchor)  # the eviction below must keep the device prefix
        assert self.host is not None
        self.host.pinned.update(run)  # ... and the host pages we are about to read
        try:
            return self.alloc_device(n_pages)
        finally:
            self.host.pinned.difference_update(run)
            self.tree.unlock(anchor)

    def _start_load(self, run: list[Node], device: list[int]) -> LoadTicket:
        assert self.controller is not None
        host: list[int] = []
        offset = 0
        for node in run:
            assert node.host_pages is not None
            self.tree.attach_device_pages(node, device[offset:offset + len(node.host_pages)])
            offset += len(node.host_pages)
            host += node.host_pages
        self.tree.lock(run[-1])
        ticket = self.controller.queue_load_back(host, device)
        self._loading[ticket.op_id] = run[-1]
        self._loading_pages.update(dict.fromkeys(device, ticket))
        return ticket

    def loads_under(self, node: Node) -> list[LoadTicket]:
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
        return list(tickets.values())

    # -- stepping ------------------------------------------------------------------------
    def launch(self) -> None:
        """Dispatches all queued transfers (write-backs, then load-backs); call before the
        forward."""
        if self.controller is not None:
            self.controller.launch()

    def launch_loads(self, first_layers: int | None = None) -> None:
        """Dispatches the queued load-backs alone (write-backs wait for `launch`); with
        `first_layers`, only their first layers' copies where the device can wait for the rest,
        which `finish_loads` queues."""
        if self.controller is not None:
            self.controller.launch_loads(first_layers)

    def finish_loads(self) -> None:
        """Queues the copies `launch_loads(first_layers)` held back."""
        if self.controller is not None:
            self.controller.finish_loads()

    def poll(self) -> int:
        """Retires completed transfers (unlocks loaded nodes); returns the number retired."""
        if self.controller is None:
            return 0
        return self._retire(self.controller.poll())

    def flush(self) -> int:
        """Launches and waits for every transfer, then retires them."""
        if self.controller is None:
            return 0
        return self._retire(self.controller.flush())

    def _retire(self, ops: list[TransferOp]) -> int:
        for op in ops:
            if op.kind is TransferKind.LOAD_BACK:
                self.tree.unlock(self._loading.pop(op.op_id))
                for page in op.device_pages:
                    if self._loading_pages.get(page) is op.ticket:
                        del self._loading_pages[page]
        return len(ops)

    def clear(self) -> int:
        """Empties both tiers (a flush of the whole cache); every transfer ends first. Nothing
        may be locked: the caller holds no request. Returns the device and host pages freed."""
        self.flush()
        device, host = self.tree.clear()
        if self.host is not None:
            self.host.release(host)
        self._release_device(device)
        return len(device) + len(host)

    # -- occupancy -----------------------------------------------------------------------
    @property
    def device_capacity(self) -> int:
        """Device pages the cache can hand out (the reserved padding page excluded)."""
        return self.device_alloc.capacity

    @property
    def device_free_pages(self) -> int:
        """Device pages on the free list now (not counting evictable tree pages)."""
        return self.device_alloc.num_free

    @property
    def evictable_device_pages(self) -> int:
        """Device pages of unlocked tree nodes: `evict_device` (or an allocation) may free them."""
        return self.tree.evictable_pages

    def available_device_pages(self) -> int:
        """Device pages an allocation can get now: free plus evictable. What `alloc_device`
        checks before it evicts; pages of locked nodes and of requests do not count."""
        return self.device_free_pages + self.evictable_device_pages

    @property
    def host_capacity(self) -> int:
        """Host pages of the host tier; 0 without one."""
        return self.host_alloc.capacity if self.host_alloc is not None else 0

    @property
    def host_free_pages(self) -> int:
        """Host pages on the host tier's free list now; 0 without a host tier."""
        return self.host_alloc.num_free if self.host_alloc is not None else 0

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:  # counts, and seconds spent copying
        stats = {**self._stats, "write_back_s": 0.0, "load_back_s": 0.0}
        if self.controller is not None:
            c, page_bytes = self.controller.counters, self.device_pool.layout.page_bytes
            stats.update(write_back_ops=c["write_back_ops"], load_back_ops=c["load_back_ops"],
                         write_back_bytes=c["write_back_pages"] * page_bytes,
                         load_back_bytes=c["load_back_pages"] * page_bytes,
                         write_back_s=c["write_back_s"], load_back_s=c["load_back_s"])
        stats.update(device_free_pages=self.device_free_pages,
                     evictable_tokens=self.evictable_device_pages * self.page_size,
                     protected_tokens=self.tree.protected_pages * self.page_size,
                     host_free_pages=self.host_free_pages,
                     loads_in_flight=len(self._loading))
        return stats

    def check_invariants(self, extra_owned_device_pages: Iterable[int] = (),
                         extra_owned_host_pages: Iterable[int] = ()) -> None:
        """Raises InvariantError on any page-accounting error in either tier (pass the device
        pages held by running requests), when a layer's device pages are not split over the
        devices as the pool's sharding says, when any shard of a layer left the buffer the
        host tier's copies target, or when a kernel ever stopped waiting for loaded pages before
        they landed (this reads the device: it waits for the compute queued so far)."""
        check_invariants(self.tree, self.device_alloc, self.host_alloc,
                         extra_owned_device_pages, extra_owned_host_pages)
        misplaced = self.device_pool.misplaced_layers()
        if misplaced:
            raise InvariantError(f"device pages of layers {misplaced} are not laid out as "
                                 f"{self.device_pool.sharding}")
        if self.controller is not None:
            try:
                self.controller.check_buffers()
            except RuntimeError as e:
                raise InvariantError(str(e)) from e
            if self.device_pool.gate_timeouts():
                raise InvariantError("an attention kernel stopped waiting for a layer's loaded "
                                     "pages before they landed (its forward read stale pages)")
