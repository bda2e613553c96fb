"""HostMemory: one host allocation made up front (anonymous mmap, first-touched in parallel, then
pinned by the driver where there is one), viewed as a numpy byte array."""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import weakref

import numpy as np

from jhicache.cache.cuda_driver import CudaDriver

_TOUCH_CHUNK = 1 << 28  # 256 MiB per first-touch task


def available_bytes() -> int | None:
    """The host memory the kernel reports as available (MemAvailable), None if it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostMemory:
    """`nbytes` of page-aligned host memory, pinned if `driver` is given; `close()` releases it.

    Why not cuMemHostAlloc: it pins page by page on one thread. Faulting the pages in from
    several threads (ctypes releases the GIL during memset) and then registering the range
    pins the same memory in a fraction of the time (BENCHMARKS.md has the figures)."""

    def __init__(self, nbytes: int, driver: CudaDriver | None = None,
                 threads: int | None = None) -> None:
        if nbytes < 1:
            raise ValueError(f"nbytes={nbytes}: expected >= 1")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault in and to pin
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.array.ctypes.data
        _touch(self.address, nbytes, threads or min(16, os.cpu_count() or 1))
        if driver is not None:
            driver.register(self.address, nbytes)
        # Unpinned before it is unmapped, also when dropped without close(): a range the driver
        # still holds pinned cannot be pinned again by a later allocation at the same address.
        self._release = weakref.finalize(self, _release, driver, self.address, self._map)
        self.pinned = driver is not None

    def close(self) -> None:
        """Unpins and unmaps; views of `array` must not be used afterwards."""
        self.array = np.empty(0, np.uint8)
        self._release()


def _release(driver: CudaDriver | None, address: int, mapping: mmap.mmap) -> None:
    if driver is not None:
        driver.unregister(address)
    try:
        mapping.close()
    except BufferError:  # a numpy view is still alive: the mapping goes when it does
        pass


def _touch(address: int, nbytes: int, threads: int) -> None:
    """Faults every page in, `threads` chunks at a time."""
    starts = range(0, nbytes, _TOUCH_CHUNK)
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in pool.map(lambda s: ctypes.memset(address + s, 0, min(_TOUCH_CHUNK, nbytes - s)),
                          starts):
            pass
