"""DevicePool: the per-layer K/V page arrays in device memory (HBM); page 0 is a reserved padding
sink.

Also defines `PoolLayout`, the page geometry both tiers share. The pool only holds arrays:
kernels and the transfers read the current arrays, return new ones (donation) and
put them back with `set_layer`, so the pool always holds the newest version of each layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RESERVED_PAGES = 1  # device page 0: padded tokens write there; never handed out, never read


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Geometry of one tier: `num_layers` K and V arrays of [num_pages, page_size, heads,
    head_dim]."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        per_layer = (self.page_size * self.num_kv_heads * self.head_dim
                     * jnp.dtype(self.dtype).itemsize)
        return 2 * self.num_layers * per_layer

    def same_page_shape(self, other: PoolLayout) -> bool:
        """True when pages can be copied between the two tiers (only num_pages may differ)."""
        return dataclasses.replace(other, num_pages=self.num_pages) == self


class PagePool:
    """Per-layer K and V page arrays in one memory kind of one device, or split over a mesh by
    `sharding` (every device then holds its shard of every page, under the same page ids)."""

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None,
                 memory_kind: str = "device",
                 sharding: jax.sharding.Sharding | None = None) -> None:
        self.layout = layout
        self.device = device if device is not None else jax.devices()[0]
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind=memory_kind)
        self.sharding = sharding
        zeros = jax.jit(lambda: jnp.zeros(layout.page_shape, layout.dtype),
                        out_shardings=self.sharding)
        self.k: list[jax.Array] = [zeros() for _ in range(layout.num_layers)]
        self.v: list[jax.Array] = [zeros() for _ in range(layout.num_layers)]
        # The devices holding each shard, in KV-head order: shard i (heads i*h..(i+1)*h) is on
        # shard_devices[i], and the host tier's block i and copier i serve that device.
        self.shard_devices = _shard_devices(self.k[0])
        # An output (never donated) of the newest program that wrote the pool, set by whoever
        # runs it: ready once that program has finished (copies JAX does not see fence on it).
        self.last_compute: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def layer_types(self) -> tuple[tuple[jax.ShapeDtypeStruct, ...], ...]:
        """(K, V) of every layer as ShapeDtypeStructs (shape, dtype, sharding): what a program
        that takes the pages is compiled for, read without touching the buffers."""
        typed = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
        return tuple(map(typed, self.k)), tuple(map(typed, self.v))

    def set_layer(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        """Stores the newest K/V arrays of `layer` (after a kernel donated the old ones)."""
        if k.shape != self.layout.page_shape or v.shape != self.layout.page_shape:
            raise ValueError(f"layer {layer}: shape {k.shape}/{v.shape} != "
                             f"{self.layout.page_shape}")
        self.k[layer], self.v[layer] = k, v

    def update(self, first_layer: int, k: Sequence[jax.Array], v: Sequence[jax.Array],
               compute: jax.Array | None = None) -> None:
        """Stores a program's new K/V arrays of layers `first_layer`.. (it took the pool's
        donated: the pool must hold the newest, which the transfers copy into and out of).
        `compute`: an output of the program (never donated) once it wrote its last layer:
        device pages freed from now on are fenced on it (`last_compute`), so that no load
        copies into a page the program may still write."""
        if len(k) != len(v):
            raise ValueError(f"{len(k)} K arrays but {len(v)} V arrays")
        for layer, (k_layer, v_layer) in enumerate(zip(k, v), first_layer):
            self.set_layer(layer, k_layer, v_layer)
        if compute is not None:
            self.last_compute = compute

    @property
    def num_shards(self) -> int:
        return len(self.shard_devices)

    def shard_pointers(self, array: jax.Array) -> list[int]:
        """Buffer addresses of `array`'s device shards in shard order (one, on one device);
        `array` may be any array split over the pool's devices on its heads, like its pages."""
        if len(self.shard_devices) == 1:
            return [array.unsafe_buffer_pointer()]
        by_device = {s.device: s.data.unsafe_buffer_pointer() for s in array.addressable_shards}
        return [by_device[d] for d in self.shard_devices]

    def misplaced_layers(self) -> list[int]:
        """Layers whose K or V array is not laid out as the pool's sharding says (a program that
        returned it resharded or gathered): what an invariant check reports."""
        ndim = len(self.layout.page_shape)
        return [layer for layer in range(self.num_layers)
                if not all(a.sharding.is_equivalent_to(self.sharding, ndim)
                           for a in (self.k[layer], self.v[layer]))]

    def read_pages(self, layer: int, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Copies `pages` of one layer to numpy (tests and debugging; blocks). Through a gather
        on the device, not `np.asarray` of the pool array: a JAX array keeps what it read first,
        and copies JAX does not see may have changed its buffer since."""
        idx = jnp.asarray(np.asarray(pages, dtype=np.int32))
        return np.asarray(self.k[layer][idx]), np.asarray(self.v[layer][idx])


def _shard_devices(pages: jax.Array) -> tuple[jax.Device, ...]:
    """The devices of a page array's shards, ordered by their first KV head (axis 2). A layout
    that stores some heads on two devices is refused: a page's shards would not be distinct."""
    shards = sorted(pages.addressable_shards, key=lambda s: s.index[2].start or 0)
    starts = [s.index[2].start or 0 for s in shards]
    if len(set(starts)) != len(starts) or len(shards) != len(pages.sharding.device_set):
        raise ValueError("a page pool must be split on its heads, one distinct shard per device: "
                         f"{pages.sharding}")
    return tuple(s.device for s in shards)


class DevicePool(PagePool):
    """The device tier; page 0 is reserved as the padding sink. With tensor parallelism,
    `sharding` splits every layer's pages on the KV-head axis (`layout.num_kv_heads` is then
    the heads of all devices together)."""

    def __init__(self, layout: PoolLayout, device: jax.Device | None = None,
                 sharding: jax.sharding.Sharding | None = None) -> None:
        if layout.num_pages <= RESERVED_PAGES:
            raise ValueError(f"num_pages must be > {RESERVED_PAGES} (device page 0 is reserved)")
        super().__init__(layout, device, memory_kind="device", sharding=sharding)
        # Per layer, the sequence number of the newest load whose pages of that layer have
        # landed (set by the loads' copy stream, read by the attention kernels: `LayerGate`),
        # and a last slot that a kernel sets when it gave up waiting. One copy per device: a
        # device's copies set its own.
        replicated = self.sharding
        if isinstance(replicated, jax.sharding.NamedSharding):
            replicated = jax.sharding.NamedSharding(replicated.mesh, jax.sharding.PartitionSpec())
        self.load_flags = jax.jit(lambda: jnp.zeros((layout.num_layers + 1,), jnp.int32),
                                  out_shardings=replicated)()

    def flag_addresses(self, layer: int) -> np.ndarray:
        """Device addresses of `layer`'s load flag, one per shard in shard order."""
        return np.asarray(self.shard_pointers(self.load_flags), np.uint64) + np.uint64(4 * layer)

    def gate_timeouts(self) -> int:
        """1 if an attention kernel ever stopped waiting for a layer's loads before they landed
        (a bug: it then read pages still being copied), else 0. Reads the device (blocks on the
        compute queued so far); for checks, not for every step."""
        # a copy, because a JAX array caches what it read first, and each device's own
        return max(int(np.asarray(jnp.copy(shard.data))[-1])
                   for shard in self.load_flags.addressable_shards)
