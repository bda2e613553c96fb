"""HostPool: the per-layer K/V page arrays in pinned host memory, same page layout as the device;
also `TransferPath`, the choice between this paged host tier and the segmented one.

Unlike the device tier, no host page is reserved: every host page id is usable.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

from jhicache.cache.device_pool import PagePool, PoolLayout
from jhicache.config import TransferPath


class HostPool(PagePool):
    """The host tier: `memory_kind="pinned_host"` arrays (never pageable numpy: 6x slower H2D)."""

    transfer_path = TransferPath.PAGES

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None) -> None:
        super().__init__(layout, device, memory_kind="pinned_host")

    def release(self, pages: Iterable[int]) -> None:
        """Host pages returned to the allocator: nothing to do, the arrays are preallocated."""

    def check_invariants(self, allocated: set[int], queued: Iterable[int]) -> None:
        """Nothing beyond the allocator's accounting (see `HostSegmentPool`)."""
