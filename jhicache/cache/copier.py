"""Copier: queues raw byte copies between host memory and device buffers, one queue per direction,
and marks points in them that can be polled or waited for. `CudaCopier` runs them on CUDA streams
of its own through the driver; `HostCopier` (the CPU backend, whose device buffers are host
memory) copies at once.

A copy is given addresses (`jax.Array.unsafe_buffer_pointer()` for device buffers), so nothing
here knows JAX's ordering: the caller fences every copy against the computations that touch the
same bytes (`jhicache.cache.transfer` says how).
"""

from __future__ import annotations

import ctypes
import enum
import time

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


class Copier:
    """The interface; `HostCopier` is also the implementation where copies complete at once."""

    synchronous = True  # copies have finished when `copy` returns

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Queues `srcs[i] -> dsts[i]` (`sizes[i]` bytes each) behind everything queued in `direction`."""
        raise NotImplementedError

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        """A mark behind everything queued so far; `timed` ones can be measured between."""
        return Mark(None, timed)

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

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)


class CudaCopier(Copier):
    """Loads on a high-priority stream, write-backs on a low-priority one, so that a burst of
    write-backs never delays the copies a forward is waiting for; each queue runs in order."""

    synchronous = False

    def __init__(self, driver: CudaDriver) -> None:
        self.driver = driver
        least, greatest = driver.priority_range()
        self._streams = {Direction.TO_DEVICE: driver.stream(greatest), Direction.TO_HOST: driver.stream(least)}
        self._spare: dict[bool, list[int]] = {False: [], True: []}  # retired events, by timing

    def copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        self.driver.copy(dsts, srcs, sizes, self._streams[direction], direction is Direction.TO_DEVICE)

    def mark(self, direction: Direction, timed: bool = False) -> Mark:
        spare = self._spare[timed]
        event = spare.pop() if spare else self.driver.event(timing=timed)
        self.driver.record(event, self._streams[direction])
        return Mark(event, timed)

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        return self.driver.elapsed_ms(start.event, end.event) / 1e3

    def is_done(self, mark: Mark) -> bool:
        if not mark.done and self.driver.query(mark.event):
            self._retire(mark)
        return mark.done

    def wait(self, mark: Mark) -> None:
        if not mark.done:
            self.driver.synchronize(mark.event)
            self._retire(mark)

    def order_after(self, direction: Direction, mark: Mark) -> None:
        if not self.is_done(mark):
            self.driver.stream_wait(self._streams[direction], mark.event)

    def _retire(self, mark: Mark) -> None:
        # A stream may still be told to wait on a retired event: waiting on a completed event
        # is a no-op. A timed event goes back only once it has been read (`release`).
        mark.done = True
        if not mark.timed:
            self._spare[False].append(mark.event)

    def release(self, mark: Mark) -> None:
        """A done, timed mark whose time has been read: its event may be reused."""
        self._spare[True].append(mark.event)


def make_copier(platform: str) -> tuple[Copier, CudaDriver | None]:
    """The copier for a JAX platform ("gpu"/"cuda" or "cpu"), and the driver pinning host memory."""
    if platform in ("gpu", "cuda"):
        lib = load_library()
        if lib is None:
            raise RuntimeError("JAX runs on a GPU but libcuda.so.1 cannot be loaded")
        driver = CudaDriver(lib)
        return CudaCopier(driver), driver
    if platform != "cpu":
        raise NotImplementedError(f"host tier copies on platform {platform!r}")
    return HostCopier(), None
