"""CacheTiers: a prefix cache with the device pool, host pool and transfers under it, built in
one call (`CacheTiers.build`): what an engine holds of the cache, ours or one with its own model
and loop.

An engine that is not ours drives the cache as SGLang's scheduler drives its radix cache, or
vLLM's its KV-cache manager, through `PrefixCache`'s calls; page ids are the currency. Per
request, inside the step that admits it (`with cache.step() as step:`, which retires finished
copies on entry and starts the queued write-backs and loads on exit):
  1. `match = cache.match(tokens, leave_last=True)`; `cache.lock(match.last_device_node)`;
  2. `ticket = cache.load_back(match)`: with a ticket, the host run is on device pages now
     (`ticket.device_pages`, after `match.device_pages`): lock `match.last_node` instead;
  3. `cache.alloc_device(n)` for the pages to compute into (it may evict, writing back);
  4. `gate = step.start_loads([*match.loading, ticket])`, then the forward over
     `device_pool.k` / `.v` with `load_flags=device_pool.load_flags, load_seq=[gate]` in its
     attention metadata (each layer waits on the device for its pages), and
     `device_pool.update(0, new_k, new_v, compute=logits)`;
and once it is done, `cache.insert` its computed full pages, `cache.free_device` the
duplicates `insert` names and the rest, and unlock its node. `examples/own_loop.py` is such a
loop, whole; `jhicache.scheduler` is ours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jhicache.cache.copier import make_copier
from jhicache.cache.device_pool import DevicePool, PoolLayout
from jhicache.cache.fetches import FetchRule
from jhicache.cache.host_pool import HostPool
from jhicache.cache.prefix_cache import PrefixCache
from jhicache.cache.storage import Storage
from jhicache.cache.transfers import Transfers
from jhicache.config import StorageWritePolicy, TransferTuning, WritePolicy


@dataclasses.dataclass(frozen=True)
class CacheTiers:
    """The prefix cache, the device pool a forward reads and writes (its K/V arrays per layer,
    its load flags), and, with a host tier, the host pool and the transfers between the two."""

    cache: PrefixCache
    device_pool: DevicePool
    host_pool: HostPool | None = None
    transfers: Transfers | None = None

    @classmethod
    def build(cls, layout: PoolLayout, host_pages: int = 0, *,
              sharding: jax.sharding.Sharding | None = None,
              policy: WritePolicy | str = WritePolicy.WRITE_BACK, load_back_threshold: int = 10,
              write_through_threshold: int = 2, tuning: TransferTuning = TransferTuning(),
              storage: Callable[[HostPool], Storage] | None = None, storage_io_threads: int = 8,
              storage_policy: StorageWritePolicy | str = StorageWritePolicy.WRITE_THROUGH,
              fetch_rule: FetchRule = FetchRule()) -> CacheTiers:
        """The device pool of `layout` (page 0 reserved; split on its KV heads by `sharding`,
        e.g. a tensor-parallel mesh's), with `host_pages` > 0 a host pool of that many pages
        (allocated and, on a GPU, pinned now, one block per device shard) and the copier of the
        devices' platform, and the prefix cache over them. `storage` makes a storage tier's
        backend over the host pool (`jhicache.cache.storage`). The rest are `PrefixCache`'s."""
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        if storage is not None and not host_pages:
            raise ValueError("a storage tier needs the host tier (host_pages > 0)")
        device_pool = DevicePool(layout, sharding=sharding)
        host_pool, transfers, backend = None, None, None
        if host_pages:
            # One host block and one copier per device shard, in the pool's shard order
            devices = device_pool.shard_devices
            copier, drivers = make_copier(devices[0].platform, [_ordinal(d) for d in devices])
            host_pool = HostPool(dataclasses.replace(layout, num_pages=host_pages), drivers,
                                 shards=len(devices))
            transfers = Transfers(device_pool, host_pool, copier, tuning)
            backend = None if storage is None else storage(host_pool)
        cache = PrefixCache(layout.page_size, device_pool, host_pool, policy, load_back_threshold,
                            write_through_threshold, transfers, backend, storage_io_threads,
                            storage_policy, fetch_rule)
        return cls(cache, device_pool, host_pool, transfers)


def _ordinal(device: jax.Device) -> int:
    """The device's index among the process's visible devices (its CUDA ordinal on a GPU)."""
    hardware = getattr(device, "local_hardware_id", None)
    return device.id if hardware is None else hardware
