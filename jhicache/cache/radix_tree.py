"""RadixTree and Node: page-aligned token prefixes -> nodes holding device and/or host page ids.

Pure Python (imports no JAX or numpy; page keys are hashlib's SHA-256). Invariants it maintains:
  1. Every ancestor of a node with device pages has device pages (residency is a top-down prefix).
  2. A node without device pages has host pages (otherwise it is deleted).
  3. Page lists, when set, hold one id per page of the node's key; keys are page multiples.
  4. Only nodes with device pages are locked; a locked node is never device-evicted.
Device accounting: `evictable_pages` / `protected_pages` count device pages of unlocked /
locked non-root nodes, so `free + evictable + protected (+ pages held by requests) == capacity`.
Host accounting: `host_only_pages` counts the host pages of host-only nodes, all reclaimable by
repeated host eviction (kept as they change: the host tier reads it on every allocation that
must evict, so it must not walk the tree).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from jhicache.cache.page_keys import ROOT_KEY, chain_keys
from jhicache.cache.ticket import LoadTicket


class Node:
    """One edge of the tree: a page-aligned token chunk and the pages that hold its KV."""

    __slots__ = ("key", "parent", "children", "device_pages", "host_pages", "lock_count",
                 "last_access", "hit_count", "node_id", "page_keys")

    def __init__(self, key: tuple[int, ...], parent: Node | None, node_id: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.device_pages: list[int] | None = None
        self.host_pages: list[int] | None = None
        self.lock_count = 0
        self.last_access = 0
        self.hit_count = 0
        self.node_id = node_id
        self.page_keys: list[bytes] | None = None  # storage keys of its pages, once asked for

    def __repr__(self) -> str:
        return (f"Node(id={self.node_id}, tokens={len(self.key)}, device={self.device_pages}, "
                f"host={self.host_pages}, locks={self.lock_count})")


class MatchResult(NamedTuple):
    """Result of `RadixTree.match`; lengths are in tokens and page-aligned. `loading`: the loads
    in flight into the matched device prefix (the prefix cache fills it): a forward reading it
    waits on them."""

    device_pages: list[int]
    device_len: int
    last_device_node: Node
    host_len: int
    last_node: Node
    loading: tuple[LoadTicket, ...] = ()


class InsertResult(NamedTuple):
    """Result of `RadixTree.insert`.

    prefix_len: tokens that were already on device (the caller's duplicate pages for
      `[its old prefix, prefix_len)` must be freed by the caller); adopted and new tokens are
      excluded, because their pages now belong to the tree.
    adopted_len: tokens of host-only nodes that took the caller's device pages (host copy kept).
    last_node: the node ending the inserted key.
    touched: on-device nodes visited or created (hit counts already incremented).
    """

    prefix_len: int
    adopted_len: int
    last_node: Node
    touched: list[Node]


class RadixTree:
    """Token-prefix tree over pages; all bookkeeping, no memory."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._clock = 0
        self._next_id = 1
        self.root = Node((), None, 0)
        self.root.device_pages, self.root.host_pages, self.root.lock_count = [], [], 1
        self.evictable_pages = 0
        self.protected_pages = 0
        self.host_only_pages = 0

    # -- walking -------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_aligned(self, n: int) -> None:
        if n % self.page_size:
            raise ValueError(f"key length {n} is not a multiple of page_size {self.page_size}")

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Length of the common prefix counted in whole pages only."""
        p = self.page_size
        limit = min(len(key), len(tokens) - start)
        limit -= limit % p
        # One C-level comparison settles the common case (the whole key matches); only a
        # mismatch pays for the page-by-page search, on tuple slices (no per-page conversion).
        if tokens[start:start + limit] == key[:limit]:
            return limit
        n = 0
        while n + p <= limit and tokens[start + n:start + n + p] == key[n:n + p]:
            n += p
        return n

    def _walk(self, tokens: Sequence[int]) -> Iterator[tuple[Node, int]]:
        """Yields (node, start) for each matched node, splitting the last one if partial."""
        self._check_aligned(len(tokens))
        tokens = tuple(tokens)  # once: slices of a tuple are keys already, no copy per page
        node, pos, now = self.root, 0, self._tick()
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + self.page_size])
            if child is None:
                return
            n = self._common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            yield child, pos
            pos += n
            node = child

    def _split(self, child: Node, n: int) -> Node:
        """Splits `child` after `n` tokens; the new upper node inherits locks and hit count."""
        parent, k = child.parent, n // self.page_size
        assert parent is not None and 0 < n < len(child.key)
        upper = Node(child.key[:n], parent, self._new_id())
        upper.lock_count, upper.hit_count = child.lock_count, child.hit_count
        upper.last_access = child.last_access
        if child.device_pages is not None:
            upper.device_pages, child.device_pages = child.device_pages[:k], child.device_pages[k:]
        if child.host_pages is not None:
            upper.host_pages, child.host_pages = child.host_pages[:k], child.host_pages[k:]
        if child.page_keys is not None:
            upper.page_keys, child.page_keys = child.page_keys[:k], child.page_keys[k:]
        parent.children[child.key[:self.page_size]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        return upper

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # -- match / insert ------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `tokens` (aligned length required), across both tiers."""
        device_pages: list[int] = []
        device_len = host_len = 0
        last_device = last = self.root
        for node, _ in self._walk(tokens):
            last = node
            if node.device_pages is not None:
                device_pages += node.device_pages
                device_len += len(node.key)
                last_device = node
            else:
                host_len += len(node.key)
        return MatchResult(device_pages, device_len, last_device, host_len, last)

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int],
               counted: int = 0) -> InsertResult:
        """Inserts `tokens` whose KV lives in `device_pages` (one id per page); each node on the
        way that was cached on device already counts a hit, but those within the first
        `counted` tokens (the inserting request counted them when it inserted them before)."""
        self._check_aligned(len(tokens))
        if len(device_pages) * self.page_size != len(tokens):
            raise ValueError(f"{len(device_pages)} pages do not cover {len(tokens)} tokens")
        node, pos, prefix_len, adopted, touched = self.root, 0, 0, 0, []
        for node, pos in self._walk(tokens):
            n = len(node.key)
            if node.device_pages is not None:
                assert adopted == 0, "on-device node below a host-only node"
                prefix_len += n
                if pos + n > counted:
                    node.hit_count += 1
                touched.append(node)
            else:
                self._set_device(node, list(device_pages[pos // self.page_size:
                                                         (pos + n) // self.page_size]))
                adopted += n
            pos += n
        end = prefix_len + adopted
        if end < len(tokens):
            node = self._add_leaf(node, tuple(tokens[end:]),
                                  list(device_pages[end // self.page_size:]))
            touched.append(node)
        return InsertResult(prefix_len, adopted, node, touched)

    def insert_host(self, tokens: Sequence[int], host_pages: Sequence[int],
                    first_page: int) -> list[int]:
        """Caches host-only pages (read from storage) for the pages of `tokens` from
        `first_page` on, under the prefix before it, which must be cached (else nothing is
        inserted). Returns the host pages the tree did not take (those pages were cached
        already, or the prefix was not): the caller frees them."""
        self._check_aligned(len(tokens))
        start = first_page * self.page_size
        if len(host_pages) * self.page_size != len(tokens) - start:
            raise ValueError(f"{len(host_pages)} pages do not cover tokens [{start}, "
                             f"{len(tokens)})")
        node, end = self.root, 0
        for node, pos in self._walk(tokens):
            end = pos + len(node.key)
        if end < start:
            return list(host_pages)  # the prefix was evicted meanwhile: nothing to hang them on
        if end < len(tokens):
            leaf = Node(tuple(tokens[end:]), node, self._new_id())
            leaf.last_access = self._tick()
            leaf.host_pages = list(host_pages[(end - start) // self.page_size:])
            node.children[leaf.key[:self.page_size]] = leaf
            self.host_only_pages += len(leaf.host_pages)
        return list(host_pages[:(end - start) // self.page_size])

    def page_keys(self, node: Node) -> list[bytes]:
        """The storage keys of `node`'s pages (chained from its parent's last), computed once
        per node and kept (a split divides them), so no prefix is hashed from the root again."""
        missing: list[Node] = []
        walk = node
        while walk.page_keys is None and walk is not self.root:
            assert walk.parent is not None, "page keys of a node no longer in the tree"
            missing.append(walk)
            walk = walk.parent
        previous = walk.page_keys[-1] if walk.page_keys else ROOT_KEY
        for n in reversed(missing):
            n.page_keys = chain_keys(n.key, self.page_size, previous)
            previous = n.page_keys[-1]
        assert node.page_keys is not None
        return node.page_keys

    def _add_leaf(self, parent: Node, key: tuple[int, ...], device_pages: list[int]) -> Node:
        leaf = Node(key, parent, self._new_id())
        leaf.last_access, leaf.hit_count = self._tick(), 1
        parent.children[key[:self.page_size]] = leaf
        self._set_device(leaf, device_pages)
        return leaf

    def _set_device(self, node: Node, pages: list[int]) -> None:
        assert node.device_pages is None and node.lock_count == 0
        node.device_pages = pages
        self.evictable_pages += len(pages)
        self.host_only_pages -= len(node.host_pages or ())  # a host-only node is on device again

    # -- locks ---------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Pins `node` and its ancestors on device."""
        if node.device_pages is None:
            raise ValueError(f"cannot lock a node that is not on device: {node}")
        for n in self._path_up(node):
            if n.lock_count == 0:
                self.evictable_pages -= len(n.device_pages or ())
                self.protected_pages += len(n.device_pages or ())
            n.lock_count += 1

    def unlock(self, node: Node) -> None:
        """Releases one `lock(node)`; raises ValueError (changing nothing) below zero."""
        path = list(self._path_up(node))
        if any(n.lock_count <= 0 for n in path):
            raise ValueError(f"unlock below zero on the path of {node}")
        for n in path:
            n.lock_count -= 1
            if n.lock_count == 0:
                self.evictable_pages += len(n.device_pages or ())
                self.protected_pages -= len(n.device_pages or ())

    def _path_up(self, node: Node) -> Iterator[Node]:
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"node is no longer in the tree: {node}")
            yield node
            node = node.parent

    # -- residency changes (called by PrefixCache) ---------------------------------------
    def attach_device_pages(self, node: Node, pages: list[int]) -> None:
        """Marks a host-only node on device again (load-back); the parent must be on device."""
        assert node.parent is not None and node.parent.device_pages is not None
        assert node.host_pages is not None and len(pages) == len(node.host_pages)
        self._set_device(node, pages)

    def detach_device_pages(self, node: Node) -> list[int]:
        """Drops the device copy of an unlocked device leaf that has a host copy."""
        assert (node.lock_count == 0 and node.host_pages is not None
                and node.device_pages is not None)
        assert not any(c.device_pages is not None for c in node.children.values())
        pages, node.device_pages = node.device_pages, None
        self.evictable_pages -= len(pages)
        self.host_only_pages += len(node.host_pages)
        return pages

    def remove_subtree(self, node: Node) -> tuple[list[int], list[int], int]:
        """Deletes an unlocked node and its (host-only) descendants.

        Returns (device pages, host pages, host-only tokens) that the caller must free.
        """
        assert node is not self.root and node.lock_count == 0 and node.parent is not None
        device: list[int] = []
        host: list[int] = []
        host_only_tokens = 0
        for n in self._subtree(node):
            if n.device_pages is not None:
                assert n is node, "device pages below the removed node"
                device += n.device_pages
                self.evictable_pages -= len(n.device_pages)
            else:
                host_only_tokens += len(n.key)
                self.host_only_pages -= len(n.host_pages or ())
            host += n.host_pages or []
        del node.parent.children[node.key[:self.page_size]]
        node.parent = None
        return device, host, host_only_tokens

    def clear(self) -> tuple[list[int], list[int]]:
        """Deletes every node (none may be locked); returns (device pages, host pages) to free."""
        nodes = list(self.nodes())
        if any(n.lock_count for n in nodes):
            raise ValueError("cannot clear a tree with locked nodes")
        device = [p for n in nodes for p in n.device_pages or ()]
        host = [p for n in nodes for p in n.host_pages or ()]
        self.root.children = {}
        self.evictable_pages = self.host_only_pages = 0
        return device, host

    def _subtree(self, node: Node) -> Iterator[Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    # -- eviction candidates -------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node except the root."""
        for n in self._subtree(self.root):
            if n is not self.root:
                yield n

    def is_device_leaf(self, node: Node) -> bool:
        """On device, not root, and no child on device."""
        return (node is not self.root and node.device_pages is not None
                and not any(c.device_pages is not None for c in node.children.values()))

    def device_eviction_candidates(self) -> list[Node]:
        """Unlocked device leaves, least recently used first.

        Walks only the on-device top of the tree (invariant 1: nothing below a host-only node is
        on device), in one loop: it runs on every eviction, and host-only nodes pile up under
        the hierarchical cache."""
        leaves: list[Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            on_device = [c for c in node.children.values() if c.device_pages is not None]
            if on_device:
                stack.extend(on_device)
            elif node.lock_count == 0 and node is not self.root:
                leaves.append(node)
        return sorted(leaves, key=lambda n: (n.last_access, n.node_id))

    def is_host_leaf(self, node: Node) -> bool:
        """Host-only and no children at all (so removing it orphans nothing)."""
        return (node is not self.root and node.parent is not None and not node.children
                and node.device_pages is None and node.host_pages is not None)

    def host_eviction_candidates(self) -> list[Node]:
        """Host-only leaves, least recently used first."""
        leaves = [n for n in self.nodes() if self.is_host_leaf(n)]
        return sorted(leaves, key=lambda n: (n.last_access, n.node_id))

    def in_tree(self, node: Node) -> bool:
        """Whether `node` is still reachable from the root (not in a removed subtree)."""
        while node is not self.root:
            parent = node.parent
            if parent is None or parent.children.get(node.key[:self.page_size]) is not node:
                return False
            node = parent
        return True
