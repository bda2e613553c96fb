"""HostPool: the per-layer K/V page arrays in pinned host memory, same page layout as the device;
also `TransferPath`, the choice between this paged host tier and the segmented one.

Unlike the device tier, no host page is reserved: every host page id is usable.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import jax

from jhicache.cache.device_pool import PagePool, PoolLayout


class TransferPath(enum.Enum):
    """How the host tier is laid out and how pages move between the tiers."""

    # One preallocated [pages, S, H, D] pinned_host array per layer and K/V; Pallas kernels read
    # and write it in place (zero-copy) on the compute stream: simple, but loads are not hidden.
    PAGES = "pages"
    # Per write-back launch, one [2, n, S, H, D] pinned_host array per layer (a "segment"); loads
    # are copy-engine DMAs of whole segments plus an on-device scatter, overlapping the forward.
    SEGMENTS = "segments"


class HostPool(PagePool):
    """The host tier: `memory_kind="pinned_host"` arrays (never pageable numpy: 6x slower H2D)."""

    transfer_path = TransferPath.PAGES

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None) -> None:
        super().__init__(layout, device, memory_kind="pinned_host")

    def release(self, pages: Iterable[int]) -> None:
        """Host pages returned to the allocator: nothing to do, the arrays are preallocated."""

    def check_invariants(self, allocated: set[int], queued: Iterable[int]) -> None:
        """Nothing beyond the allocator's accounting (see `HostSegmentPool`)."""
