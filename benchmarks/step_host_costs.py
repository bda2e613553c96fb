r"""Host (Python) time of one engine step's plan: `scheduler.schedule()` and `model_inputs()`.

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python benchmarks/step_host_costs.py \
        [--repeats 20] [--top 25]

Three steps, each rebuilt and timed `--repeats` times (no forward runs; cache contents are zeros,
only page bookkeeping matters here):
  host-hit        one request: an 8k-token prefix cached on host only + a 64-token turn (load-back).
  batch-prefill   16 requests admitted together: 4 shared 1k-token system prefixes, each with its
                  own 1k-token history on device, + a 64-token turn; the device pool is filled with
                  other conversations, so admission must evict (as in the multi-turn bench).
  batch-decode    the same 16 requests decoding one token each.
It prints the median host milliseconds of each call (and of the transfer launches inside
`schedule()`: write-backs forced by eviction, the load-back) and, with `--top`, a cProfile of
each (cumulative, over all repeats). On the CPU the JAX dispatch costs differ from the GPU's; the
Python-side costs (tree walks, per-page loops, list/array conversions) carry over.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from jhicache.models import init_random, preset_config

from jhicache.batch import Batch, model_inputs
from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.request import Request
from jhicache.sampling import SamplingParams

PAGE_SIZE = 64
PREFIX, TURN = 8192, 64
BATCH, SYSTEM_PREFIXES, SYSTEM_LEN, HISTORY_LEN = 16, 4, 1024, 1024
FILLERS = 48  # other cached conversations of SYSTEM_LEN + HISTORY_LEN tokens, all evictable


class Recorder:
    """Median wall time and one cProfile per named call."""

    def __init__(self, profile: bool) -> None:
        self.times: dict[str, list[float]] = {}
        self.profiles: dict[str, cProfile.Profile] = {}
        self.profile = profile

    def call(self, name: str, fn: Callable[[], Any]) -> Any:
        prof = self.profiles.setdefault(name, cProfile.Profile()) if self.profile else None
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = fn()
        if prof is not None:
            prof.disable()
        self.times.setdefault(name, []).append(time.perf_counter() - start)
        return out


def make_engine(model, device_tokens: int) -> Engine:
    config = EngineConfig(page_size=PAGE_SIZE, dtype="float32", device_kv_tokens=device_tokens,
                          cache_mode="hierarchical", load_back_threshold=1)
    return Engine(model, config)


def cache_tokens(engine: Engine, tokens: list[int]) -> None:
    """Puts `tokens` (page-aligned) in the cache as a finished request would (scheduler._finish)."""
    cache = engine.cache
    match = cache.match(tokens)
    pages = match.device_pages + cache.alloc_device(len(tokens) // PAGE_SIZE
                                                    - len(match.device_pages))
    known = cache.insert(tokens, pages)
    cache.free_device(pages[match.device_len // PAGE_SIZE: known // PAGE_SIZE])


def push_to_host(engine: Engine) -> None:
    """As bench/host_hit.py: evict every unlocked device page (writing back) and wait for the
    copies."""
    engine.cache.evict_device(engine.cache.evictable_device_pages)
    engine.cache.flush()


def add_request(engine: Engine, prompt: list[int]) -> Request:
    return engine._submit(np.asarray(prompt), SamplingParams(max_new_tokens=64), None,
                          time.perf_counter())


def drop_all(engine: Engine) -> None:
    """Releases every running request (retract) and empties the queue; finishes pending loads."""
    sched = engine.scheduler
    for req in list(sched.running):
        sched.retract(req)
    sched.waiting.clear()
    engine._requests.clear()
    engine.cache.flush()
    engine.cache.poll()


def time_launches(engine: Engine) -> list[float]:
    """Wraps the controller's launches (instance attributes) so that the part of `schedule()`
    spent dispatching transfers (segment_transfer.py, not scheduling) can be told apart."""
    spent = [0.0]
    controller = engine.cache.controller
    for name in ("launch_writes", "launch_loads"):
        def timed(fn=getattr(controller, name)) -> None:
            start = time.perf_counter()
            fn()
            spent[0] += time.perf_counter() - start
        setattr(controller, name, timed)
    return spent


def step_inputs(rec: Recorder, engine: Engine, spent: list[float], name: str) -> Batch:
    """Times one schedule() (`spent`: from time_launches(engine)) and the batch's model_inputs()."""
    spent[0] = 0.0
    def schedule() -> Batch | None:  # as Engine._step: plan, then launch what it queued
        batch = engine.scheduler.schedule()
        engine.cache.launch()
        return batch

    batch = rec.call(f"{name}: schedule", schedule)
    rec.times.setdefault(f"{name}: (launches in it)", []).append(spent[0])
    assert batch is not None
    rec.call(f"{name}: model_inputs", lambda: model_inputs(batch, PAGE_SIZE))
    return batch


def host_hit(rec: Recorder, model, repeats: int, rng: np.random.Generator) -> None:
    engine = make_engine(model, 4 * (PREFIX + TURN + 2 * PAGE_SIZE))
    vocab = engine.model_config.vocab_size
    prefix = rng.integers(0, vocab, PREFIX).tolist()
    cache_tokens(engine, prefix)
    push_to_host(engine)
    spent = time_launches(engine)
    for _ in range(repeats + 1):  # the first run compiles the load's programs
        add_request(engine, prefix + rng.integers(0, vocab, TURN).tolist())
        batch = step_inputs(rec, engine, spent, "host-hit")
        assert batch.tickets, "expected a load-back"
        drop_all(engine)
        push_to_host(engine)
    engine.check_invariants()


def batch_prompts(rng: np.random.Generator, vocab: int, count: int) -> list[list[int]]:
    systems = [rng.integers(0, vocab, SYSTEM_LEN).tolist() for _ in range(SYSTEM_PREFIXES)]
    return [systems[i % SYSTEM_PREFIXES] + rng.integers(0, vocab, HISTORY_LEN).tolist()
            for i in range(count)]


def batch_steps(rec: Recorder, model, repeats: int, rng: np.random.Generator,
                decode_steps: int) -> None:
    """A fresh engine per repeat: admission evicts fillers, so the state changes."""
    for _ in range(repeats + 1):
        # Exactly the cached pages: every new page of the step comes from evicting a filler.
        engine = make_engine(model, SYSTEM_PREFIXES * SYSTEM_LEN + (BATCH + FILLERS) * HISTORY_LEN)
        vocab = engine.model_config.vocab_size
        histories = batch_prompts(rng, vocab, BATCH + FILLERS)
        for prompt in histories[BATCH:] + histories[:BATCH]:  # fillers first: least recently used
            cache_tokens(engine, prompt)
        for history in histories[:BATCH]:
            add_request(engine, history + rng.integers(0, vocab, TURN).tolist())
        spent = time_launches(engine)
        batch = step_inputs(rec, engine, spent, "batch-prefill")
        assert len(batch.chunks) == BATCH and not batch.is_decode
        for _ in range(decode_steps):
            engine.scheduler.commit(batch, np.ones(len(batch.chunks), np.int32),
                                    time.perf_counter())
            batch = step_inputs(rec, engine, spent, "batch-decode")
            assert batch.is_decode and len(batch.chunks) == BATCH
        drop_all(engine)
        engine.check_invariants()


def report(rec: Recorder, top: int) -> None:
    for name, times in rec.times.items():
        print(f"{name:36s} median {statistics.median(times[1:]) * 1e3:8.3f} ms  "
              f"(min {min(times[1:]) * 1e3:.3f}, n={len(times) - 1})")
    for name, prof in rec.profiles.items() if top else ():
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        print(f"\n==== {name} (cProfile, cumulative, all runs) ====")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=0,
                   help="print a cProfile top-N per call (0: timing only)")
    a = p.parse_args()
    model = init_random(preset_config(a.preset), seed=0)
    rng = np.random.default_rng(0)
    # Timing and profiling are separate passes: cProfile's overhead would skew the medians.
    rec = Recorder(profile=False)
    host_hit(rec, model, a.repeats, rng)
    batch_steps(rec, model, a.repeats, rng, a.decode_steps)
    report(rec, 0)
    if a.top:
        prof = Recorder(profile=True)
        host_hit(prof, model, a.repeats, rng)
        batch_steps(prof, model, a.repeats, rng, a.decode_steps)
        report(prof, a.top)


if __name__ == "__main__":
    main()
