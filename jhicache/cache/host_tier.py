"""HostTier: the cache's pinned-host pages: allocation, LRU eviction of host-only leaves,
release."""

from __future__ import annotations

import heapq

from jhicache.cache.host_pool import HostPool
from jhicache.cache.pages import PageAllocator
from jhicache.cache.radix_tree import Node, RadixTree
from jhicache.cache.transfer import TransferController


class HostTier:
    """Host pages of a TieredCache. The tree says which node owns each page; this tier hands pages
    out, takes them back, and evicts host-only leaves (LRU) when an allocation would fail."""

    def __init__(self, pool: HostPool, tree: RadixTree, controller: TransferController,
                 stats: dict[str, int]) -> None:
        self.pool, self.tree, self.controller, self._stats = pool, tree, controller, stats
        self.alloc = PageAllocator(pool.layout.num_pages)
        # host-only nodes a load-back is about to read: never evicted
        self.pinned: set[Node] = set()

    def alloc_pages(self, n_pages: int) -> list[int] | None:
        """`n_pages` host pages, evicting host-only leaves if needed; None when that cannot cover
        them."""
        short = n_pages - self.alloc.num_free
        if short > 0:
            if short > self.evictable_pages():
                return None
            self.evict(short)
        return self.alloc.alloc(n_pages)

    def evictable_pages(self) -> int:
        pinned = sum(len(n.host_pages or ()) for n in self.pinned)
        return self.tree.host_only_pages() - pinned

    def evict(self, n_pages: int) -> int:
        """Deletes LRU host-only leaves until `n_pages` host pages are freed; returns pages
        freed."""
        heap = [(n.last_access, n.node_id, n) for n in self.tree.host_eviction_candidates()]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < n_pages and heap:
            node = heapq.heappop(heap)[2]
            if node in self.pinned or not self.tree.is_host_leaf(node):
                continue
            parent = node.parent
            _, host, tokens = self.tree.remove_subtree(node)
            freed += host
            self._stats["evicted_host_tokens"] += tokens
            if parent is not None and self.tree.is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self.release(freed)
        return len(freed)

    def release(self, pages: list[int]) -> None:
        """Returns pages that left the tree to the free list."""
        if not pages:
            return
        self.controller.launch_writes()  # a queued write into a page must not outlive its node
        self.alloc.free(pages)
