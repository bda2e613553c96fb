"""Host->device DMA of a Qwen2-7B-sized 8k-token load next to compute: does dispatch order matter?

    PYTHONPATH=. python3 benchmarks/dma_vs_compute.py [--pages 128 --dim 8192]

28 pinned_host arrays of 16.8 MB (one per layer: [2, 128 pages, 64, 4, 128] bf16-sized) are
moved to the device in one call, in 9 grouped calls (1, 2, then 4 layers) or in 28 calls; alone,
dispatched before ~12 ms of matmuls, or after the matmuls were queued. Prints median dispatch,
landed (all copies done) and total times. H200, 2026-11-30: 9.1 ms alone (51.6 GB/s), 9.1 ms
before the matmuls (total 11.8 ms, compute alone 11.6), 18.9 ms after them: a DMA dispatched
while compute is queued waits for it, whatever the call grouping (figures from a first draft of
this script with the same arrays, orders and matmuls). It also prints when each of the 9 groups
lands when all are dispatched at once (not yet run on the GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = 28


@jax.jit
def matmuls(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(8):
        x = (x @ w) * 0.001
    return x


def median_times(copy: Callable[[], list], x: jax.Array, w: jax.Array, order: str,
                 reps: int = 5) -> list[float]:
    """Median (dispatch, landed, all done) milliseconds; `order`: alone, before or after the
    matmuls."""
    rows = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        before = matmuls(x, w) if order == "after" else None
        out = copy()
        after = matmuls(x, w) if order == "before" else None
        dispatched = time.perf_counter() - start
        jax.block_until_ready(out)
        landed = time.perf_counter() - start
        jax.block_until_ready([a for a in (before, after) if a is not None])
        rows.append((dispatched, landed, time.perf_counter() - start))
    return [statistics.median(r[i] for r in rows[1:]) * 1e3 for i in range(3)]


def landing_times(arrays: list[jax.Array], groups: list[list[int]],
                  device: jax.sharding.Sharding) -> list[float]:
    """Milliseconds from the first dispatch until each group's copies are first seen ready, with
    all groups dispatched at once: do they land in order (as at full speed one after another) or
    together, sharing the bandwidth?"""
    start = time.perf_counter()
    outs = [jax.device_put([arrays[i] for i in g], device) for g in groups]
    landed: dict[int, float] = {}
    while len(landed) < len(groups):
        now = (time.perf_counter() - start) * 1e3
        for g, out in enumerate(outs):
            if g not in landed and all(a.is_ready() for a in out):
                landed[g] = round(now, 2)
    return [landed[g] for g in range(len(groups))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=128,
                   help="pages per layer array (64 tokens, 4 KV heads x 128)")
    p.add_argument("--dim", type=int, default=8192, help="matmul size")
    a = p.parse_args()
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    arrays = [jax.device_put(np.ones((2, a.pages, 64, 4, 128), np.float16), host)
              for _ in range(LAYERS)]
    groups = [[0], [1, 2]] + [list(range(s, min(s + 4, LAYERS))) for s in range(3, LAYERS, 4)]
    copies = {"one call": lambda: jax.device_put(arrays, device),
              "9 groups": lambda: [a for g in groups
                                   for a in jax.device_put([arrays[i] for i in g], device)],
              "28 calls": lambda: [jax.device_put(a, device) for a in arrays]}
    x = w = jnp.ones((a.dim, a.dim), jnp.bfloat16)
    matmuls(x, w).block_until_ready()
    start = time.perf_counter()
    matmuls(x, w).block_until_ready()
    nbytes = sum(a.nbytes for a in arrays)
    print(f"matmuls alone {(time.perf_counter() - start) * 1e3:.2f} ms; "
          f"{nbytes / 1e6:.0f} MB to move")
    cumulative = [round(sum(arrays[i].nbytes for g in groups[: k + 1] for i in g) / nbytes, 3)
                  for k in range(len(groups))]
    print(f"9 groups, share of the bytes up to each: {cumulative}")
    for _ in range(3):
        print("9 groups, each landed at (ms after the first dispatch): "
              f"{landing_times(arrays, groups, device)}")
    for name, copy in copies.items():
        for order in ("alone", "before", "after"):
            dispatched, landed, done = median_times(copy, x, w, order)
            print(f"{name:9s} {order:6s} dispatch {dispatched:6.2f} ms  landed {landed:6.2f} ms "
                  f"({nbytes / landed / 1e6:5.1f} GB/s)  all done {done:6.2f} ms")


if __name__ == "__main__":
    main()
