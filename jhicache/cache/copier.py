"""Copier: queues raw byte copies between host memory and device buffers, one queue per direction,
and marks points in them that can be polled or waited for. `CudaCopier` runs them on CUDA streams
of its own through the driver; `HostCopier` (the CPU backend, whose device buffers are host
memory) copies at once. `ShardedCopier` drives one of those per device of a tensor-parallel mesh,
each shard's copies on its own device's queues.

A copy is given addresses (`jax.Array.unsafe_buffer_pointer()` for device buffers), so nothing
here knows JAX's ordering: the caller fences every copy against the computations that touch the
same bytes (`jhicache.cache.transfers` says how).
"""

from __future__ import annotations

import ctypes
import enum
import time
from collections.abc import Sequence

import numpy as np

from jhicache.cache.cuda_driver import CudaDriver, load_library


class Direction(enum.Enum):
    TO_DEVICE = "to_device"
    TO_HOST = "to_host"


class Mark:
    """A point in one direction's queue: done once every copy queued before it has finished."""

    __slots__ = ("event", "done", "at", "timed")

    def __init__(self, event: int | None, timed: bool = False) -> None:
        self.event = event  # a CUDA event (CudaCopier) or None (already complete)
        self.done = event is None
        self.at = time.perf_counter()  # when marked (what HostCopier times by)
        self.timed = timed


def _event(mark: Mark) -> int:
    """A driver copier's mark's event: it records one for every mark it makes."""
    if mark.event is None:
        raise ValueError("a mark without a CUDA event reached the driver copier")
    return mark.event


class CopyRows:
    """Copies prepared once and queued a row at a time (a load's layers, in order): row `r` of
    device shard `s` copies `srcs[s, r, i] -> dsts[s, r, i]`, `sizes[i]` bytes each. It keeps
    each row's addresses as ints, so that queuing a row is one driver call with nothing built
    per call: a load queues its rows while the forward waits to be dispatched."""

    def __init__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        self.dsts = np.ascontiguousarray(dsts, np.uint64)  # [shards, rows, n]
        self.srcs = np.ascontiguousarray(srcs, np.uint64)
        self.sizes = np.ascontiguousarray(sizes, np.uint64)  # [n]
        if self.dsts.ndim != 3 or self.dsts.shape != self.srcs.shape or (
                self.dsts.shape[2] != len(self.sizes)):
            raise ValueError(f"dsts {self.dsts.shape}, srcs {self.srcs.shape} and sizes "
                             f"{self.sizes.shape} do not describe [shards, rows, n] copies")
        shards, rows, count = self.dsts.shape
        self.count = count
        row = np.arange(shards * rows).reshape(shards, rows) * 8 * count
        self.dst_rows = (self.dsts.ctypes.data + row).tolist()  # [shards][rows] addresses
        self.src_rows = (self.srcs.ctypes.data + row).tolist()
        self.sizes_address = self.sizes.ctypes.data


class Copier:
    """The interface; `HostCopier` is also the implementation where copies complete at once."""

    synchronous = True  # copies have finished when `copy` returns
    # Copies run beside the compute, so a kernel can wait on the device for a `signal` while
    # they land. Not so where the copier is the host itself (the CPU backend, test doubles):
    # there a forward's loads must have landed before it runs (`LoadTicket.gate_seq` waits).
    beside_compute = False

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
             sizes: np.ndarray) -> None:
        """Queues `srcs[i] -> dsts[i]` (`sizes[i]` bytes each) behind everything queued in
        `direction`."""
        raise NotImplementedError

    def copy_row(self, direction: Direction, rows: CopyRows, row: int, shard: int = 0) -> None:
        """Queues row `row` of `rows` (shard `shard`'s) behind everything queued in
        `direction`."""
        self.copy(direction, rows.dsts[shard, row], rows.srcs[shard, row], rows.sizes)

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        """A mark behind everything queued so far; `timed` ones can be measured between."""
        return Mark(None, timed)

    def signal(self, direction: Direction, addresses: np.ndarray, value: int) -> None:
        """Stores int32 `value` at each device address (one per shard) once everything queued
        so far in `direction` has finished: what kernels waiting on the device read."""
        for address in addresses.tolist():
            ctypes.c_int32.from_address(address).value = value

    def is_done(self, mark: Mark) -> bool:
        return mark.done

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        """Seconds between two done, timed marks of one queue (device-side where copies are)."""
        return end.at - start.at

    def wait(self, mark: Mark) -> None:
        """Blocks the host until `mark` is done."""

    def order_after(self, direction: Direction, mark: Mark) -> None:
        """Copies queued in `direction` from now on start after `mark` (of the other queue)."""

    def release(self, mark: Mark) -> None:
        """A done, timed mark whose time has been read (CudaCopier reuses its event)."""


class HostCopier(Copier):
    """memmove at once: for the CPU backend, where device buffers live in host memory."""

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
             sizes: np.ndarray) -> None:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)


class CudaCopier(Copier):
    """Loads on a high-priority stream, write-backs on a low-priority one, so that a burst of
    write-backs never delays the copies a forward is waiting for; each queue runs in order."""

    synchronous = False
    beside_compute = True

    def __init__(self, driver: CudaDriver) -> None:
        self.driver = driver
        least, greatest = driver.priority_range()
        self._streams = {Direction.TO_DEVICE: driver.stream(greatest),
                         Direction.TO_HOST: driver.stream(least)}
        self._spare: dict[bool, list[int]] = {False: [], True: []}  # retired events, by timing

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
             sizes: np.ndarray) -> None:
        self.driver.copy(dsts, srcs, sizes, self._streams[direction],
                         direction is Direction.TO_DEVICE)

    def copy_row(self, direction: Direction, rows: CopyRows, row: int, shard: int = 0) -> None:
        if not self.driver.has_batch_copy:
            super().copy_row(direction, rows, row, shard)
            return
        self.driver.copy_batch_at(rows.dst_rows[shard][row], rows.src_rows[shard][row],
                                  rows.sizes_address, rows.count, self._streams[direction],
                                  direction is Direction.TO_DEVICE)

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        spare = self._spare[timed]
        event = spare.pop() if spare else self.driver.event(timing=timed)
        self.driver.record(event, self._streams[direction])
        return Mark(event, timed)

    def signal(self, direction: Direction, addresses: np.ndarray, value: int) -> None:
        (address,) = addresses.tolist()
        self.driver.write_value32(self._streams[direction], address, value)

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        return self.driver.elapsed_ms(_event(start), _event(end)) / 1e3

    def is_done(self, mark: Mark) -> bool:
        if not mark.done and self.driver.query(_event(mark)):
            self._retire(mark)
        return mark.done

    def wait(self, mark: Mark) -> None:
        if not mark.done:
            self.driver.synchronize(_event(mark))
            self._retire(mark)

    def order_after(self, direction: Direction, mark: Mark) -> None:
        if not self.is_done(mark):
            self.driver.stream_wait(self._streams[direction], _event(mark))

    def _retire(self, mark: Mark) -> None:
        # A stream may still be told to wait on a retired event: waiting on a completed event
        # is a no-op. A timed event goes back only once it has been read (`release`).
        mark.done = True
        if not mark.timed:
            self._spare[False].append(_event(mark))

    def release(self, mark: Mark) -> None:
        """A done, timed mark whose time has been read: its event may be reused."""
        self._spare[True].append(_event(mark))


class ShardMark(Mark):
    """A mark of a ShardedCopier: one mark per device, done once every one of them is."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Mark], timed: bool) -> None:
        super().__init__(0, timed)
        self.parts = parts


class ShardedCopier(Copier):
    """One copier per device shard (in the pool's shard order): shard i's copies go to copier i.

    A page's bytes are split over the devices, each shard moving only between its device and
    that device's host block, so the queues of different devices never need ordering against
    each other: every call is per device, and a mark is done when all devices' marks are."""

    def __init__(self, copiers: Sequence[Copier]) -> None:
        if len(copiers) < 2:
            raise ValueError(f"a ShardedCopier needs >= 2 copiers, got {len(copiers)}")
        self.copiers = tuple(copiers)
        self.synchronous = all(c.synchronous for c in copiers)
        self.beside_compute = all(c.beside_compute for c in copiers)

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
             sizes: np.ndarray) -> None:
        """`dsts`, `srcs`: [shards, n] addresses, row i on device i; `sizes`: [n], every shard's."""
        for copier, dst, src in zip(self.copiers, dsts, srcs, strict=True):
            copier.copy(direction, dst, src, sizes)

    def copy_row(self, direction: Direction, rows: CopyRows, row: int, shard: int = 0) -> None:
        """Every shard's part of the row, each on its own device's copier."""
        for i, copier in enumerate(self.copiers):
            copier.copy_row(direction, rows, row, i)

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        return ShardMark([c.mark(direction, timed) for c in self.copiers], timed)

    def signal(self, direction: Direction, addresses: np.ndarray, value: int) -> None:
        """`addresses`: one per device, in shard order."""
        for copier, address in zip(self.copiers, addresses, strict=True):
            copier.signal(direction, np.asarray([address], np.uint64), value)

    def is_done(self, mark: Mark) -> bool:
        if not mark.done:
            mark.done = all(c.is_done(m) for c, m in zip(self.copiers, _parts(mark)))
        return mark.done

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        """The slowest device's span (the copies run side by side, one queue per device)."""
        return max(c.elapsed_s(s, e) for c, s, e in zip(self.copiers, _parts(start), _parts(end)))

    def wait(self, mark: Mark) -> None:
        for copier, part in zip(self.copiers, _parts(mark)):
            copier.wait(part)
        mark.done = True

    def order_after(self, direction: Direction, mark: Mark) -> None:
        for copier, part in zip(self.copiers, _parts(mark)):
            copier.order_after(direction, part)

    def release(self, mark: Mark) -> None:
        for copier, part in zip(self.copiers, _parts(mark)):
            copier.release(part)


def _parts(mark: Mark) -> list[Mark]:
    assert isinstance(mark, ShardMark), mark
    return mark.parts


def make_copier(platform: str, ordinals: Sequence[int] = (0,)) -> tuple[Copier, list[CudaDriver]]:
    """The copier for a JAX platform ("gpu"/"cuda" or "cpu") over the devices `ordinals` (CUDA
    ordinals, in shard order: a ShardedCopier for several), and the drivers pinning each
    device's host block (none on the CPU)."""
    if platform in ("gpu", "cuda"):
        lib = load_library()
        if lib is None:
            raise RuntimeError("JAX runs on a GPU but libcuda.so.1 cannot be loaded")
        drivers = [CudaDriver(lib, ordinal, always_bind=len(ordinals) > 1) for ordinal in ordinals]
        copiers: list[Copier] = [CudaCopier(driver) for driver in drivers]
    elif platform == "cpu":
        drivers, copiers = [], [HostCopier() for _ in ordinals]
    else:
        raise NotImplementedError(f"host tier copies on platform {platform!r}")
    return (copiers[0] if len(copiers) == 1 else ShardedCopier(copiers)), drivers
