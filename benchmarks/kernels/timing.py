"""Timers (median of calls; per layer of one program) and the PCIe, HBM copy and read ceilings
(of 1 GiB arrays, and of one layer's bytes), and the matmul ceiling."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.shapes import random_array

GB = 1e9
T = TypeVar("T")


def _shardings() -> tuple[jax.sharding.Sharding, jax.sharding.Sharding]:
    """The first device's HBM and its pinned host memory."""
    d = jax.devices()[0]
    mk = jax.sharding.SingleDeviceSharding
    return mk(d, memory_kind="device"), mk(d, memory_kind="pinned_host")


def on_gpu() -> bool:
    """Whether the kernels run on a GPU, where a trace holds their device time."""
    return jax.default_backend() == "gpu"


def timeit(step: Callable[[], object], reps: int = 7, warm: int = 2) -> float:
    """Median seconds of `step` (which must return what to block on) after warm-up calls."""
    for _ in range(warm):
        jax.block_until_ready(step())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def dispatch_us(step: Callable[[], object], reps: int = 50) -> float:
    """Median host microseconds of `step()` returning (not its device work) over `reps` calls
    after a warm-up one; each call's outputs are waited for outside the timing, so the device
    is idle at the next."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return statistics.median(times[1:]) * 1e6


def safe(fn: Callable[[], T]) -> T | str:
    """fn's result, or "ERROR <type>: <message>" if it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  a failing path is a result to record, not a crash
        return f"ERROR {type(e).__name__}: {str(e)[:300]}"


def ceilings(res: dict) -> None:
    """PCIe both ways (device_put of pinned host arrays) and HBM copy (x + 1 on 1 GiB)."""
    dev, host = _shardings()
    n = 512 << 20
    h = jax.device_put(np.ones(n // 2, np.float16), host)
    d = jax.device_put(np.ones(n // 2, np.float16), dev)
    res["pcie_h2d_gbps"] = n / timeit(lambda: jax.device_put(h, dev)) / GB
    res["pcie_d2h_gbps"] = n / timeit(lambda: jax.device_put(d, host)) / GB
    big = random_array(0, (1 << 29,), jnp.bfloat16)  # 1 GiB
    copy = jax.jit(lambda x: x + jnp.bfloat16(1))
    res["hbm_copy_gbps"] = 2 * big.nbytes / timeit(lambda: copy(big)) / GB  # read + write
    res["hbm_copy_note"] = "elementwise x+1 on 1 GiB bf16, bytes read + written"


# read-only passes for the HBM read ceiling; each output is at most 1/1024 of the bytes read
READS: tuple[tuple[str, Callable[[jax.Array], jax.Array]], ...] = (
    ("sum_f32", lambda x: jnp.sum(x.astype(jnp.float32))),
    ("row_max_1024", lambda x: x.reshape(-1, 1024).max(axis=1)),
    ("row_sum_f32_8192", lambda x: x.reshape(-1, 8192).astype(jnp.float32).sum(axis=1)),
)


def per_layer_seconds(program: Callable[..., object], args: tuple, layers: int, reps: int = 7,
                      warm: int = 2) -> float:
    """Median seconds of one call of jit(program)(*args) (a program over `layers` layers, all in
    one dispatch) after warm-up calls (the first compiles), divided by `layers`."""
    f = jax.jit(program)
    return timeit(lambda: f(*args), reps, warm) / layers


def kernel_times(run: Callable[[], object]) -> dict:
    """GPU time per kernel name of one traced call of `run` (what it returns blocked on), from
    the profiler's perfetto trace (its own durations; the profiler adds a little to each)."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        try:
            jax.block_until_ready(run())
        finally:  # a failed call must not leave the profiler on for what follows
            jax.profiler.stop_trace()
        path = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "GPU" in e["args"]["name"]}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpus]
    per: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per[e["name"]][0] += 1
        per[e["name"]][1] += e["dur"]
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    return {"kernels": len(kernels), "sum_us": sum(t for _, t in per.values()),
            "by_name": [{"name": k[:80], "calls": c, "us": t} for k, (c, t) in rows]}


def hbm_read(res: dict, mib: int = 1024, buffers: int = 4, reps: int = 21, warm: int = 10) -> None:
    """HBM read ceiling: each READS pass over `buffers` distinct `mib` MiB bf16 arrays (well above
    the 50 MB L2) in one program; bytes read / per-array time. A second call in the same run keeps
    each pass's best, so a cold first measurement cannot understate the ceiling."""
    n = (mib << 20) // 2
    xs = tuple(random_array(50 + i, (n,)) for i in range(buffers))
    row = res.setdefault("hbm_read", {"variants_gbps": {}, "passes": 0})
    for name, read in READS:
        def one_pass(read: Callable = read) -> float:
            return per_layer_seconds(lambda xs: [read(x) for x in xs], (xs,), buffers, reps, warm)

        s = safe(one_pass)
        old = row["variants_gbps"].get(name)
        if isinstance(s, float):
            gbps = 2 * n / s / GB
            row["variants_gbps"][name] = max(gbps, old) if isinstance(old, float) else gbps
        elif not isinstance(old, float):
            row["variants_gbps"][name] = s
    row["passes"] += 1
    measured = {k: v for k, v in row["variants_gbps"].items() if isinstance(v, float)}
    if not measured:
        raise RuntimeError(f"no HBM read pass ran: {row['variants_gbps']}")
    best = max(measured, key=lambda name: measured[name])
    res["hbm_read_gbps"] = measured[best]
    res["hbm_read_note"] = (f"{best}: jitted read-only pass over {buffers} distinct {mib} MiB bf16 "
                            f"arrays in one program, bytes read / per-array time; the best of "
                            f"{len(READS)} passes (variants_gbps) over {row['passes']} "
                            f"measurement(s) in this run")


def matmul_ceiling(res: dict, n: int = 8192, count: int = 4, reps: int = 11,
                   warm: int = 5) -> None:
    """Tensor ceiling: `count` distinct bf16 [n, n] x [n, n] matmuls (XLA's GEMM, float32
    accumulation) in one program; 2 n^3 FLOPs / per-matmul time. Like `hbm_read`, a second call
    in the same run keeps the best, so a cold first measurement cannot understate it. Attention
    over a cached prefix does one FLOP per byte of K and V it reads per query row of a kv head
    (its group's heads x the new tokens): 448 for a 64-token turn of Qwen2's groups of 7, past
    what an H100 or H200 computes per byte it reads, so this ceiling can bind before HBM's."""
    pairs = tuple((random_array(70 + 2 * i, (n, n)), random_array(71 + 2 * i, (n, n)))
                  for i in range(count))
    seconds = per_layer_seconds(
        lambda pairs: [jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
                       for a, b in pairs], (pairs,), count, reps, warm)
    tflops = 2 * n**3 / seconds / 1e12
    old = res.get("matmul_tflops")
    res["matmul_tflops"] = max(tflops, old) if isinstance(old, float) else tflops
    res["matmul_passes"] = res.get("matmul_passes", 0) + 1
    res["matmul_note"] = (f"jitted bf16 [{n}, {n}] x [{n}, {n}] matmuls (float32 accumulation), "
                          f"{count} distinct pairs in one program, 2 n^3 FLOPs / per-matmul time; "
                          f"the best of {res['matmul_passes']} measurement(s) in this run")


def layer_read(nbytes: int, layers: int, reps: int = 7, warm: int = 2) -> dict:
    """The read ceiling at one layer's size: `layers` distinct bf16 arrays of `nbytes` (rounded
    down to whole 1024-element rows), each read by one row-max pass in one program, as the
    attention cases run their layers. Per layer: wall time (timed as `per_layer_seconds` times,
    the attention rows' own clock) and, on a GPU, the kernels' device time. A kernel that reads
    a layer's bytes is bounded by what this plain read reaches on each clock."""
    n = nbytes // 2 // 1024 * 1024
    xs = tuple(random_array(300 + i, (n,)) for i in range(layers))
    read = dict(READS)["row_max_1024"]
    program = jax.jit(lambda xs: [read(x) for x in xs])
    row: dict = {"pass": "row_max_1024", "bytes": 2 * n, "layers": layers,
                 "wall_us": timeit(lambda: program(xs), reps, warm) / layers * 1e6}
    if on_gpu():  # compiled by the timing above, before the trace
        row["device_us"] = kernel_times(lambda: program(xs))["sum_us"] / layers
    return row
