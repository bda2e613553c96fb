"""HostPool: the host tier's K/V pages, in one host allocation made (and pinned) at start.

Layout [layer, K|V, page, page_size, heads, head_dim]: one layer's K (or V) of one page is a
contiguous `layer_page_bytes` block, the unit a copy moves. Unlike the device tier, no host page
is reserved: every host page id is usable.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jhicache.cache.cuda_driver import CudaDriver
from jhicache.cache.device_pool import PoolLayout
from jhicache.cache.host_memory import HostMemory


class HostPool:
    """`layout.num_pages` host pages; pinned when given the driver (on a GPU)."""

    def __init__(self, layout: PoolLayout, driver: CudaDriver | None = None) -> None:
        self.layout = layout
        self.layer_page_bytes = layout.page_bytes // (2 * layout.num_layers)
        self.memory = HostMemory(layout.page_bytes * layout.num_pages, driver)
        self.address = self.memory.address

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def addresses(self, layer: int, kv: int, pages: np.ndarray) -> np.ndarray:
        """uint64 addresses of `pages` (int array) of one layer's K (kv=0) or V (kv=1)."""
        return self.addresses_at(np.uint64(layer * 2 + kv), pages)

    def layer_addresses(self, kv: int, pages: np.ndarray) -> np.ndarray:
        """[layers, len(pages)] uint64 addresses of `pages` of every layer's K (kv=0) or V."""
        layers = np.arange(self.num_layers, dtype=np.uint64)[:, None]
        return self.addresses_at(layers * 2 + kv, pages)

    def addresses_at(self, blocks: np.ndarray, pages: np.ndarray) -> np.ndarray:
        block = blocks * np.uint64(self.layout.num_pages)
        return self.address + (block + pages.astype(np.uint64)) * np.uint64(self.layer_page_bytes)

    def view(self) -> np.ndarray:
        """The pool as a [layers, 2, pages, page_size, heads, head_dim] array (tests, debugging)."""
        shape = (self.num_layers, 2) + self.layout.page_shape
        return self.memory.array.view(jnp.dtype(self.layout.dtype)).reshape(shape)

    def read_pages(self, layer: int, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Copies of `pages` of one layer's K and V (only meaningful once their writes are done)."""
        idx = np.asarray(pages, dtype=np.int64)
        view = self.view()
        return view[layer, 0, idx].copy(), view[layer, 1, idx].copy()

    def close(self) -> None:
        self.memory.close()
