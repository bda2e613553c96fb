"""PageAllocator: the free list of page ids of one tier (device or host); no eviction, no trees."""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """Hands out page ids in `[first_page, num_pages)`; alloc is all-or-nothing, free is FIFO.

    Pages below `first_page` are reserved (page 0 is the padding sink of the pools) and are
    never handed out. Freeing a page that is already free, out of range, or twice in one call
    raises ValueError, so a double free is caught where it happens instead of corrupting a
    later allocation.
    """

    def __init__(self, num_pages: int, first_page: int = 0) -> None:
        if not 0 <= first_page < num_pages:
            raise ValueError(f"need 0 <= first_page < num_pages, got {first_page}, {num_pages}")
        self.num_pages = num_pages
        self.first_page = first_page
        self._free: deque[int] = deque(range(first_page, num_pages))
        self._free_set: set[int] = set(self._free)

    @property
    def capacity(self) -> int:
        """Number of pages this allocator can hand out (reserved pages excluded)."""
        return self.num_pages - self.first_page

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Takes `n` pages from the front of the free list, or None (nothing taken) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns `pages` to the end of the free list; validates all before changing anything."""
        seen: set[int] = set()
        for page in pages:
            if not self.first_page <= page < self.num_pages:
                raise ValueError(f"page {page} is outside [{self.first_page}, {self.num_pages})")
            if page in self._free_set or page in seen:
                raise ValueError(f"double free of page {page}")
            seen.add(page)
        self._free.extend(pages)
        self._free_set.update(pages)

    def free_pages(self) -> set[int]:
        """A copy of the free page ids (for invariant checks)."""
        return set(self._free_set)
