"""HostPool: the host tier's K/V pages, in one host allocation per device shard made (and pinned)
at start.

Layout of each shard's block [layer, K|V, page, page_size, heads / shards, head_dim]: one layer's
K (or V) of one page of one shard is a contiguous `layer_page_bytes` block, the unit a copy
moves, and a layer's consecutive host pages are adjacent, so a load or write-back copies each
run of them as one piece (the layer-wise load's copies stay few; a page's bytes are not
contiguous, which the storage tier pays for with a copy). With tensor parallelism the pool is
split on the KV-head axis exactly as the device pool is: block i holds the heads of device
shard i (replicated KV heads are stored once per device, as the device pool stores them), so a
shard's bytes only ever move between one device and one block. Unlike the device tier, no
host page is reserved: every host page id is usable.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jhicache.cache.cuda_driver import CudaDriver
from jhicache.cache.device_pool import PoolLayout
from jhicache.cache.host_memory import HostMemory


class HostPool:
    """`layout.num_pages` host pages (`layout.num_kv_heads` heads over all `shards` together),
    one block per shard; block i pinned by `drivers[i]` when drivers are given (on a GPU).

    Why a block per device rather than one allocation cut up: each is pinned through its own
    device's context, and a block is the natural unit to place near its GPU's NUMA node."""

    def __init__(self, layout: PoolLayout, drivers: Sequence[CudaDriver] = (),
                 shards: int = 1) -> None:
        if shards < 1 or layout.num_kv_heads % shards:
            raise ValueError(f"shards={shards} must divide num_kv_heads={layout.num_kv_heads}")
        if drivers and len(drivers) != shards:
            raise ValueError(f"{len(drivers)} drivers for {shards} shards")
        self.layout, self.shards = layout, shards
        self.layer_page_bytes = layout.page_bytes // (2 * layout.num_layers) // shards
        block_bytes = layout.page_bytes // shards * layout.num_pages
        self.blocks = [HostMemory(block_bytes, drivers[i] if drivers else None)
                       for i in range(shards)]
        self.base = np.asarray([b.address for b in self.blocks], np.uint64)[:, None]  # [shards, 1]

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def pinned(self) -> bool:
        return all(b.pinned for b in self.blocks)

    def layer_addresses(self, pages: np.ndarray) -> np.ndarray:
        """[shards, layers, 2 * len(pages)] uint64 addresses of `pages` of every layer's K, then
        of its V."""
        blocks = np.arange(2 * self.num_layers, dtype=np.uint64).reshape(-1, 2, 1)
        offsets = self._offsets(blocks, pages)  # [layers, K|V, pages]
        return self.base[:, :, None] + offsets.reshape(self.num_layers, -1)

    def _offsets(self, blocks: np.ndarray, pages: np.ndarray) -> np.ndarray:
        block = blocks * np.uint64(self.layout.num_pages)
        return (block + pages.astype(np.uint64)) * np.uint64(self.layer_page_bytes)

    def view(self) -> np.ndarray:
        """The pool as a [layers, 2, pages, page_size, heads, head_dim] array (tests, debugging):
        a view for one shard, the shards' heads concatenated (a copy) for several."""
        layers, pages, size, heads, dim = (self.num_layers, self.layout.num_pages,
                                           self.layout.page_size, self.layout.num_kv_heads,
                                           self.layout.head_dim)
        dtype = jnp.dtype(self.layout.dtype)
        views = [b.array.view(dtype).reshape(layers, 2, pages, size, heads // self.shards, dim)
                 for b in self.blocks]
        return views[0] if self.shards == 1 else np.concatenate(views, axis=4)

    def page_views(self, page: int) -> list[np.ndarray]:
        """Writable views of one page's bytes, in the order a stored page keeps them (each
        view's, row by row): one per shard, [2 * layers, layer_page_bytes], each layer's K then
        V. Strided, so that a copy of a page into or out of a buffer is one numpy call per
        shard, which lets go of the interpreter lock while it copies."""
        if not 0 <= page < self.layout.num_pages:
            raise ValueError(f"host page {page} out of range [0, {self.layout.num_pages})")
        rows = 2 * self.num_layers
        return [b.array.reshape(rows, self.layout.num_pages, -1)[:, page] for b in self.blocks]

    def read_pages(self, layer: int, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Copies of `pages` of one layer's K and V (only meaningful once their writes are done)."""
        idx = np.asarray(pages, dtype=np.int64)
        view = self.view()
        return view[layer, 0, idx].copy(), view[layer, 1, idx].copy()

    def close(self) -> None:
        for block in self.blocks:
            block.close()
