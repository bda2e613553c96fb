"""Shape buckets: the padded sizes that bound how many programs compile."""

from __future__ import annotations


def pow2_bucket(n: int, smallest: int = 16) -> int:
    """The power of two >= max(n, smallest) (for a power-of-two `smallest`): sizes padded up to
    it take O(log n) distinct shapes, so a jitted program compiles once per bucket, not per n."""
    size = smallest
    while size < n:
        size *= 2
    return size
