"""A stand-in for libcuda on the CPU, so that `CudaDriver` and `CudaCopier` run in the CPU tests.

Device pointers are host addresses here (the CPU backend's buffers live in host memory). Each
stream is a queue that runs lazily, as `DeferredCopier`'s do: its copies and value writes run
only when an event recorded after them is queried or synchronized, or when another stream is
made to wait for such an event. A caller that skips a wait reads stale bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

CUDA_SUCCESS = 0
_BATCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p)


def _out(ref: object) -> ctypes._SimpleCData:
    """The ctypes object behind a `ctypes.byref(...)` argument."""
    return ref._obj  # type: ignore[attr-defined]


def _value(arg: object) -> int:
    """An int from a ctypes scalar argument (c_void_p, c_uint64, ...) or a plain int."""
    value = getattr(arg, "value", arg)
    return int(value or 0)


class FakeCudaLib:
    """The driver entry points `jhicache.cache.cuda_driver` calls, over host memory.

    `batch`: whether `cuMemcpyBatchAsync` is offered (without it the driver copies one call per
    copy). Counts every copy call in `copy_calls`."""

    def __init__(self, batch: bool = True) -> None:
        self.streams: dict[int, list[tuple]] = {}
        self.events: dict[int, tuple[int, bool]] = {}  # event -> (stream, done)
        self.copy_calls = 0
        self._next = 1
        self._batch_fn = _BATCH(self._batch)  # kept alive: the driver holds its address
        if not batch:
            self.cuGetProcAddress_v2 = None

    def _handle(self) -> int:
        self._next += 1
        return self._next * 16

    # -- context and device (no-ops) -------------------------------------------------------
    def cuInit(self, flags: int) -> int:
        return CUDA_SUCCESS

    def cuDeviceGet(self, device: object, ordinal: int) -> int:
        _out(device).value = ordinal
        return CUDA_SUCCESS

    def cuDevicePrimaryCtxRetain(self, ctx: object, device: object) -> int:
        _out(ctx).value = 0x1000
        return CUDA_SUCCESS

    def cuCtxSetCurrent(self, ctx: object) -> int:
        return CUDA_SUCCESS

    def cuCtxGetStreamPriorityRange(self, least: object, greatest: object) -> int:
        _out(least).value, _out(greatest).value = 0, -1
        return CUDA_SUCCESS

    def cuGetErrorString(self, result: int, text: object) -> int:
        _out(text).value = b"fake error"
        return CUDA_SUCCESS

    def cuGetProcAddress_v2(self, name: bytes, pfn: object, abi: int, flags: int,
                            status: object) -> int:
        if name != b"cuMemcpyBatchAsync":
            return 500  # CUDA_ERROR_NOT_FOUND
        _out(pfn).value = ctypes.cast(self._batch_fn, ctypes.c_void_p).value
        return CUDA_SUCCESS

    # -- streams and events ----------------------------------------------------------------
    def cuStreamCreateWithPriority(self, handle: object, flags: int, priority: int) -> int:
        stream = self._handle()
        self.streams[stream] = []
        _out(handle).value = stream
        return CUDA_SUCCESS

    def cuEventCreate(self, handle: object, flags: int) -> int:
        event = self._handle()
        self.events[event] = (0, True)
        _out(handle).value = event
        return CUDA_SUCCESS

    def cuEventRecord(self, event: object, stream: object) -> int:
        e, s = _value(event), _value(stream)
        self.events[e] = (s, False)
        self.streams[s].append(("event", e))
        return CUDA_SUCCESS

    def cuEventQuery(self, event: object) -> int:
        self._run_to(_value(event))
        return CUDA_SUCCESS

    def cuEventSynchronize(self, event: object) -> int:
        self._run_to(_value(event))
        return CUDA_SUCCESS

    def cuStreamWaitEvent(self, stream: object, event: object, flags: int) -> int:
        self._run_to(_value(event))  # the waiting stream's later work then comes after it
        return CUDA_SUCCESS

    def cuEventElapsedTime(self, ms: object, start: object, end: object) -> int:
        _out(ms).value = 0.0
        return CUDA_SUCCESS

    def cuEventDestroy_v2(self, event: object) -> int:
        self.events.pop(_value(event), None)
        return CUDA_SUCCESS

    def _run_to(self, event: int) -> None:
        stream, done = self.events[event]
        queue = self.streams.get(stream, [])
        while not done and queue:
            op = queue.pop(0)
            if op[0] == "event":
                self.events[op[1]] = (stream, True)
                done = op[1] == event
            else:
                op[1]()

    def _enqueue(self, stream: int, run: Callable[[], None]) -> int:
        self.streams[stream].append(("op", run))
        return CUDA_SUCCESS

    # -- copies and value writes -----------------------------------------------------------
    def _batch(self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, attr_idxs: int,
               num_attrs: int, stream: int) -> int:
        self.copy_calls += 1
        # read now: the caller may reuse its arrays once the call returns (as the real one)
        triples = list(zip(*((ctypes.c_uint64 * count).from_address(a) for a in (dsts, srcs,
                                                                                 sizes))))

        def run() -> None:
            for dst, src, size in triples:
                ctypes.memmove(dst, src, size)

        return self._enqueue(stream or 0, run)

    def _copy_one(self, dst: object, src: object, size: object, stream: object) -> int:
        self.copy_calls += 1
        d, s, n = _value(dst), _value(src), _value(size)
        return self._enqueue(_value(stream), lambda: ctypes.memmove(d, s, n))

    cuMemcpyHtoDAsync_v2 = _copy_one
    cuMemcpyDtoHAsync_v2 = _copy_one

    def cuStreamWriteValue32_v2(self, stream: object, address: object, value: object,
                                flags: int) -> int:
        a, v = _value(address), _value(value)

        def run() -> None:
            ctypes.c_int32.from_address(a).value = v

        return self._enqueue(_value(stream), run)

    # -- pinned host memory ----------------------------------------------------------------
    def cuMemHostRegister_v2(self, address: object, nbytes: object, flags: int) -> int:
        return CUDA_SUCCESS

    def cuMemHostUnregister(self, address: object) -> int:
        return CUDA_SUCCESS
