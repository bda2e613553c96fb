"""CudaDriver: the CUDA driver calls the host tier's copies need (streams, events, batched async
copies, pinned host memory), reached through ctypes, so nothing is compiled and the package
installs where there is no CUDA at all.

Why the driver and not XLA: a pinned_host-to-device `device_put` waits for the compute queued
before it and spreads whole-array copies over four streams, so layer copies land out of order
and late; copies issued here run on a stream of our own, in the order issued, beside XLA's
compute. The price is that JAX does not see them: the caller must fence every page it copies
into or out of (see `jhicache.cache.transfers`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import numpy as np

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
_STREAM_NON_BLOCKING = 0x1
_EVENT_DISABLE_TIMING = 0x2
_HOST_REGISTER_PORTABLE = 0x1
_ACCESS_ORDER_STREAM = 0x1  # CUmemcpySrcAccessOrder: the source may change once the stream moves on
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_PREFER_OVERLAP_WITH_COMPUTE = 0x1  # CUmemcpyFlags: use a copy engine, not the SMs
_BATCH_ABI = 13000  # cuMemcpyBatchAsync as of CUDA 13 (no failIdx argument)


def _address(array: np.ndarray) -> int:
    """The address of a C-contiguous array's data; through a ctypes view of its buffer, which
    costs less host time than `array.ctypes.data` (only read-only arrays take that way)."""
    try:
        # numpy's stubs do not declare the buffer protocol that ndarray has
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # read-only, or empty
        return array.ctypes.data


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error string."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _Location),
                ("dst_loc_hint", _Location), ("flags", ctypes.c_uint)]


def load_library() -> ctypes.CDLL | None:
    """libcuda, or None where there is no NVIDIA driver (the CPU machines)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class CudaDriver:
    """One device's primary context (the one XLA uses, so its buffer addresses are valid here),
    with typed wrappers over the calls this package makes.

    `always_bind`: make the context current before every call, for drivers of several devices
    used from one thread. XLA leaves whichever device's context it used last current on the
    calling thread, so a context set once may have been replaced by another device's."""

    def __init__(self, lib: ctypes.CDLL, device_ordinal: int = 0,
                 always_bind: bool = False) -> None:
        self._lib = lib
        self._check("cuInit", lib.cuInit(0))
        device = ctypes.c_int()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), device_ordinal))
        self._ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain",
                    lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), device))
        self._always_bind = always_bind
        self._bound = threading.local()  # a context is current per thread: bind it once in each
        self._batch = self._batch_function()
        self._write32 = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        host, gpu = _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, device_ordinal)
        self._attrs = {to_device: _CopyAttributes(
            _ACCESS_ORDER_STREAM, host if to_device else gpu, gpu if to_device else host,
            _PREFER_OVERLAP_WITH_COMPUTE) for to_device in (True, False)}
        self._attr_refs = {d: ctypes.byref(attrs) for d, attrs in self._attrs.items()}
        self._attr_index = (ctypes.c_size_t * 1)(0)  # one attribute set for a whole batch
        self._bind()

    # -- plumbing ------------------------------------------------------------------------------

    def _check(self, call: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(text))
            name = text.value.decode() if text.value else "unknown error"
            raise CudaError(f"{call} failed: {name} ({result})")

    def _bind(self) -> None:
        if self._always_bind or not getattr(self._bound, "done", False):
            self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(self._ctx))
            self._bound.done = True

    def _batch_function(self) -> Callable[..., int] | None:
        """cuMemcpyBatchAsync at the CUDA 13 ABI, or None if this driver is older."""
        pfn, status = ctypes.c_void_p(), ctypes.c_int()
        get = getattr(self._lib, "cuGetProcAddress_v2", None)
        if get is None or get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), _BATCH_ABI, 0,
                              ctypes.byref(status)) != CUDA_SUCCESS or not pfn.value:
            return None
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p)
        return proto(pfn.value)

    @property
    def has_batch_copy(self) -> bool:
        return self._batch is not None

    # -- streams and events --------------------------------------------------------------------

    def stream(self, priority: int = 0) -> int:
        """A non-blocking stream (it never syncs with the legacy default stream)."""
        self._bind()
        handle = ctypes.c_void_p()
        self._check("cuStreamCreateWithPriority", self._lib.cuStreamCreateWithPriority(
            ctypes.byref(handle), _STREAM_NON_BLOCKING, priority))
        return handle.value or 0

    def priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority; a greater priority is a smaller number."""
        least, greatest = ctypes.c_int(), ctypes.c_int()
        self._check("cuCtxGetStreamPriorityRange", self._lib.cuCtxGetStreamPriorityRange(
            ctypes.byref(least), ctypes.byref(greatest)))
        return least.value, greatest.value

    def event(self, timing: bool = False) -> int:
        self._bind()
        handle = ctypes.c_void_p()
        flags = 0 if timing else _EVENT_DISABLE_TIMING
        self._check("cuEventCreate", self._lib.cuEventCreate(ctypes.byref(handle), flags))
        return handle.value or 0

    def record(self, event: int, stream: int) -> None:
        self._bind()
        self._check("cuEventRecord",
                    self._lib.cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)))

    def query(self, event: int) -> bool:
        """Non-blocking: has everything before the event's record finished?"""
        self._bind()
        result = self._lib.cuEventQuery(ctypes.c_void_p(event))
        if result == CUDA_ERROR_NOT_READY:
            return False
        self._check("cuEventQuery", result)
        return True

    def synchronize(self, event: int) -> None:
        self._bind()
        self._check("cuEventSynchronize", self._lib.cuEventSynchronize(ctypes.c_void_p(event)))

    def stream_wait(self, stream: int, event: int) -> None:
        """Work queued on `stream` from now on starts after `event` (another stream's) completes."""
        self._bind()
        self._check("cuStreamWaitEvent", self._lib.cuStreamWaitEvent(
            ctypes.c_void_p(stream), ctypes.c_void_p(event), 0))

    def write_value32(self, stream: int, address: int, value: int) -> None:
        """Queues a 32-bit store of `value` at device `address` on `stream`, after (and fenced
        behind) the stream's earlier work: how a copy stream tells kernels a layer has landed."""
        self._bind()
        self._check("cuStreamWriteValue32", self._write32(
            ctypes.c_void_p(stream), ctypes.c_uint64(address), ctypes.c_uint32(value), 0))

    def elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between two completed timing events."""
        ms = ctypes.c_float()
        fn = getattr(self._lib, "cuEventElapsedTime_v2", None) or self._lib.cuEventElapsedTime
        self._check("cuEventElapsedTime",
                    fn(ctypes.byref(ms), ctypes.c_void_p(start), ctypes.c_void_p(end)))
        return ms.value

    # -- copies --------------------------------------------------------------------------------

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
             to_device: bool) -> None:
        """Queues copies `srcs[i] -> dsts[i]` of `sizes[i]` bytes on `stream`, in order.

        One batched call where the driver has it (CUDA 12.8+), else one call per copy."""
        if len(sizes) == 0:
            return
        if self._batch is not None:
            self._copy_batch(dsts, srcs, sizes, stream, to_device)
            return
        self._bind()
        fn = self._lib.cuMemcpyHtoDAsync_v2 if to_device else self._lib.cuMemcpyDtoHAsync_v2
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self._check("cuMemcpyAsync", fn(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                            ctypes.c_size_t(size), ctypes.c_void_p(stream)))

    def _copy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                    to_device: bool) -> None:
        dsts = np.ascontiguousarray(dsts, np.uint64)
        srcs = np.ascontiguousarray(srcs, np.uint64)
        sizes = np.ascontiguousarray(sizes, np.uint64)
        self.copy_batch_at(_address(dsts), _address(srcs), _address(sizes), len(sizes), stream,
                           to_device)

    def copy_batch_at(self, dsts: int, srcs: int, sizes: int, count: int, stream: int,
                      to_device: bool) -> None:
        """One batched call (the driver must have it) over `count` uint64 destination, source
        and size entries at host addresses `dsts`, `srcs`, `sizes`."""
        assert self._batch is not None, "cuMemcpyBatchAsync needs CUDA 12.8+"
        self._bind()
        self._check("cuMemcpyBatchAsync", self._batch(
            dsts, srcs, sizes, count, self._attr_refs[to_device], self._attr_index, 1, stream))

    # -- pinned host memory --------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        """Pins (page-locks) an existing host allocation and maps it for the device."""
        self._bind()
        self._check("cuMemHostRegister", self._lib.cuMemHostRegister_v2(
            ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _HOST_REGISTER_PORTABLE))

    def unregister(self, address: int) -> None:
        self._bind()
        self._check("cuMemHostUnregister", self._lib.cuMemHostUnregister(ctypes.c_void_p(address)))
