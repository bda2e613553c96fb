"""HostSegmentPool: the segmented host tier: which (segment, row) holds each host page, and when a
segment's pinned_host arrays may be dropped.

A segment is what one write-back launch produced: per layer one `[2, rows, S, H, D]` pinned_host
array (K then V), written once by a device->host DMA and never modified, so reads need no
ordering against later writes. Host page ids still come from the cache's host PageAllocator
(capacity is counted in pages); this pool maps each allocated page id to its (segment, row) and
counts, per segment, the pages still mapped to it; when that count reaches zero the pool drops
the segment (a load already launched keeps its own references, so in-flight DMAs stay valid).
A node split only partitions page-id lists, so it needs nothing from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jhicache.cache.device_pool import PoolLayout
from jhicache.cache.host_pool import HostPool
from jhicache.cache.invariants import InvariantError
from jhicache.config import TransferPath


class Segment:
    """One write-back launch's host arrays; `live` = host pages still mapped to it."""

    def __init__(self, seg_id: int, layers: list[jax.Array], live: int) -> None:
        self.seg_id, self.layers, self.live = seg_id, layers, live

    def __repr__(self) -> str:
        return f"Segment({self.seg_id}, rows={self.layers[0].shape[1]}, live={self.live})"


class HostSegmentPool:
    """Host tier of the segments path (see module doc); no memory is allocated up front."""

    transfer_path = TransferPath.SEGMENTS

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None) -> None:
        self.layout = layout
        self.device = device if device is not None else jax.devices()[0]
        self.sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        self._where: dict[int, tuple[Segment, int]] = {}  # host page id -> (segment, row)
        self._segments: dict[int, Segment] = {}  # live segments by id
        self._next_id = 0

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def add_segment(self, layers: list[jax.Array], host_pages: Sequence[int]) -> Segment:
        """Maps `host_pages[i]` to row i of the new segment (rows past them are padding)."""
        taken = [p for p in host_pages if p in self._where]
        if taken or len(set(host_pages)) != len(host_pages):
            raise ValueError(f"host pages mapped twice: {taken or sorted(host_pages)}")
        segment = Segment(self._next_id, layers, len(host_pages))
        self._next_id += 1
        self._segments[segment.seg_id] = segment
        self._where.update((page, (segment, row)) for row, page in enumerate(host_pages))
        return segment

    def locate(self, host_pages: Iterable[int]) -> list[tuple[Segment, int]]:
        """(segment, row) of each page; KeyError for a page with no data on host."""
        return [self._where[p] for p in host_pages]

    def release(self, pages: Iterable[int]) -> None:
        """Unmaps freed host pages; drops segments left without pages."""
        for page in pages:
            segment, _ = self._where.pop(page)
            segment.live -= 1
            if segment.live == 0:
                del self._segments[segment.seg_id]

    def read_pages(self, layer: int, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Copies `pages` of one layer to numpy (tests and debugging; blocks)."""
        rows = [np.asarray(seg.layers[layer][:, row]) for seg, row in self.locate(pages)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def check_invariants(self, allocated: set[int], queued: Iterable[int]) -> None:
        """Segment refcounts: each live segment has >= 1 page and counts its pages exactly; no
        page maps to a dropped segment; mapped pages are allocated; allocated pages are mapped or
        await a queued write-back."""
        counts: dict[int, int] = {}
        for page, (segment, _) in self._where.items():
            if self._segments.get(segment.seg_id) is not segment:
                raise InvariantError(f"host page {page} maps to dropped {segment}")
            if page not in allocated:
                raise InvariantError(f"free host page {page} still maps to {segment}")
            counts[segment.seg_id] = counts.get(segment.seg_id, 0) + 1
        for seg_id, segment in self._segments.items():
            if segment.live < 1 or counts.get(seg_id, 0) != segment.live:
                raise InvariantError(f"{segment}: refcount != {counts.get(seg_id, 0)} mapped pages")
        missing = allocated - self._where.keys() - set(queued)
        if missing:
            raise InvariantError(f"allocated host pages with no data and no queued write: {sorted(missing)[:10]}")


def make_host_pool(layout: PoolLayout, path: TransferPath | str,
                   device: jax.Device | None = None) -> HostPool | HostSegmentPool:
    """The host tier for `path`; the cache picks its transfer controller from the pool's type."""
    if TransferPath(path) is TransferPath.SEGMENTS:
        return HostSegmentPool(layout, device)
    return HostPool(layout, device)
