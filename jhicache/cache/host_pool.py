"""HostPool: the per-layer K/V page arrays in pinned host memory, same page layout as the device.

Unlike the device tier, no host page is reserved: every host page id is usable.
"""

from __future__ import annotations

import jax

from jhicache.cache.device_pool import PagePool, PoolLayout


class HostPool(PagePool):
    """The host tier: `memory_kind="pinned_host"` arrays (never pageable numpy: 6x slower H2D)."""

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None) -> None:
        super().__init__(layout, device, memory_kind="pinned_host")
