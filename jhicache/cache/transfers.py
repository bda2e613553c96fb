"""Transfers: the page copies between a device pool and a host pool, both directions, and the
ordering between them.

Copies run on streams of their own (`jhicache.cache.copier`), beside the forward; JAX does not
see them, so they are ordered by hand:
- A device page freed while dispatched compute may still write it (the in-flight step of a
  request that just finished, or a write-back's gather not yet run) is *fenced* with an array
  of that compute (`fence_device_pages`): no load copies into it until the array is ready.
- A load reading host pages whose write-back is still staged waits for that write to be
  queued, then starts after it; a write-back into host pages starts after every load already
  queued (a freed host page may still be read by one).
- The pool arrays keep their buffers (every program donates them, in place): loads copy into
  addresses read once, and `flush` checks that they are still the pool's.

Tensor parallelism: the pool arrays are split over devices on the KV heads, so a page's layer is
one block per device shard. Every copy moves all shards of its pages (shard i between device i's
buffer and the host pool's block i, on copier i of a `ShardedCopier`), the write-back's gather
keeps the pool's head split (its staging is per device too), and a mark is done only once every
device's part is: a layer has landed when all its shards have. One device is the same code with
one shard, on a plain copier.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jhicache.cache.copier import Copier, Mark, ShardedCopier
from jhicache.cache.device_pool import DevicePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.load_back import LoadBacks
from jhicache.cache.ticket import LoadTicket
from jhicache.cache.transfer_op import TransferKind, TransferOp, timed_s
from jhicache.cache.write_back import WriteBacks
from jhicache.config import TransferTuning


class Transfers:
    """Queues, launches and retires write-backs and load-backs between two pools."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier,
                 tuning: TransferTuning = TransferTuning()) -> None:
        if not device_pool.layout.same_page_shape(host_pool.layout):
            raise ValueError(f"page layouts differ: {device_pool.layout} vs {host_pool.layout}")
        shards = device_pool.num_shards
        if host_pool.shards != shards:
            raise ValueError(f"host pool has {host_pool.shards} shards, the device pool {shards}")
        if shards > 1 and not (isinstance(copier, ShardedCopier) and len(copier.copiers) == shards):
            raise ValueError(f"{shards} device shards need a ShardedCopier of {shards} copiers, "
                             f"got {copier}")
        self.device_pool, self.copier = device_pool, copier
        self.writes = WriteBacks(device_pool, host_pool, copier, tuning, self._loads_queued)
        self.loads = LoadBacks(device_pool, host_pool, copier, tuning, self.writes)
        self._next_id = 0
        self.counters = {f"{kind.value}_{what}": 0 for kind in TransferKind
                         for what in ("ops", "pages", "launches")}

    @property
    def tuning(self) -> TransferTuning:
        return self.writes.tuning

    @tuning.setter
    def tuning(self, tuning: TransferTuning) -> None:
        self.writes.tuning = self.loads.tuning = tuning

    def _loads_queued(self) -> Mark | None:
        return self.loads.finish()

    # -- queueing ------------------------------------------------------------------------------

    def _op(self, kind: TransferKind, device_pages: Sequence[int], host_pages: Sequence[int],
            ticket: LoadTicket | None = None) -> TransferOp:
        if len(device_pages) != len(host_pages) or not device_pages:
            raise ValueError("need equal, non-empty page lists: "
                             f"{len(device_pages)} vs {len(host_pages)}")
        op = TransferOp(self._next_id, kind, tuple(device_pages), tuple(host_pages), ticket)
        self._next_id += 1
        return op

    def queue_write_back(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Queues a device->host copy; returns its op id."""
        op = self._op(TransferKind.WRITE_BACK, device_pages, host_pages)
        self.writes.queued.append(op)
        return op.op_id

    def queue_load_back(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadTicket:
        """Queues a host->device copy; the ticket becomes waitable once launched."""
        ticket = LoadTicket(self._next_id, self.device_pool.num_layers, host_pages, device_pages)
        self.loads.queued.append(self._op(TransferKind.LOAD_BACK, device_pages, host_pages,
                                          ticket))
        return ticket

    def fence_device_pages(self, pages: Sequence[int], computes: Sequence[jax.Array]) -> None:
        """No load copies into `pages` before each of `computes` is ready."""
        self.loads.fence(pages, computes)

    # -- launching -----------------------------------------------------------------------------

    def launch_writes(self) -> None:
        """Dispatches the gathers of every queued write-back (before their pages leave the
        tree: a later compute that reuses a page is then ordered after the gather)."""
        self._count(TransferKind.WRITE_BACK, self.writes.launch())

    def launch_loads(self, first_layers: int | None = None) -> None:
        """Starts every queued load-back (see `LoadBacks.launch`)."""
        self._count(TransferKind.LOAD_BACK, self.loads.launch(first_layers))

    def launch(self) -> None:
        """Starts everything queued: write-backs first, then load-backs."""
        self.launch_writes()
        self.launch_loads()

    def _count(self, kind: TransferKind, ops: list[TransferOp]) -> None:
        if ops:
            self.counters[f"{kind.value}_ops"] += len(ops)
            self.counters[f"{kind.value}_pages"] += sum(len(op.device_pages) for op in ops)
            self.counters[f"{kind.value}_launches"] += 1

    # -- completion ----------------------------------------------------------------------------

    def poll(self) -> list[TransferOp]:
        """Non-blocking: starts what is no longer held back; returns the ops now complete."""
        self.loads.finish()
        self.loads.retry()
        self.writes.advance()
        timed = lambda start, end: timed_s(self.copier, start, end)  # noqa: E731
        return self.writes.retire_done(timed) + self.loads.retire_done(timed)

    def flush(self) -> list[TransferOp]:
        """Launches everything queued and blocks until every copy has finished."""
        self.launch()
        self.loads.finish()
        self.writes.flush()
        self.loads.wait_all()
        jax.block_until_ready((self.device_pool.k, self.device_pool.v))
        self.loads.check_buffers()
        return self.poll()

    def seconds(self) -> tuple[float, float]:
        """(write-back, load-back) seconds: per launch, its first copy's start to its last
        copy's end, by the copier's timed marks (device-side events on a GPU), summed."""
        return self.writes.seconds, self.loads.seconds
