"""Probe of the driver copy path (jhicache.cache.cuda_driver) on a GPU: pinning time, landing
order and overlap of per-layer host->device copies issued on a stream of our own, paged copies
(batched and one call per page), device->host rate, and that a donated jit keeps its buffer.

    PYTHONPATH=. python3 benchmarks/native_copy_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.bench.command import save_json
from jhicache.cache.cuda_driver import CudaDriver, load_library
from jhicache.cache.host_memory import HostMemory


def as_u64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.uint64)


LAYERS, LAYER_BYTES, PAGE_BYTES = 28, 8192 * 4 * 128 * 2 * 2, 64 * 4 * 128 * 2  # 7B, 8k tokens


def pinning(drv: CudaDriver, gib: int) -> dict:
    nbytes = gib << 30
    t = time.perf_counter()
    mem = HostMemory(nbytes, drv)
    register_s = time.perf_counter() - t
    mem.close()
    t = time.perf_counter()
    ptr = drv.host_alloc(nbytes)
    alloc_s = time.perf_counter() - t
    drv.free_host(ptr)
    return {"gib": gib, "mmap_touch_register_s": register_s, "cuMemHostAlloc_s": alloc_s}


def timed_copies(drv: CudaDriver, stream: int,
                 jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                 to_device: bool = True) -> tuple[float, list[float]]:
    """Issues `jobs` (one event after each) -> (host issue ms, landing ms of each from start)."""
    start, events = drv.event(timing=True), [drv.event(timing=True) for _ in jobs]
    t = time.perf_counter()
    drv.record(start, stream)
    for (d, s, n), e in zip(jobs, events):
        drv.copy(d, s, n, stream, to_device)
        drv.record(e, stream)
    issue_ms = (time.perf_counter() - t) * 1e3
    drv.synchronize(events[-1])
    return issue_ms, [round(drv.elapsed_ms(start, e), 3) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--pin-gib", default="16,64")
    args = parser.parse_args()
    lib = load_library()
    assert lib is not None, "no libcuda"
    drv = CudaDriver(lib)
    out: dict = {"batch_copy": drv.has_batch_copy, "priorities": drv.priority_range()}
    least, greatest = out["priorities"]
    h2d = drv.stream(priority=greatest)

    dev_arrays = [jnp.zeros((LAYER_BYTES // 2,), jnp.bfloat16) for _ in range(LAYERS)]
    jax.block_until_ready(dev_arrays)
    host = HostMemory(LAYERS * LAYER_BYTES, drv)
    host.array[:] = np.random.default_rng(0).integers(0, 255, host.nbytes, dtype=np.uint8)
    dptr = [a.unsafe_buffer_pointer() for a in dev_arrays]
    whole = [(as_u64([dptr[i]]), as_u64([host.address + i * LAYER_BYTES]), as_u64([LAYER_BYTES]))
             for i in range(LAYERS)]
    for trial in range(3):
        issue, landed = timed_copies(drv, h2d, whole)
        out[f"whole_layers_alone_{trial}"] = {"issue_ms": issue, "landed_ms": landed,
                                              "GBps": LAYERS * LAYER_BYTES / landed[-1] / 1e6}
    ok = all(np.array_equal(np.asarray(dev_arrays[i]).view(np.uint8),
                            host.array[i * LAYER_BYTES:(i + 1) * LAYER_BYTES]) for i in (0, 13, 27))
    out["whole_layers_bit_exact"] = bool(ok)

    # overlap: a jitted chain of matmuls on XLA's stream, the copies issued right after it
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    chain = jax.jit(lambda a: jax.lax.fori_loop(0, 6, lambda i, b: (b @ a) * 1e-4, a))
    jax.block_until_ready(chain(x))
    t = time.perf_counter()
    jax.block_until_ready(chain(x))
    out["compute_alone_ms"] = (time.perf_counter() - t) * 1e3
    for trial in range(2):
        t = time.perf_counter()
        y = chain(x)
        issue, landed = timed_copies(drv, h2d, whole)
        jax.block_until_ready(y)
        out[f"copies_beside_compute_{trial}"] = {"wall_ms": (time.perf_counter() - t) * 1e3,
                                                 "landed_ms": landed}

    # paged: 128 pages of 64 KB per layer and K/V half, scattered device pages
    rng = np.random.default_rng(1)
    pages_per_half = LAYER_BYTES // 2 // PAGE_BYTES
    jobs = []
    for i in range(LAYERS):
        dst_pages = rng.permutation(pages_per_half * 2)
        src = (host.address + i * LAYER_BYTES
               + np.arange(pages_per_half * 2, dtype=np.uint64) * PAGE_BYTES)
        jobs.append((as_u64(dptr[i] + dst_pages.astype(np.uint64) * PAGE_BYTES), as_u64(src),
                     as_u64(np.full(pages_per_half * 2, PAGE_BYTES))))
    for trial in range(2):
        issue, landed = timed_copies(drv, h2d, jobs)
        out[f"paged_batched_{trial}"] = {"issue_ms": issue, "landed_ms": landed[-1],
                                         "first_ms": landed[0],
                                         "GBps": LAYERS * LAYER_BYTES / landed[-1] / 1e6}
    batch = drv._batch
    drv._batch = None
    issue, landed = timed_copies(drv, h2d, jobs)
    drv._batch = batch
    out["paged_per_call"] = {"issue_ms": issue, "landed_ms": landed[-1],
                             "GBps": LAYERS * LAYER_BYTES / landed[-1] / 1e6}

    # device -> host, whole layers and paged, on a low-priority stream
    d2h = drv.stream(priority=least)
    back = [(as_u64([host.address + i * LAYER_BYTES]), as_u64([dptr[i]]), as_u64([LAYER_BYTES]))
            for i in range(LAYERS)]
    issue, landed = timed_copies(drv, d2h, back, to_device=False)
    out["d2h_whole"] = {"issue_ms": issue, "GBps": LAYERS * LAYER_BYTES / landed[-1] / 1e6}
    paged_back = [(s, d, n) for d, s, n in jobs]
    issue, landed = timed_copies(drv, d2h, paged_back, to_device=False)
    out["d2h_paged_batched"] = {"issue_ms": issue, "GBps": LAYERS * LAYER_BYTES / landed[-1] / 1e6}

    # a donated jit keeps its buffer (the copies write into the pool's buffers behind JAX)
    bump = jax.jit(lambda a: a.at[0].add(1), donate_argnums=0)
    a0 = dev_arrays[0]
    p0 = a0.unsafe_buffer_pointer()
    a1 = bump(a0)
    out["donation_keeps_buffer"] = a1.unsafe_buffer_pointer() == p0
    host.close()
    out["pinning"] = [pinning(drv, int(g)) for g in args.pin_gib.split(",")]
    text = json.dumps(out, indent=1)
    print(text)
    save_json(out, args.out)


if __name__ == "__main__":
    main()
