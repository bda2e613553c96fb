"""Where an isolated host hit's time goes, on one host clock from its `add_request` call.

    PYTHONPATH=. python3 benchmarks/host_hit_phases.py [--preset qwen2-7b] [--trials 3]

Per trial (the `host-hit` bench's setup: the prefix computed, pushed to host, then a new turn on
it): the engine phases of the first `step()` (timed by wrapping the engine's methods), then,
polling without blocking, when the load had landed (its event) and when the sampled token was
ready on the device; the same for a device hit of the same shape. Polling adds no work to the
device; it delays the host's next step, so the step() after it is not timed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from jhicache import bench
from jhicache import engine as engine_module
from jhicache.sampling import SamplingParams

PHASES = (("cache", "poll"), ("scheduler", "schedule"), ("cache", "launch_loads"),
          ("scheduler", "prefetch"), ("cache", "launch"), ("runner", "run"), ("", "_sample"))


def instrument(engine, log: list) -> None:
    """Wraps the phases of a step (and `model_inputs`) to append (name, start, end)."""
    def wrap(fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            log.append((name, start, time.perf_counter()))
            return out
        return timed

    for owner, name in PHASES:
        obj = getattr(engine, owner) if owner else engine
        setattr(obj, name, wrap(getattr(obj, name), name))
    engine_module.model_inputs = wrap(engine_module.model_inputs, "model_inputs")


def traced(engine, prompt: list[int], log: list) -> dict:
    log.clear()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    engine.step()
    returned = time.perf_counter()
    step = engine._in_flight
    tickets = step.batch.tickets
    landed = None
    while not step.sampled.is_ready():
        if landed is None and tickets and all(t.done() for t in tickets):
            landed = time.perf_counter()
    ready = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    ms = lambda t: None if t is None else round((t - t0) * 1e3, 3)  # noqa: E731
    return {"phases": [(n, ms(a), ms(b)) for n, a, b in log], "step_returned_ms": ms(returned),
            "load_landed_ms": ms(landed),
            "sampled_ready_ms": ms(ready), "request": rid}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out")
    cli = parser.parse_args()
    args = bench.parse_args(["host-hit", "--preset", cli.preset])
    tokens = 4 * (args.host_hit_prefix + args.host_hit_turn + 2 * args.page_size)
    engine = bench.make_engine(args, cache_mode="hierarchical", device_kv_tokens=tokens,
                               load_back_threshold=1)
    rng = np.random.default_rng(args.seed + 1)
    bench.host_hit_trial(engine, rng, args)  # compiles every shape
    log: list = []
    instrument(engine, log)
    vocab = engine.model_config.vocab_size
    out = []
    for _ in range(cli.trials):
        prefix, = bench.random_prompts(rng, vocab, 1, args.host_hit_prefix)
        turns = bench.random_prompts(rng, vocab, 3, args.host_hit_turn)
        bench.ttft_of(engine, prefix + turns[0])
        bench.push_to_host(engine)
        host = traced(engine, prefix + turns[1], log)
        device = traced(engine, prefix + turns[2], log)
        out.append({"host_hit": host, "device_hit": device})
        print(json.dumps(out[-1]), flush=True)
    if cli.out:
        with open(cli.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
