"""Tier: one level of the cache's memory (device, host), an allocator plus its eviction order.

The radix tree says which node holds which pages of each tier; a tier hands its pages out, takes
them back, and names the tree's leaves it may give up, least recently used first. What happens
to an evicted leaf (written back, dropped) is the prefix cache's policy, not the tier's. The
storage tier under the host tier holds no tree pages (`jhicache.cache.storage_tier`).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable, Iterator

from jhicache.cache.device_pool import RESERVED_PAGES
from jhicache.cache.pages import PageAllocator
from jhicache.cache.radix_tree import Node, RadixTree


class Tier:
    """Pages of one tier: the free list, and the tree's leaves on this tier in LRU order."""

    name = "tier"

    def __init__(self, tree: RadixTree, num_pages: int, first_page: int = 0) -> None:
        self.tree = tree
        self.pages = PageAllocator(num_pages, first_page)

    @property
    def capacity(self) -> int:
        """Pages this tier can hand out."""
        return self.pages.capacity

    @property
    def num_free(self) -> int:
        """Pages on the free list now."""
        return self.pages.num_free

    @property
    def evictable_pages(self) -> int:
        """Pages of the leaves `lru_leaves` may yield, and of what they uncover."""
        raise NotImplementedError

    def alloc(self, n_pages: int) -> list[int] | None:
        """`n_pages` free pages, or None (nothing taken); never evicts."""
        if n_pages < 0:
            raise ValueError(f"cannot allocate {n_pages} pages")
        return self.pages.alloc(n_pages)

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list."""
        if pages:
            self.pages.free(pages)

    def lru_leaves(self) -> Iterator[Node]:
        """This tier's evictable leaves, least recently used first. A parent that the caller's
        eviction of a leaf turned into a leaf is yielded in its turn."""
        heap = [(n.last_access, n.node_id, n) for n in self._candidates()]
        heapq.heapify(heap)
        while heap:
            node = heapq.heappop(heap)[2]
            if not self._is_evictable_leaf(node):
                continue  # stale: evicted, locked or grown since
            parent = node.parent
            yield node
            if parent is not None and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))

    def _candidates(self) -> Iterable[Node]:
        raise NotImplementedError

    def _is_evictable_leaf(self, node: Node) -> bool:
        raise NotImplementedError


class DeviceTier(Tier):
    """Device (HBM) pages; page 0 is the reserved padding sink and is never handed out. Its
    evictable leaves are the unlocked nodes with no child on device."""

    name = "device"

    def __init__(self, tree: RadixTree, num_pages: int) -> None:
        super().__init__(tree, num_pages, RESERVED_PAGES)

    @property
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages

    @property
    def available(self) -> int:
        """Pages an allocation can get now: free plus evictable (locked nodes' and requests'
        pages do not count)."""
        return self.num_free + self.evictable_pages

    def _candidates(self) -> Iterable[Node]:
        return self.tree.device_eviction_candidates()

    def _is_evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and node.lock_count == 0 and self.tree.is_device_leaf(node)


class HostTier(Tier):
    """Pinned host pages. Its evictable leaves are host-only nodes with no children, except
    nodes `pin`ned (a load-back is about to read them, or a storage fetch will add pages under
    them) and nodes holding a `lock`ed page (a storage backup is writing it); the prefix cache
    evicts one by deleting it from the tree (after planning its backup, if any)."""

    name = "host"

    def __init__(self, tree: RadixTree, num_pages: int) -> None:
        super().__init__(tree, num_pages)
        self.pinned: collections.Counter[Node] = collections.Counter()
        self.locked: collections.Counter[int] = collections.Counter()
        self.releasing: set[int] = set()  # freed while locked: free once unlocked
        self.evicted_tokens = 0

    def pin(self, nodes: Iterable[Node]) -> None:
        self.pinned.update(nodes)

    def unpin(self, nodes: Iterable[Node]) -> None:
        self.pinned.subtract(nodes)
        self.pinned = +self.pinned  # drops the nodes no longer pinned

    def lock(self, pages: Iterable[int]) -> None:
        self.locked.update(pages)

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list; a locked page (a backup still reads it) goes there
        once unlocked, so that nothing overwrites it before its backup has written it. The
        tree may let go of a locked page at any time (a dropped node's host-only descendants,
        an evicted leaf whose pages its backup writes)."""
        twice = [p for p in pages if p in self.releasing] if self.releasing else []
        if twice:
            raise ValueError(f"double free of host pages {twice}")
        locked = [p for p in pages if p in self.locked] if self.locked else []
        self.releasing.update(locked)
        super().free([p for p in pages if p not in self.locked] if locked else pages)

    def unlock(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        self.locked.subtract(pages)
        self.locked = +self.locked
        done = [p for p in dict.fromkeys(pages) if p in self.releasing and p not in self.locked]
        self.releasing.difference_update(done)
        super().free(done)

    @property
    def evictable_pages(self) -> int:
        """Host-only pages, less those of pinned or locked nodes and of their host-only
        ancestors (a node with such a descendant never becomes a leaf)."""
        total = self.tree.host_only_pages
        if not self.pinned and not self.locked:
            return total
        # Pinned nodes are at hand; a locked page's node only by a walk of the tree, which only
        # a storage backup in flight (the one user of locks) costs.
        seeds = [n for n in self.pinned if n.device_pages is None and self.tree.in_tree(n)]
        if self.locked:
            seeds += [n for n in self.tree.nodes() if n.device_pages is None
                      and n not in self.pinned
                      and any(p in self.locked for p in n.host_pages or ())]
        blocked: set[Node] = set()
        for node in seeds:
            walk: Node | None = node
            while walk is not None and walk.device_pages is None and walk not in blocked:
                blocked.add(walk)
                walk = walk.parent
        return total - sum(len(n.host_pages or ()) for n in blocked)

    def _candidates(self) -> Iterable[Node]:
        return self.tree.host_eviction_candidates()

    def _is_evictable_leaf(self, node: Node) -> bool:
        return (node not in self.pinned and self.tree.is_host_leaf(node)
                and not any(p in self.locked for p in node.host_pages or ()))
