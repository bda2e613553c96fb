"""PageAllocator: all-or-nothing alloc, FIFO reuse, double-free and range detection."""

from __future__ import annotations

import pytest

from jhicache.cache import PageAllocator


def test_alloc_is_all_or_nothing_and_skips_reserved() -> None:
    alloc = PageAllocator(5, first_page=1)
    assert alloc.capacity == 4
    assert alloc.alloc(5) is None and alloc.num_free == 4
    pages = alloc.alloc(3)
    assert pages == [1, 2, 3] and alloc.num_free == 1
    alloc.free(pages)
    assert alloc.alloc(4) == [4, 1, 2, 3]  # FIFO: freed pages go to the back


@pytest.mark.parametrize("bad", [[0], [5], [1, 1]])
def test_free_rejects_reserved_out_of_range_and_repeats(bad: list[int]) -> None:
    alloc = PageAllocator(5, first_page=1)
    alloc.alloc(4)
    with pytest.raises(ValueError):
        alloc.free(bad)
    assert alloc.num_free == 0  # nothing changed


def test_double_free_raises() -> None:
    alloc = PageAllocator(3)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])


def test_bad_construction_and_negative_alloc() -> None:
    with pytest.raises(ValueError):
        PageAllocator(2, first_page=2)
    with pytest.raises(ValueError):
        PageAllocator(2).alloc(-1)
