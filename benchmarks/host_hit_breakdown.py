"""Where an isolated host hit's TTFT goes: scheduling, dispatch, GPU time, and the load alone.

    PYTHONPATH=. python3 benchmarks/host_hit_breakdown.py --preset qwen2-0.5b [--trace DIR]

For one 8k-token prefix that lives only on host plus a short new turn, it times the step's
pieces on the host (schedule, model inputs, forward dispatch, forward done) and then re-runs the
same forward with the pages already on device, fused and layer by layer, so the gap between a
host hit and a device hit can be split into dispatch overhead and exposed copy time. With
`--trace` it also writes a profiler trace of the host-hit forward and prints the GPU busy time
per stream found in it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import statistics
import time
from collections import defaultdict

import jax
import numpy as np

from jhicache import bench
from jhicache.batch import model_inputs
from jhicache.sampling import SamplingParams


def timed(fn, reps: int = 5) -> tuple[float, float]:
    """Median (dispatch seconds, completion seconds) of `fn()` returning an array."""
    dispatch, done = [], []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        done.append(time.perf_counter() - start)
    return statistics.median(dispatch), statistics.median(done)


def host_hit_step(engine, prompt: list[int], trace_dir: str | None) -> dict:
    """Runs the host-hit request's first step by hand, timing each piece, then finishes it."""
    engine._submit(np.asarray(prompt), SamplingParams(max_new_tokens=1), None, time.perf_counter())
    t0 = time.perf_counter()
    batch = engine.scheduler.schedule()
    engine.cache.launch()
    t1 = time.perf_counter()
    tokens, meta, last_index, _ = model_inputs(batch, engine.config.page_size)
    t2 = time.perf_counter()
    if trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    result = engine.runner.run(tokens, meta, last_index, batch.tickets)
    t3 = time.perf_counter()
    if result.timeline is None:
        raise SystemExit("the prefix was not on host: the step ran fused, with no load to time")
    timing = result.timeline.measure()
    result.logits.block_until_ready()
    t4 = time.perf_counter()
    if trace_dir:
        jax.profiler.stop_trace()
    row = {"tickets": len(batch.tickets), "schedule_s": t1 - t0, "inputs_s": t2 - t1,
           "forward_dispatch_s": t3 - t2, "forward_done_s": t4 - t2, "ticket_wait_s": result.load_wait_s,
           "load_s": timing.load_s, "load_exposed_s": timing.exposed_s}
    launched = result.timeline.launched_at  # per group, from launch: its copies landed / pages placed / compute ended
    row["groups_landed_ms"] = [round((result.timeline.landed_at.get(g, launched) - launched) * 1e3, 2)
                               for g in range(len(engine.runner.groups))]
    row["groups_placed_ms"] = [round((result.timeline.placed_at.get(g, launched) - launched) * 1e3, 2)
                               for g in range(len(engine.runner.groups))]
    row["groups_computed_ms"] = [round((at - launched) * 1e3, 2) for at in result.timeline.computed_at]
    row["forward_start_after_launch_s"] = t2 - launched
    runner = engine.runner
    row["fused_dispatch_s"], row["fused_done_s"] = timed(lambda: runner._fused(tokens, meta, last_index))
    row["layered_dispatch_s"], row["layered_done_s"] = timed(
        lambda: runner._layered(tokens, meta, last_index, ()).logits)
    ids = np.asarray(result.logits.argmax(-1))
    engine.scheduler.commit(batch, ids, time.perf_counter())
    while engine.has_unfinished():
        engine.step()
    engine._drain()
    return row


def gpu_busy(trace_dir: str) -> dict:
    """Busy seconds per GPU stream and the span of all GPU events, from the perfetto trace."""
    files = sorted(pathlib.Path(trace_dir).rglob("*perfetto_trace.json.gz"))
    if not files:
        return {}
    events = json.load(gzip.open(files[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    busy: dict[str, float] = defaultdict(float)
    lo, hi = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or "GPU" not in procs.get(e["pid"], ""):
            continue
        busy[f"{procs[e['pid']]} / {names.get((e['pid'], e.get('tid')), e.get('tid'))}"] += e["dur"] / 1e6
        lo, hi = min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])
    return {"gpu_span_s": (hi - lo) / 1e6 if busy else 0.0, "busy_s": dict(busy)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prefix", type=int, default=8192)
    p.add_argument("--turn", type=int, default=64)
    p.add_argument("--transfer-path", default="segments")
    p.add_argument("--trace", default=None)
    a = p.parse_args()
    args = bench.parse_args(["host-hit", "--preset", a.preset, "--host-hit-prefix", str(a.prefix),
                             "--host-hit-turn", str(a.turn), "--transfer-path", a.transfer_path])
    tokens = 4 * (a.prefix + a.turn + 2 * args.page_size)
    engine = bench.make_engine(args, cache_mode="hierarchical", device_kv_tokens=tokens, load_back_threshold=1)
    rng = np.random.default_rng(7)
    bench.host_hit_trial(engine, rng, args)  # compiles every shape
    for trial in range(2):
        vocab = engine.model_config.vocab_size
        prefix = bench.random_prompts(rng, vocab, 1, a.prefix)[0]
        turns = bench.random_prompts(rng, vocab, 2, a.turn)
        engine.generate([prefix + turns[0]], SamplingParams(max_new_tokens=1))
        bench.push_to_host(engine)
        row = host_hit_step(engine, prefix + turns[1], a.trace if trial == 1 else None)
        print(json.dumps({k: round(v * 1e3, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if a.trace:
        print(json.dumps(gpu_busy(a.trace), indent=1))


if __name__ == "__main__":
    main()
