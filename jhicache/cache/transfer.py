"""TransferController: queues write-backs (device->host) and load-backs (host->device), merges each
kind into one launch, and reports completion per operation. This module owns the queueing shared
by both transfer paths and the pages path (zero-copy kernels over a paged host pool); the
segments path (DMA of whole host arrays) is `segment_transfer.SegmentTransferController`.

Who does what, in which order (pages path)
------------------------------------------
| phase            | thread           | device work                                   |
|------------------|------------------|-----------------------------------------------|
| queue_*          | scheduler thread | none (page id lists only)                     |
| launch_writes    | scheduler thread | per layer: write_back_pages(device -> host),  |
|                  |                  | host arrays donated, dispatched asynchronously |
| launch_loads     | scheduler thread | per layer: load_pages(host -> device), device |
|                  |                  | arrays donated, dispatched asynchronously     |
| forward          | scheduler thread | kernels that read / donate the device arrays  |
| poll             | scheduler thread | none: non-blocking `is_ready` on the outputs  |
`launch()` always dispatches writes before loads. On GPU the copies are Pallas kernels that
access pinned host memory directly; they run on the compute stream, like the forward, so a load
is not hidden behind compute (the segments path exists for that).

Why this is safe with donated device buffers
--------------------------------------------
Everything is dispatched from one thread, and the pools always hold the newest array of each
layer (each kernel's outputs are put back with `set_layer`). JAX keeps program order for
dispatched work: a computation that donates (or otherwise overwrites) a buffer is held back by
the runtime until every earlier-dispatched computation reading that buffer has finished (PjRt
records a usage event per read and the donating execution waits on them; on GPU they also share
the stream). Hence a write-back dispatched before the pages are freed reads the old contents even
if the very next kernel reuses those pages; `TieredCache` frees evicted device pages right after
`launch_writes()` instead of waiting for the copy ("ordered before any reuse"). The same holds
for host pages (a later write-back into a host page is ordered after an earlier load reading it)
and for loads (the forward consuming layer l takes the load's output array as input). What the
runtime cannot order is a write-back that is still only *queued*, so the cache launches pending
writes before any page leaves the tree. Completion is still reported, for statistics and for
releasing load-back locks: an op is complete when its outputs (or the pool's newer versions of
them) are ready.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jhicache.cache.device_pool import PagePool, PoolLayout
from jhicache.cache.ticket import DispatchedCopies, LayerCopies, LoadTicket

PageCopy = Callable[..., tuple[jax.Array, jax.Array]]


class CopyFns(NamedTuple):
    """The page-transfer functions (one layer each, see pallas_kernels/page_copy.py)."""

    load: PageCopy  # (host_k, host_v, device_k, device_v, host_ids, device_ids) -> device k, v
    write_back: PageCopy  # (device_k, device_v, host_k, host_v, device_ids, host_ids) -> host k, v


def default_copy_fns() -> CopyFns:
    from jhicache.pallas_kernels.page_copy import load_pages, write_back_pages  # imported late: optional

    return CopyFns(load_pages, write_back_pages)


class TransferKind(enum.Enum):
    WRITE_BACK = "write_back"
    LOAD_BACK = "load_back"


class TransferOp(NamedTuple):
    """One queued copy of page pairs; reported back by `poll` once complete."""

    op_id: int
    kind: TransferKind
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    ticket: LoadTicket | None


class _Launch(NamedTuple):
    ops: list[TransferOp]
    copies: LayerCopies  # per-layer readiness of the launch's outputs
    started: float  # perf_counter() before its copies were dispatched


class ControllerBase:
    """Queues, merges and retires copies; subclasses dispatch one merged launch of each kind."""

    def __init__(self, device_pool: PagePool, host_layout: PoolLayout) -> None:
        if not device_pool.layout.same_page_shape(host_layout):
            raise ValueError(f"page layouts differ: {device_pool.layout} vs {host_layout}")
        self.device_pool = device_pool
        self._queued: dict[TransferKind, list[TransferOp]] = {k: [] for k in TransferKind}
        self._in_flight: list[_Launch] = []
        self._writes_to_time: list[_Launch] = []
        self._next_id = 0
        self.counters = {"write_back_ops": 0, "write_back_pages": 0, "load_back_ops": 0,
                         "load_back_pages": 0, "write_back_launches": 0, "load_back_launches": 0,
                         "load_back_moved_bytes": 0,  # what loads moved over PCIe (segments: whole arrays)
                         "write_back_s": 0.0}  # launch -> seen done, summed over write-back launches

    def _write(self, ops: list[TransferOp]) -> LayerCopies:
        raise NotImplementedError

    def _load(self, ops: list[TransferOp]) -> LayerCopies:
        raise NotImplementedError

    def _op(self, kind: TransferKind, device_pages: Sequence[int], host_pages: Sequence[int],
            ticket: LoadTicket | None = None) -> TransferOp:
        if len(device_pages) != len(host_pages) or not device_pages:
            raise ValueError(f"need equal, non-empty page lists: {len(device_pages)} vs {len(host_pages)}")
        op = TransferOp(self._next_id, kind, tuple(device_pages), tuple(host_pages), ticket)
        self._next_id += 1
        self._queued[kind].append(op)
        return op

    def queue_write_back(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Queues a device->host copy; returns its op id."""
        return self._op(TransferKind.WRITE_BACK, device_pages, host_pages).op_id

    def queue_load_back(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadTicket:
        """Queues a host->device copy; the ticket becomes waitable once launched."""
        ticket = LoadTicket(self._next_id, self.device_pool.num_layers, host_pages, device_pages)
        self._op(TransferKind.LOAD_BACK, device_pages, host_pages, ticket)
        return ticket

    def num_queued(self) -> int:
        return sum(len(q) for q in self._queued.values())

    def queued_write_host_pages(self) -> list[int]:
        """Host pages of write-backs not launched yet (their data does not exist on host yet)."""
        return [p for op in self._queued[TransferKind.WRITE_BACK] for p in op.host_pages]

    def launch(self) -> None:
        """Dispatches everything queued: write-backs first, then load-backs."""
        self.launch_writes()
        self.launch_loads()

    def launch_writes(self) -> None:
        ops = self._take(TransferKind.WRITE_BACK)
        if ops:
            started = time.perf_counter()
            launch = _Launch(ops, self._write(ops), started)
            self._in_flight.append(launch)
            self._writes_to_time.append(launch)

    def launch_loads(self) -> None:
        ops = self._take(TransferKind.LOAD_BACK)
        if ops:
            started = time.perf_counter()
            copies = self._load(ops)
            for op in ops:
                assert op.ticket is not None
                op.ticket.bind(copies, started)
            self._in_flight.append(_Launch(ops, copies, started))

    def _take(self, kind: TransferKind) -> list[TransferOp]:
        ops, self._queued[kind] = self._queued[kind], []
        if ops:
            pages = sum(len(op.device_pages) for op in ops)
            self.counters[f"{kind.value}_ops"] += len(ops)
            self.counters[f"{kind.value}_pages"] += pages
            self.counters[f"{kind.value}_launches"] += 1
        return ops

    def drive_loads(self) -> None:
        """Dispatches every launched load's remaining copies (no-op where launch dispatches all)."""

    def time_writes(self) -> None:
        """Non-blocking: adds the launch-to-now time of every write-back launch first seen done to
        `write_back_s`. Called while the host waits on a forward; a launch that finished earlier
        reads long, so bytes / `write_back_s` is a lower bound on the write-back rate."""
        if not self._writes_to_time:  # the common case, polled in a spin loop
            return
        now, layers = time.perf_counter(), range(self.device_pool.num_layers)
        pending = []
        for launch in self._writes_to_time:
            if all(launch.copies.is_ready(i) for i in layers):
                self.counters["write_back_s"] += now - launch.started
            else:
                pending.append(launch)
        self._writes_to_time = pending

    def poll(self) -> list[TransferOp]:
        """Non-blocking: ops whose launch has completed, in launch order."""
        self.time_writes()
        self.drive_loads()
        done: list[TransferOp] = []
        layers = range(self.device_pool.num_layers)
        while self._in_flight and all(self._in_flight[0].copies.is_ready(i) for i in layers):
            done += self._in_flight.pop(0).ops
        return done

    def flush(self) -> list[TransferOp]:
        """Launches everything queued and blocks until all launched copies complete."""
        self.launch()
        self.drive_loads()
        for launch in self._in_flight:
            for layer in range(self.device_pool.num_layers):
                launch.copies.block(layer)
        return self.poll()


class TransferController(ControllerBase):
    """Pages path: merges and launches page copies between a DevicePool and a paged HostPool."""

    def __init__(self, device_pool: PagePool, host_pool: PagePool, copy_fns: CopyFns | None = None) -> None:
        super().__init__(device_pool, host_pool.layout)
        self.host_pool = host_pool
        self.copy_fns = copy_fns if copy_fns is not None else default_copy_fns()

    def _write(self, ops: list[TransferOp]) -> LayerCopies:
        dev, host = _merged_ids(ops)
        dst = self.host_pool
        outputs = self._copy_layers(self.copy_fns.write_back, self.device_pool, dst, dev, host)
        return DispatchedCopies(outputs, lambda layer: dst.k[layer])

    def _load(self, ops: list[TransferOp]) -> LayerCopies:
        dev, host = _merged_ids(ops)
        dst = self.device_pool
        self.counters["load_back_moved_bytes"] += len(dev) * dst.layout.page_bytes  # padding repeats pages
        outputs = self._copy_layers(self.copy_fns.load, self.host_pool, dst, host, dev)
        return DispatchedCopies(outputs, lambda layer: dst.k[layer])

    def _copy_layers(self, fn: PageCopy, src: PagePool, dst: PagePool,
                     src_ids: np.ndarray, dst_ids: np.ndarray) -> list[jax.Array]:
        outputs = []
        for layer in range(src.num_layers):
            k, v = fn(src.k[layer], src.v[layer], dst.k[layer], dst.v[layer], src_ids, dst_ids)
            dst.set_layer(layer, k, v)
            outputs.append(k)  # K and V come from one kernel call: K's readiness stands for both
        return outputs


def pow2_bucket(n: int, smallest: int = 16) -> int:
    """The power of two >= max(n, smallest): padded id lists compile one kernel per bucket."""
    size = smallest
    while size < n:
        size *= 2
    return size


def pad_to(ids: Sequence[int], size: int) -> np.ndarray:
    """`ids` as int32, padded to `size` by repeating the last id."""
    ids = list(ids)
    return np.asarray(ids + ids[-1:] * (size - len(ids)), np.int32)


def _merged_ids(ops: list[TransferOp]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated (device ids, host ids) of `ops` as int32 numpy (validated without a device
    sync), padded to a power of two by repeating the last pair, so the copy kernels compile once
    per bucket; copying the same page pair twice writes the same bytes."""
    dev = [p for op in ops for p in op.device_pages]
    host = [p for op in ops for p in op.host_pages]
    size = pow2_bucket(len(dev))
    return pad_to(dev, size), pad_to(host, size)
