"""How long an engine takes to start and warm up, by phase, and whether serving after it compiles.

    python benchmarks/warmup_time.py --preset qwen2-7b --compilation-cache /tmp/jcc --out r.json

Builds the engine (weights, pools), runs `Engine.warmup()` (with JAX's persistent compilation
cache in the given directory: run it twice for a cold and a warm start), then serves a burst of
prompts of random lengths up to the context limit under `fail_on_compile`, greedy and sampled,
and reports the compiles that burst made (0, or it raises) and the wall times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from jhicache import Engine, EngineConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2-7b")
    p.add_argument("--compilation-cache", default=None)
    p.add_argument("--max-context-len", type=int, default=32768)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    start = time.perf_counter()
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    config = EngineConfig(fail_on_compile=True, max_context_len=args.max_context_len)
    engine = Engine.from_preset(args.preset, config)
    report = engine.warmup()
    ready = time.perf_counter() - start
    rng = np.random.default_rng(0)
    limit, vocab = engine.grid.max_context_len, engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, int(n)).tolist()
               for n in rng.integers(1, min(limit, 12000) - 64, args.requests)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 64)),
                             temperature=float(i % 2), seed=i) for i in range(len(prompts))]
    served = time.perf_counter()
    engine.generate(prompts, params)
    served = time.perf_counter() - served
    stats = engine.stats()
    result = {"preset": args.preset, "backend": jax.default_backend(),
              "grid": engine.grid.describe(), "weights_s": engine.startup.weights_s,
              "pools_s": engine.startup.pools_s, "warmup": dataclasses.asdict(report),
              "start_to_ready_s": ready, "burst_requests": len(prompts), "burst_s": served,
              "compiles_warmup": stats.compiles_warmup,
              "compiles_serving": stats.compiles_serving}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
