"""Host time of the CUDA driver calls a load makes per layer, on a GPU: `CudaDriver.copy` (Python
and driver) against the bare batched call and plain `cuMemcpyHtoDAsync`s, by the number of copies
in a call, and the flag write and event record that follow a layer.

    PYTHONPATH=. python3 benchmarks/driver_call_costs.py [--out FILE]

Each figure is the median host time of one call over `REPS` calls, in microseconds; the copies
are 4 KB (small, so the copy engine never backs up) and the stream is synchronized every
`BURST` calls, outside the timing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.bench.command import save_json
from jhicache.cache.cuda_driver import CudaDriver, load_library
from jhicache.cache.host_memory import HostMemory

REPS, BURST, CHUNK = 400, 50, 4096


def median_us(call: Callable[[int], None], sync: Callable[[], None]) -> float:
    times = []
    for i in range(REPS):
        if i % BURST == 0:
            sync()
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    sync()
    return round(statistics.median(times) * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    cli = parser.parse_args()
    lib = load_library()
    assert lib is not None, "needs libcuda"
    jax.devices()  # XLA's context first: the driver retains the same primary context
    drv = CudaDriver(lib)
    device = jnp.zeros((1 << 24,), jnp.uint8)
    dptr = device.unsafe_buffer_pointer()
    host = HostMemory(1 << 24, drv)
    stream = drv.stream(drv.priority_range()[1])
    done = drv.event()
    flag = jnp.zeros((64,), jnp.int32)
    flag_ptr = flag.unsafe_buffer_pointer()

    def sync() -> None:
        drv.record(done, stream)
        drv.synchronize(done)

    out: dict = {"reps": REPS, "bytes_per_copy": CHUNK, "copy": {}, "bare_batch": {},
                 "plain_htod": {}}
    htod = lib.cuMemcpyHtoDAsync_v2
    htod.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    for n in (1, 2, 4, 8, 32, 256):
        offs = np.arange(n, dtype=np.uint64) * np.uint64(2 * CHUNK)
        dsts, srcs = np.uint64(dptr) + offs, np.uint64(host.address) + offs
        sizes = np.full(n, CHUNK, np.uint64)
        out["copy"][n] = median_us(lambda i: drv.copy(dsts, srcs, sizes, stream, True), sync)
        attrs, index = drv._attrs[True], drv._attr_index
        batch = drv._batch
        if batch is not None:
            d, s, z = dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data
            out["bare_batch"][n] = median_us(
                lambda i: batch(d, s, z, n, ctypes.byref(attrs), index, 1, stream), sync)
        pairs = list(zip(dsts.tolist(), srcs.tolist()))
        out["plain_htod"][n] = median_us(
            lambda i: [htod(a, b, CHUNK, stream) for a, b in pairs], sync)
    out["write_value32"] = median_us(lambda i: drv.write_value32(stream, flag_ptr, i), sync)
    event = drv.event()
    out["record"] = median_us(lambda i: drv.record(event, stream), sync)
    out["query"] = median_us(lambda i: drv.query(event), sync)
    host.close()
    print(json.dumps(out, indent=1))
    save_json(out, cli.out)


if __name__ == "__main__":
    main()
