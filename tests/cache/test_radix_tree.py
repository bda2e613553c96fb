"""RadixTree on its own (pure Python): matching, splitting both tiers, adoption, locks,
candidates."""

from __future__ import annotations

import pytest

from jhicache.cache import RadixTree


def _host_only(tree: RadixTree, tokens: list[int], host_pages: list[int]) -> None:
    """Inserts `tokens` then turns the deepest node host-only (as a write-back eviction would)."""
    res = tree.insert(tokens, [100 + i for i in range(len(tokens) // tree.page_size)])
    node = res.last_node
    node.host_pages = host_pages
    tree.detach_device_pages(node)


@pytest.mark.parametrize(("page", "length", "want"), [(1, 5, 5), (2, 5, 4), (4, 6, 4)])
def test_match_lengths_are_page_aligned(page: int, length: int, want: int) -> None:
    tree = RadixTree(page)
    tokens = list(range(8))
    tree.insert(tokens, list(range(8 // page)))
    n = length - length % page
    assert tree.match(tokens[:n]).device_len == want


def test_unaligned_keys_raise() -> None:
    tree = RadixTree(4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        tree.insert([1, 2, 3], [1])
    with pytest.raises(ValueError, match="multiple of page_size"):
        tree.match([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="do not cover"):
        tree.insert([1, 2, 3, 4], [1, 2])


def test_host_only_split_keeps_both_halves() -> None:
    tree = RadixTree(2)
    tree.insert([1, 2], [1])
    _host_only(tree, [1, 2, 3, 4, 5, 6], [7, 8])  # node [3..6] host-only, host pages 7, 8
    m = tree.match([1, 2, 3, 4, 9, 9])
    assert (m.device_len, m.host_len, m.device_pages) == (2, 2, [1])
    upper = m.last_node
    assert upper.device_pages is None and upper.host_pages == [7]
    (lower,) = upper.children.values()
    assert lower.device_pages is None and lower.host_pages == [8] and lower.key == (5, 6)


def test_split_of_device_and_host_node_splits_both_tiers() -> None:
    tree = RadixTree(1)
    node = tree.insert([1, 2, 3], [4, 5, 6]).last_node
    node.host_pages = [7, 8, 9]
    m = tree.match([1, 2])
    assert m.last_node.device_pages == [4, 5] and m.last_node.host_pages == [7, 8]
    (child,) = m.last_node.children.values()
    assert child.device_pages == [6] and child.host_pages == [9]


def test_insert_over_host_only_adopts_and_excludes_adopted_from_prefix() -> None:
    tree = RadixTree(2)
    tree.insert([1, 2], [1])
    _host_only(tree, [1, 2, 3, 4], [9])
    res = tree.insert([1, 2, 3, 4, 5, 6], [50, 51, 52])
    assert res.prefix_len == 2  # only [1, 2] was on device; [3, 4] adopted; [5, 6] new
    assert res.adopted_len == 2
    m = tree.match([1, 2, 3, 4, 5, 6])
    assert m.device_pages == [1, 51, 52] and m.host_len == 0
    adopted = m.last_node.parent
    assert adopted is not None and adopted.host_pages == [9]  # host copy kept


def test_lock_accounting_and_unlock_below_zero() -> None:
    tree = RadixTree(1)
    leaf = tree.insert([1, 2, 3], [1, 2, 3]).last_node
    tree.insert([1, 2, 4], [1, 2, 4])  # splits [1,2] off; 4 pages in the tree
    assert (tree.evictable_pages, tree.protected_pages) == (4, 0)
    tree.lock(leaf)
    tree.lock(leaf)
    assert (tree.evictable_pages, tree.protected_pages) == (1, 3)
    tree.unlock(leaf)
    tree.unlock(leaf)
    assert (tree.evictable_pages, tree.protected_pages) == (4, 0)
    with pytest.raises(ValueError, match="below zero"):
        tree.unlock(leaf)
    assert (tree.evictable_pages, tree.protected_pages) == (4, 0)


def test_lock_of_host_only_node_raises() -> None:
    tree = RadixTree(1)
    tree.insert([1], [1])
    _host_only(tree, [1, 2], [5])
    with pytest.raises(ValueError, match="not on device"):
        tree.lock(tree.match([1, 2]).last_node)


def test_eviction_candidates() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [1, 2])
    _host_only(tree, [1, 2, 3], [7])
    tree.insert([1, 5], [1, 5])
    device = tree.device_eviction_candidates()
    # [2] is a device leaf (its only child is host-only), [5] too; [1] has device children.
    assert sorted(n.key for n in device) == [(2,), (5,)]
    assert [n.key for n in tree.host_eviction_candidates()] == [(3,)]
    tree.lock(tree.match([1, 5]).last_node)
    assert [n.key for n in tree.device_eviction_candidates()] == [(2,)]


def test_host_only_pages_follow_every_residency_change() -> None:
    """The counter the host tier reads on each short allocation, against a recount after each
    change: a write-back eviction, a split, a load back, a host insert and removals."""
    tree = RadixTree(2)

    def recount() -> int:
        return sum(len(n.host_pages or ()) for n in tree.nodes() if n.device_pages is None)

    tree.insert([1, 2], [1])
    _host_only(tree, [1, 2, 3, 4, 5, 6], [7, 8])
    assert tree.host_only_pages == recount() == 2
    upper = tree.match([1, 2, 3, 4]).last_node  # a split: both halves host-only
    assert tree.host_only_pages == recount() == 2
    tree.attach_device_pages(upper, [20])  # loaded back
    assert tree.host_only_pages == recount() == 1
    assert tree.insert_host([1, 2, 3, 4, 9, 9, 9, 9], [30, 31], 2) == []
    assert tree.host_only_pages == recount() == 3
    (lower,) = (c for c in upper.children.values() if c.key == (5, 6))
    tree.remove_subtree(lower)
    assert tree.host_only_pages == recount() == 2
    tree.clear()
    assert tree.host_only_pages == recount() == 0


def test_in_tree_is_false_below_a_removed_node() -> None:
    tree = RadixTree(2)
    tree.insert([1, 2], [1])
    _host_only(tree, [1, 2, 3, 4, 5, 6], [7, 8])
    upper = tree.match([1, 2, 3, 4]).last_node
    (lower,) = upper.children.values()
    assert tree.in_tree(upper) and tree.in_tree(lower)
    tree.remove_subtree(upper)
    assert not tree.in_tree(upper) and not tree.in_tree(lower)
