"""Where an isolated host hit's time goes, on one host clock from its `add_request` call.

    PYTHONPATH=. python3 benchmarks/host_hit_phases.py [--preset qwen2-7b] [--trials 3]
        [--prefix N]

Per trial (the `host-hit` bench's setup: the prefix computed, pushed to host, then a new turn on
it): the engine phases of the first `step()` (timed by wrapping the engine's methods), then,
polling without blocking, when the load had landed (its event) and when the sampled token was
ready on the device; the same for a device hit of the same shape. Polling adds no work to the
device; it delays the host's next step, so the step() after it is not timed.

`--write-back`: also the phases of pushing the prefix to host (`host_hit.push_to_host`: the
eviction, the gathers, their host copies, the wait), on the host clock from its start, with the
copies' own span by their device-side marks; `--profile` then profiles that push instead.
`--gather-mb` sets how many bytes a write-back gathers first, before the rest
(`TransferTuning.gather_head_bytes`; the engine's value by default; one above the write-back's
size gathers it whole).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Callable

import numpy as np

from jhicache import batch as batch_module
from jhicache import engine as engine_module
from jhicache.bench import host_hit, workload
from jhicache.bench.cli import parse_args
from jhicache.bench.command import save_json
from jhicache.cache import TransferTuning
from jhicache.sampling import SamplingParams

PHASES = (("cache", "poll"), ("scheduler", "schedule"), ("cache", "launch_loads"),
          ("cache", "finish_loads"), ("scheduler", "prefetch"), ("cache", "launch"),
          ("runner", "run"), ("", "_sample"),
          # inside the phases above
          ("scheduler", "_attach_prefix"), ("cache", "match"), ("cache", "load_back"),
          ("cache", "alloc_device"), ("cache.controller", "_plan"),
          ("cache.controller", "_blockers"), ("cache.controller", "_advance_writes"),
          ("cache.controller", "_queue_layers"), ("cache.controller.copier", "mark"))
WRITE_PHASES = (("cache", "evict_device"), ("cache", "_release_device"),
                ("cache.controller", "launch_writes"), ("cache.controller", "_gather"),
                ("cache.controller", "fence_device_pages"), ("cache.controller", "_issue_write"),
                ("cache.controller", "check_buffers"), ("cache.controller", "poll"),
                ("cache.controller", "flush"))
DRIVER_CALLS = ("copy", "write_value32", "record", "query", "stream_wait")


def instrument(engine, log: list, write_back: bool = False) -> None:
    """Wraps the phases of a step (and `model_inputs`; with `write_back`, those of a
    write-back too) to append (name, start, end)."""
    def wrap(fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            log.append((name, start, time.perf_counter()))
            return out
        return timed

    for owner, name in PHASES + (WRITE_PHASES if write_back else ()):
        obj = engine
        for part in owner.split(".") if owner else ():
            obj = getattr(obj, part)
        setattr(obj, name, wrap(getattr(obj, name), name))
    engine_module.model_inputs = wrap(engine_module.model_inputs, "model_inputs")
    for name in ("metadata_arrays", "put_int32"):  # inside model_inputs
        setattr(batch_module, name, wrap(getattr(batch_module, name), name))
    programs = engine.runner.programs
    programs._jit = programs._jit._replace(first=wrap(programs._jit.first, "first"),
                                           rest=wrap(programs._jit.rest, "rest"))


def instrument_driver(engine, calls: list) -> None:
    """Wraps the CUDA driver calls of the engine's copier to append (name, seconds)."""
    copier = engine.cache.controller.copier if engine.cache.controller else None
    driver = getattr(copier, "driver", None)
    if driver is None:
        return

    def wrap(fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            calls.append((name, time.perf_counter() - start, len(args[0]) if name == "copy"
                          else 1))
            return out
        return timed

    for name in DRIVER_CALLS:
        setattr(driver, name, wrap(getattr(driver, name), name))


def summarize(calls: list) -> dict:
    out: dict = {}
    for name, seconds, entries in calls:
        row = out.setdefault(name, {"count": 0, "entries": 0, "total_ms": 0.0, "max_ms": 0.0})
        row["count"] += 1
        row["entries"] += entries
        row["total_ms"] = round(row["total_ms"] + seconds * 1e3, 4)
        row["max_ms"] = round(max(row["max_ms"], seconds * 1e3), 4)
    return out


def traced(engine, prompt: list[int], log: list, calls: list,
           profile: cProfile.Profile | None = None) -> dict:
    log.clear()
    calls.clear()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    if profile is not None:
        profile.enable()
    engine.step()
    if profile is not None:
        profile.disable()
    returned = time.perf_counter()
    step = engine._in_flight
    tickets = step.batch.tickets
    landed = None
    while not step.sampled.is_ready():
        if landed is None and tickets and all(t.done() for t in tickets):
            landed = time.perf_counter()
    ready = time.perf_counter()
    step_calls = summarize(calls)
    while engine.has_unfinished():
        engine.step()
    ms = lambda t: None if t is None else round((t - t0) * 1e3, 3)  # noqa: E731
    return {"phases": [(n, ms(a), ms(b)) for n, a, b in log], "step_returned_ms": ms(returned),
            "load_landed_ms": ms(landed),
            "sampled_ready_ms": ms(ready), "driver_calls": step_calls, "request": rid}


def traced_write_back(engine, log: list, calls: list,
                      profile: cProfile.Profile | None = None) -> dict:
    """`host_hit.push_to_host` with its phases on the host clock from its start (ms), and its
    copies' span by their device-side marks."""
    log.clear()
    calls.clear()
    before = engine.stats()
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    seconds = host_hit.push_to_host(engine)
    if profile is not None:
        profile.disable()
    after = engine.stats()
    ms = lambda t: round((t - t0) * 1e3, 3)  # noqa: E731
    return {"phases": [(n, ms(a), ms(b)) for n, a, b in log], "end_to_end_ms": seconds * 1e3,
            "copies_ms": (after.write_back_s - before.write_back_s) * 1e3,
            "bytes": after.write_back_bytes - before.write_back_bytes,
            "driver_calls": summarize(calls)}


def block_on_busy_gpu(ms: float = 10.0) -> None:
    """Blocks the host on a chain of matmuls that keeps the default device busy about `ms`
    (sized once from a timed run)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    chain = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: (y @ x) * 1e-3, x))
    start = time.perf_counter()
    chain(x, 4).block_until_ready()
    per = (time.perf_counter() - start) / 4
    chain(x, max(1, int(ms / 1e3 / per))).block_until_ready()


class Burst:
    """`nbytes` of host->device copies between buffers of its own, in 16 MB pieces, queued on the
    engine copier's load stream."""

    def __init__(self, engine, nbytes: int) -> None:
        import jax.numpy as jnp

        from jhicache.cache.copier import Direction
        from jhicache.cache.host_memory import HostMemory
        self.copier = engine.cache.controller.copier
        self.direction = Direction.TO_DEVICE
        self.device = jnp.zeros((nbytes,), jnp.uint8)
        self.host = HostMemory(nbytes, getattr(self.copier, "driver", None))
        piece = 16 << 20
        offsets = np.arange(0, nbytes, piece, dtype=np.uint64)
        self.dsts = np.uint64(self.device.unsafe_buffer_pointer()) + offsets
        self.srcs = np.uint64(self.host.address) + offsets
        self.sizes = np.minimum(np.uint64(piece), np.uint64(nbytes) - offsets)
        self.mark = None

    def start(self) -> None:
        for dst, src, size in zip(self.dsts, self.srcs, self.sizes):
            self.copier.copy(self.direction, np.asarray([dst]), np.asarray([src]),
                             np.asarray([size]))
        self.mark = self.copier.mark(self.direction)

    def wait(self) -> None:
        self.copier.wait(self.mark)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prefix", type=int, help="cached tokens (default: the bench's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--beside-copies", type=int, default=0, metavar="MB")
    parser.add_argument("--after-wait", action="store_true")
    parser.add_argument("--write-back", action="store_true")
    parser.add_argument("--gather-mb", type=int,
                        default=TransferTuning().gather_head_bytes >> 20)
    parser.add_argument("--out")
    cli = parser.parse_args()
    profile = cProfile.Profile() if cli.profile else None
    args = parse_args(["host-hit", "--preset", cli.preset,
                       *(["--host-hit-prefix", str(cli.prefix)] if cli.prefix else [])])
    engine = host_hit.host_hit_engine(args, gather_head_bytes=cli.gather_mb << 20)
    rng = np.random.default_rng(args.seed + 1)
    host_hit.host_hit_trial(engine, rng, args)  # compiles every shape
    log: list = []
    calls: list = []
    instrument(engine, log, cli.write_back)
    instrument_driver(engine, calls)
    vocab = engine.model_config.vocab_size
    burst = Burst(engine, cli.beside_copies << 20) if cli.beside_copies else None
    out = []
    for _ in range(cli.trials):
        prefix, = workload.random_prompts(rng, vocab, 1, args.host_hit_prefix)
        turns = workload.random_prompts(rng, vocab, 3, args.host_hit_turn)
        host_hit.ttft_of(engine, prefix + turns[0])
        if cli.write_back:
            pushed = traced_write_back(engine, log, calls, profile)
        else:
            host_hit.push_to_host(engine)
        host = traced(engine, prefix + turns[1], log, calls,
                      None if cli.write_back else profile)
        device = traced(engine, prefix + turns[2], log, calls)
        out.append({"host_hit": host, "device_hit": device})
        if cli.write_back:
            out[-1]["write_back"] = pushed
        if burst is not None:
            turn, = workload.random_prompts(rng, vocab, 1, args.host_hit_turn)
            burst.start()
            out[-1]["device_hit_beside_copies"] = traced(engine, prefix + turn, log, calls)
            burst.wait()
        if cli.after_wait:
            turn, = workload.random_prompts(rng, vocab, 1, args.host_hit_turn)
            block_on_busy_gpu()
            out[-1]["device_hit_after_wait"] = traced(engine, prefix + turn, log, calls)
        print(json.dumps(out[-1]), flush=True)
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(cli.profile)
        print(text.getvalue())
    save_json(out, cli.out)


if __name__ == "__main__":
    main()
