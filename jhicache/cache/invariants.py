"""check_invariants: page ownership and accounting of both tiers, plus the tree's structural rules.

Every usable page id of a tier must be owned exactly once: by the free list, by one tree node,
or by a caller-declared holder (pages of running requests). In-flight transfers own no page of
their own: a copy's pages stay owned by the node they belong to (see transfers.py for why freeing
them after dispatch is safe). Device accounting must satisfy
`free + evictable + protected + held by requests == capacity`.
"""

from __future__ import annotations

from collections.abc import Iterable

from jhicache.cache.pages import PageAllocator
from jhicache.cache.radix_tree import Node, RadixTree


class InvariantError(AssertionError):
    """A cache invariant does not hold; the message names the page or node."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)


def _check_tier(name: str, alloc: PageAllocator, owners: dict[str, list[int]]) -> None:
    seen: dict[int, str] = {p: "free list" for p in alloc.free_pages()}
    for owner, pages in owners.items():
        for page in pages:
            _check(alloc.first_page <= page < alloc.num_pages,
                   f"{name} page {page} of {owner} out of range")
            _check(page not in seen,
                   f"{name} page {page} owned twice: {seen.get(page)} and {owner}")
            seen[page] = owner
    missing = set(range(alloc.first_page, alloc.num_pages)) - seen.keys()
    _check(not missing, f"{name} pages leaked (no owner): {sorted(missing)[:10]}")


def _check_node(tree: RadixTree, node: Node) -> None:
    n_pages = len(node.key) // tree.page_size
    _check(len(node.key) > 0 and len(node.key) % tree.page_size == 0, f"unaligned key in {node}")
    _check(node.device_pages is not None or node.host_pages is not None,
           f"node with no pages: {node}")
    for pages in (node.device_pages, node.host_pages):
        _check(pages is None or len(pages) == n_pages, f"page count != key pages in {node}")
    parent = node.parent
    _check(parent is not None and parent.children.get(node.key[:tree.page_size]) is node,
           f"broken parent link: {node}")
    assert parent is not None
    if node.device_pages is not None:
        _check(parent.device_pages is not None, f"on-device node under a host-only parent: {node}")
    _check(node.lock_count >= 0, f"negative lock count: {node}")
    _check(node.lock_count == 0 or node.device_pages is not None,
           f"locked node not on device: {node}")
    _check(parent is tree.root or parent.lock_count >= node.lock_count,
           f"lock not on ancestors: {node}")


def check_invariants(tree: RadixTree, device_alloc: PageAllocator, host_alloc: PageAllocator | None,
                     extra_device_pages: Iterable[int] = (),
                     extra_host_pages: Iterable[int] = ()) -> None:
    """Raises InvariantError on the first violated invariant."""
    device: dict[str, list[int]] = {"requests": list(extra_device_pages)}
    host: dict[str, list[int]] = {"requests": list(extra_host_pages)}
    evictable = protected = host_only = 0
    for node in tree.nodes():
        _check_node(tree, node)
        if node.device_pages is not None:
            device[f"node {node.node_id}"] = node.device_pages
            if node.lock_count:
                protected += len(node.device_pages)
            else:
                evictable += len(node.device_pages)
        else:
            host_only += len(node.host_pages or ())
        if node.host_pages is not None:
            host[f"node {node.node_id}"] = node.host_pages
    _check((evictable, protected) == (tree.evictable_pages, tree.protected_pages),
           f"tree counters evictable/protected {tree.evictable_pages}/{tree.protected_pages} "
           f"!= recomputed {evictable}/{protected}")
    _check(tree.host_only_pages == host_only,
           f"tree counter host_only_pages {tree.host_only_pages} != recomputed {host_only}")
    _check_tier("device", device_alloc, device)
    held = len(device["requests"])
    _check(device_alloc.num_free + evictable + protected + held == device_alloc.capacity,
           f"device: free {device_alloc.num_free} + evictable {evictable} + protected {protected} "
           f"+ requests {held} != capacity {device_alloc.capacity}")
    if host_alloc is not None:
        _check_tier("host", host_alloc, host)
    else:
        _check(len(host) == 1 and not host["requests"], "host pages without a host tier")
