"""How much of an engine step is GPU time? An engine step, timed end to end, against the same
step's jitted programs dispatched back to back on the same inputs (the host hidden behind them).

    PYTHONPATH=. python3 benchmarks/step_vs_forward.py --preset qwen2-7b [--out FILE.json]

Rows, each with overlap scheduling on and off:
- decode: 8 requests of 512 prompt tokens decoding (context ~550 tokens); engine time per step.
- device hit: a 64-token turn over an 8192-token (--prefix) prefix cached on device; engine TTFT
  (median).
"Forward alone" reaches into the engine (scheduler, runner, model_inputs): a measurement, not
an API. It runs the model programs only; the engine step also samples and reads the tokens back.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.rows import Rule, Target, page_row
from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.batch import model_inputs
from jhicache.bench.command import save_json
from jhicache.sampling import greedy


def forward_alone_ms(engine: Engine, n: int) -> float:
    """Plans one more batch and dispatches its forward `n` times back to back."""
    batch = engine.scheduler.schedule()
    assert batch is not None
    inputs = model_inputs(batch, engine.grid, engine.load_flags)
    run = lambda: engine.runner.run(inputs.tokens, inputs.meta,  # noqa: E731
                                    inputs.last_index)
    jax.block_until_ready(run())
    start = time.perf_counter()
    out = [run() for _ in range(n)]
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n * 1e3


def decode_row(preset: str, overlap: bool, batch: int, rng: np.random.Generator) -> dict:
    engine = Engine.from_preset(preset, EngineConfig(cache_mode="device", device_kv_tokens=65536,
                                                     page_size=64, overlap_schedule=overlap))
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        engine.add_request(rng.integers(0, vocab, 512).tolist(), SamplingParams(max_new_tokens=400))
    for _ in range(40):  # prefill, compiles, and decode to ~550 tokens of context
        engine.step()
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    step_ms = (time.perf_counter() - start) / n * 1e3
    return {"engine_step_ms": step_ms, "forward_alone_ms": forward_alone_ms(engine, n)}


def device_hit_row(preset: str, overlap: bool, prefix_len: int, rng: np.random.Generator) -> dict:
    engine = Engine.from_preset(preset, EngineConfig(cache_mode="device", device_kv_tokens=65536,
                                                     page_size=64, overlap_schedule=overlap))
    vocab = engine.model_config.vocab_size
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    turn = lambda: prefix + rng.integers(0, vocab, 64).tolist()  # noqa: E731
    engine.generate([turn()], SamplingParams(max_new_tokens=1))
    ttfts = [engine.generate([turn()], SamplingParams(max_new_tokens=1))[0].ttft_s * 1e3
             for _ in range(8)]
    phases = [ttft_phases_ms(engine, turn()) for _ in range(5)]
    engine.add_request(turn(), SamplingParams(max_new_tokens=1))
    return {"engine_ttft_ms": statistics.median(ttfts[1:]),
            "forward_alone_ms": forward_alone_ms(engine, 10),
            "host_phases_ms": {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]}}


def ttft_phases_ms(engine: Engine, prompt: list[int]) -> dict[str, float]:
    """One device-hit request's first step by hand, as Engine._step runs it, timed per phase."""
    marks = [time.perf_counter()]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    marks.append(time.perf_counter())
    with engine.cache.step() as transfers:
        batch = engine.scheduler.schedule()
        gate = transfers.start_loads(batch.tickets)
    marks.append(time.perf_counter())
    inputs = model_inputs(batch, engine.grid, engine.load_flags, gate)
    marks.append(time.perf_counter())
    logits = engine.runner.run(inputs.tokens, inputs.meta, inputs.last_index)
    marks.append(time.perf_counter())
    sampled = greedy(logits, rows=engine.grid.max_requests)  # the request is greedy
    marks.append(time.perf_counter())
    np.asarray(sampled)
    marks.append(time.perf_counter())
    engine.abort(rid)
    names = ("submit", "schedule", "model_inputs", "forward_dispatch", "sample_dispatch",
             "device_wait")
    return {name: (b - a) * 1e3 for name, a, b in zip(names, marks, marks[1:])}


def step_target(args: argparse.Namespace, case: str) -> Target:
    """The engine's step over its forward alone: 1.1x for a decode step and 1.15x for a device
    hit, looser for a model as small as 0.5B (1.3x, 1.4x), whose forward the host's work rivals."""
    small = "0.5b" in args.preset.lower()
    bound = {("decode", False): 1.1, ("decode", True): 1.3,
             ("device_hit", False): 1.15, ("device_hit", True): 1.4}[case, small]
    return Target(f"{bound}x", (Rule("ratio", "ratio", at_most=bound),))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2-7b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefix", type=int, default=8192, help="device-hit prefix tokens")
    p.add_argument("--no-decode", action="store_true", help="only the device-hit rows")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    result: dict = {"preset": args.preset, "device": jax.devices()[0].device_kind}
    for overlap in (True, False):
        key = "overlap" if overlap else "lock_step"
        result[key] = {"device_hit": device_hit_row(args.preset, overlap, args.prefix, rng)}
        if not args.no_decode:
            d = result[key]["decode"] = decode_row(args.preset, overlap, args.batch, rng)
            print(f"{args.preset} {key}: decode batch {args.batch} step {d['engine_step_ms']:.2f} "
                  f"ms vs forward alone {d['forward_alone_ms']:.2f} ms "
                  f"({d['engine_step_ms'] / d['forward_alone_ms']:.2f}x)", flush=True)
        h = result[key]["device_hit"]
        print(f"{args.preset} {key}: device hit {args.prefix}+64 TTFT {h['engine_ttft_ms']:.2f} ms "
              f"vs forward alone {h['forward_alone_ms']:.2f} ms "
              f"({h['engine_ttft_ms'] / h['forward_alone_ms']:.2f}x)", flush=True)
        print("  device-hit first step by phase (ms, median): "
              + ", ".join(f"{k} {v:.2f}" for k, v in h["host_phases_ms"].items()), flush=True)
    result["page_rows"] = {
        f"step_vs_forward_{case}": page_row("step_vs_forward", [result],
                                            {"case": case, "key": key}, step_target(args, case))
        for case, key in (("decode", "engine_step_ms"), ("device_hit", "engine_ttft_ms"))
        if case in result["overlap"]}
    save_json(result, args.out)


if __name__ == "__main__":
    main()
