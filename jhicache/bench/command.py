"""`python -m jhicache.bench`: model throughput, the multi-turn cache benchmark, and host-hit TTFT.

With no arguments it runs everything on the `tiny` preset at CPU-sized defaults (under two
minutes without a GPU). `kernels` runs the kernel benchmark (`jhicache.bench.kernels`) instead.
`multiturn --url URL` drives a running server's POST /generate instead of an engine in this
process; `serve-overhead` runs the multi-turn workload through the server (uvicorn in this
process) and in process, on identically configured engines, and reports the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import enum
import gc
import importlib.util
import json
import math
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients, report
from jhicache.bench.backends import EngineBackend, ServerError
from jhicache.bench.workload import MultiTurnSpec, output_lengths, user_turns
from jhicache.config import EngineConfig, KVDtype, WritePolicy
from jhicache.engine import Engine
from jhicache.models.config import PRESETS, preset_config
from jhicache.models.qwen2_weights import CONFIG_FILE
from jhicache.sampling import SamplingParams

# unbounded: the device cache holding the whole working set
MODES = ("off", "device", "hierarchical", "unbounded")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _parsed(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _parsed(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _parsed(float, text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def range_ratio(text: str) -> float:
    value = _parsed(float, text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def request_rate(text: str) -> float:
    """argparse type: requests/s, a number > 0 or `inf` (every ready request at once)."""
    value = _parsed(float, text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0, or inf")
    return value


def _parsed(kind: type[int] | type[float], text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def preset_name(text: str) -> str:
    """argparse type: the PRESETS key that `text` names under preset_config's spelling rules
    (any case, an optional `Qwen/`), so that `choices` accepts what the engine accepts."""
    try:
        config = preset_config(text)
    except ValueError:
        return text  # not a preset: `choices` rejects it and lists the presets
    return next(name for name, preset in PRESETS.items() if preset is config)


def checkpoint_dir(text: str) -> str:
    """argparse type: a directory holding a Hugging Face config.json."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not (Path(text) / CONFIG_FILE).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no {CONFIG_FILE}")
    return text


def output_file(text: str) -> str:
    """argparse type: a file path whose folder exists (checked now, not after an hour's run)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
    return text


def server_url(text: str) -> str:
    """argparse type: a server's base URL, http(s)://HOST[:PORT], without a trailing slash."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # for its ValueError: a port that is not a number, or out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT (or https://)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r}: expected the server's base URL, "
                                         "http://HOST:PORT, with no path")
    return f"{parts.scheme}://{parts.netloc}"


class Given(argparse.Action):
    """argparse's "store", which also adds the option to `given`: a default cannot tell
    whether the user asked for a value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = namespace.given | {self.option_strings[0]}


# What configures the bench's own engine: with --url the server's flags do instead.
ENGINE_OPTIONS = ("--weights", "--dtype", "--page-size", "--working-set-ratio",
                  "--device-kv-tokens", "--write-policy", "--max-running-requests",
                  "--chunked-prefill-tokens")


def mode_list(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated MODES, at least one, none twice."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        choices = ", ".join(MODES)
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {choices}")
    if not modes:
        raise argparse.ArgumentTypeError(f"no mode given; choose from {', '.join(MODES)}")
    if len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"{text!r} names a mode twice")
    return modes


def build_parser() -> argparse.ArgumentParser:
    """The command line; sizes default to GPU- or CPU-sized values by the JAX backend."""
    gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(
        prog="python -m jhicache.bench", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Size defaults shown are for this machine's JAX backend ({jax.default_backend()}); "
               "a GPU gets larger ones.")
    p.set_defaults(given=frozenset())
    p.add_argument("what", nargs="?", default="all",
                   choices=("all", "model", "multiturn", "host-hit", "kernels", "serve-overhead"),
                   help="which benchmark; `all` = model + multiturn + host-hit; serve-overhead: "
                        "multiturn through the HTTP server and in process, side by side")
    p.add_argument("--url", type=server_url, metavar="URL", default=None,
                   help="multiturn: drive the server at http://HOST:PORT (POST /generate, token "
                        "ids) instead of an engine here, once, as the server was started; its "
                        "vocabulary from /get_model_info, else --preset's")
    p.add_argument("--preset", type=preset_name, default="tiny", choices=tuple(PRESETS),
                   help="model shape, with seeded random weights")
    p.add_argument("--weights", action=Given, type=checkpoint_dir, metavar="DIR", default=None,
                   help="Hugging Face Qwen2 checkpoint directory (overrides --preset)")
    p.add_argument("--dtype", action=Given, default="bfloat16" if gpu else "float32",
                   choices=_values(KVDtype), help="weights and KV pages dtype")
    count = {"type": positive_int, "metavar": "N"}
    p.add_argument("--page-size", action=Given, **count, default=64 if gpu else 16,
                   help="tokens per KV page")
    p.add_argument("--clients", **count, default=32 if gpu else 4,
                   help="multiturn: concurrent conversations")
    p.add_argument("--rounds", **count, default=6 if gpu else 3,
                   help="multiturn: turns per conversation")
    p.add_argument("--request-length", **count, default=1024 if gpu else 48,
                   help="multiturn: new prompt tokens per turn")
    p.add_argument("--output-length", **count, default=16 if gpu else 4,
                   help="multiturn: generated tokens per turn")
    p.add_argument("--range-ratio", type=range_ratio, metavar="R", default=1.0,
                   help="multiturn: each turn's request and output lengths drawn uniformly "
                        "from [R x length, length] (SGLang's --range-ratio); 1: fixed")
    p.add_argument("--max-running-requests", action=Given, **count, default=64 if gpu else 8,
                   help="requests an engine runs at once (its grid's largest batch)")
    p.add_argument("--chunked-prefill-tokens", action=Given, **count,
                   default=4096 if gpu else 128,
                   help="prompt tokens an engine computes per step (its grid's largest prefill)")
    p.add_argument("--working-set-ratio", action=Given, type=positive_float, metavar="X",
                   default=4.0, help="multiturn: final working set / device pool capacity")
    p.add_argument("--device-kv-tokens", action=Given, **count, default=None,
                   help="multiturn: device pool tokens; unset, from --working-set-ratio")
    p.add_argument("--modes", action=Given, type=mode_list, metavar="LIST",
                   default=",".join(MODES),
                   help="multiturn cache modes, comma separated; serve-overhead runs "
                        "hierarchical unless they are given")
    p.add_argument("--request-rate", type=request_rate, metavar="R", default=math.inf,
                   help="multiturn: Poisson arrivals, requests/s (inf: no gap between sends)")
    p.add_argument("--max-parallel", **count, default=None,
                   help="multiturn: most requests in flight; unset, --clients")
    p.add_argument("--ready-queue-policy", default="fifo", choices=clients.POLICIES,
                   help="multiturn: which ready client sends next: the oldest, or one at random")
    p.add_argument("--round-barrier", default="on", choices=("on", "off"),
                   help="multiturn: on, every client ends round r before any starts r + 1; "
                        "off, a client's next turn is ready once its answer arrives")
    p.add_argument("--write-policy", action=Given, default=WritePolicy.WRITE_BACK.value,
                   choices=_values(WritePolicy),
                   help="when device pages are copied to the host tier")
    p.add_argument("--host-hit-prefix", **count, default=8192 if gpu else 256,
                   help="host-hit: cached prefix tokens")
    p.add_argument("--host-hit-turn", **count, default=64 if gpu else 16,
                   help="host-hit: new turn tokens")
    p.add_argument("--host-hit-trials", **count, default=5 if gpu else 1,
                   help="host-hit: measured trials (after a warm-up one); the figures printed "
                        "are the median trial's by the host-hit ratio")
    p.add_argument("--seed", type=non_negative_int, metavar="N", default=0,
                   help="seed of the random weights and the prompts")
    p.add_argument("--out", type=output_file, metavar="FILE", default=None,
                   help="write the results as JSON here")
    p.add_argument("--plot", type=output_file, metavar="FILE", default=None,
                   help="save a PNG of TTFT and hit rate per round of multiturn (needs matplotlib)")
    return p


def _values(enum_type: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(member.value for member in enum_type)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_combination(p, args)
    return args


def check_combination(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors that involve more than one option, before anything runs."""
    if args.plot and args.what not in ("multiturn", "all"):
        p.error("--plot draws the multiturn benchmark; use it with `multiturn` or `all`")
    check_url(p, args)
    if args.what == "serve-overhead":
        missing = [m for m in ("fastapi", "uvicorn", "httpx")
                   if importlib.util.find_spec(m) is None]
        if missing:
            p.error(f"serve-overhead needs {', '.join(missing)}: pip install -e '.[serve]'")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")
    if args.page_size > EngineConfig.chunked_prefill_tokens:
        p.error(f"--page-size {args.page_size}: at most the engine's prefill chunk "
                f"({EngineConfig.chunked_prefill_tokens} tokens)")
    if args.device_kv_tokens is not None and args.device_kv_tokens < 2 * args.page_size:
        p.error(f"--device-kv-tokens {args.device_kv_tokens}: the device pool must hold two pages "
                f"(2 x --page-size = {2 * args.page_size} tokens)")
    try:  # the engine's own rules, should they grow past the checks above
        engine_config(args, device_kv_tokens=args.device_kv_tokens)
    except ValueError as e:
        p.error(str(e))


def check_url(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--url: multiturn only, and none of the options that configure an engine here."""
    if args.url is None:
        return
    if args.what != "multiturn":
        p.error("--url drives the multi-turn clients against a server: use it with `multiturn`")
    if "--modes" in args.given:
        p.error("--modes does not apply with --url: the server serves the cache mode it was "
                "started with (its own --cache-mode), and the workload runs once against it")
    engine_options = [o for o in ENGINE_OPTIONS if o in args.given]
    if engine_options:
        p.error(f"{', '.join(engine_options)} configure(s) an engine in this process; with --url "
                "the server's own flags do (give them to `python -m jhicache.serve`)")
    if importlib.util.find_spec("httpx") is None:
        p.error("--url needs httpx: pip install -e '.[serve]'")


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, dtype=args.dtype, write_policy=args.write_policy,
                        max_running_requests=args.max_running_requests,
                        chunked_prefill_tokens=args.chunked_prefill_tokens, **overrides)


def make_engine(args: argparse.Namespace, **overrides) -> Engine:
    if overrides.get("device_kv_tokens"):  # pools hold whole pages: round a derived size up
        tokens, page = overrides["device_kv_tokens"], args.page_size
        overrides["device_kv_tokens"] = -(-tokens // page) * page
    config = engine_config(args, **overrides)
    if args.weights:
        return Engine.from_pretrained(args.weights, config)
    return Engine.from_preset(args.preset, config, seed=args.seed)


def random_prompts(rng: np.random.Generator, vocab: int, count: int,
                   length: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]


# ---- model throughput ----------------------------------------------------------------------

def bench_model(args: argparse.Namespace) -> dict:
    """Prefill and decode tokens/s of the model alone (cache off), after a warm-up run."""
    prompt_len, batch = (512, 8) if jax.default_backend() == "gpu" else (64, 4)
    new_tokens = 32 if jax.default_backend() == "gpu" else 8
    engine = make_engine(args, cache_mode="off",
                         device_kv_tokens=4 * batch * (prompt_len + new_tokens + args.page_size))
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    engine.generate(random_prompts(rng, vocab, batch, prompt_len),
                    SamplingParams(max_new_tokens=new_tokens))
    before = engine.stats().as_dict()
    engine.generate(random_prompts(rng, vocab, batch, prompt_len),
                    SamplingParams(max_new_tokens=new_tokens))
    after = engine.stats().as_dict()
    delta = {k: after[k] - before[k] for k in ("computed_prompt_tokens", "prefill_forward_s",
                                               "decode_tokens", "decode_forward_s")}
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "prefill_tokens_per_s": delta["computed_prompt_tokens"] / delta["prefill_forward_s"],
        "decode_tokens_per_s": delta["decode_tokens"] / delta["decode_forward_s"],
    }


# ---- multi-turn ----------------------------------------------------------------------------

def multiturn_spec(args: argparse.Namespace, vocab: int) -> MultiTurnSpec:
    return MultiTurnSpec(num_clients=args.clients, num_rounds=args.rounds,
                         request_length=args.request_length, output_length=args.output_length,
                         vocab_size=vocab, seed=args.seed, range_ratio=args.range_ratio)


def device_tokens_for(args: argparse.Namespace, spec: MultiTurnSpec) -> int:
    """Device pool: the working set / ratio, but room for at least two full conversations."""
    if args.device_kv_tokens:
        return args.device_kv_tokens
    by_ratio = int(spec.working_set_tokens / args.working_set_ratio)
    floor = 2 * (spec.final_context_tokens + 2 * args.page_size)
    return max(by_ratio, floor)


# How a run's clients reach a fresh engine: in process (drive_in_process) or through a server.
Drive = Callable[[Engine, MultiTurnSpec, clients.ClientsConfig, tqdm], clients.ClientsRun]


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """The measured (second) run of a mode, the engine it ran on, and the XLA compiles this
    process did during it (a shape the warm-up run did not meet: its seconds count as latency)."""

    run: clients.ClientsRun
    engine: Engine
    device_kv_tokens: int
    compiles: int
    compile_s: float
    compiled: tuple[str, ...]  # the programs, as CompileCounter names them


# jax.monitoring's event for one XLA backend compile (jax._src.dispatch.BACKEND_COMPILE_EVENT)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts this process's XLA compiles (any thread) while the `with` block runs, and names
    the programs compiled (the event's `fun_name`, where JAX gives one)."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self.programs: list[str] = []
        self._lock = threading.Lock()

    def _heard(self, event: str, duration_s: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration_s
                self.programs.append(f"{kwargs.get('fun_name', '?')} ({duration_s:.2f} s)")

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._heard)
        return self

    def __exit__(self, *exc_info: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._heard)


def mode_engine(args: argparse.Namespace, spec: MultiTurnSpec, mode: str) -> tuple[str, int]:
    """The engine's cache mode and device pool tokens for a bench mode."""
    cache_mode, device_tokens = mode, args._device_tokens
    # the reference for hit rates: what reuse a big enough device pool gives
    if mode == "unbounded":
        margin = spec.num_clients * 2 * args.page_size  # each conversation's partial last pages
        cache_mode, device_tokens = "device", max(device_tokens, spec.working_set_tokens + margin)
    return cache_mode, device_tokens


def measured_run(args: argparse.Namespace, spec: MultiTurnSpec, mode: str, progress: tqdm,
                 drive: Drive | None = None) -> MeasuredRun:
    """Runs the workload once through `drive` (in process by default) on a fresh engine that
    `Engine.warmup()` compiled, as a server does before it serves; counts the compiles the run
    made (0 when the grid covers every step)."""
    cache_mode, device_tokens = mode_engine(args, spec, mode)
    # Requests no longer than the workload's: the page tables (and the grid) fit it
    longest = -(-spec.final_context_tokens // args.page_size) * args.page_size
    engine = make_engine(args, cache_mode=cache_mode, device_kv_tokens=device_tokens,
                         max_context_len=longest)
    engine.warmup(progress=False)
    run_spec = dataclasses.replace(spec, vocab_size=engine.model_config.vocab_size)
    with CompileCounter() as compiles:
        run = (drive or drive_in_process)(engine, run_spec, clients_config(args, args.seed),
                                          progress)
    engine.check_invariants()
    return MeasuredRun(run, engine, device_tokens, compiles.count, compiles.seconds,
                       tuple(compiles.programs))


def run_multiturn_mode(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                       progress: tqdm) -> dict:
    """One mode's measured run, in process, summarised."""
    return measured_summary(measured_run(args, spec, mode, progress), spec)


def measured_summary(measured: MeasuredRun, spec: MultiTurnSpec) -> dict:
    warmup = measured.engine.startup.warmup
    return {**run_summary(measured.run, spec), "stats": measured.engine.stats().as_dict(),
            "device_kv_tokens": measured.device_kv_tokens,
            "warmup": None if warmup is None else dataclasses.asdict(warmup),
            "compiles_during_run": {"count": measured.compiles, "seconds": measured.compile_s,
                                    "programs": list(measured.compiled)}}


def run_summary(run: clients.ClientsRun, spec: MultiTurnSpec) -> dict:
    """Per round and overall latencies, throughput (prompt + output tokens / first send to
    last answer) and the order sent."""
    rounds = [clients.round_summary([t for t in run.turns if t.round == r])
              for r in range(spec.num_rounds)]
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in rounds)
    return {"rounds": rounds, "elapsed_s": run.elapsed_s,
            "throughput_tokens_per_s": tokens / run.elapsed_s,
            **clients.latency_summary(run.turns), "max_in_flight": run.max_in_flight,
            "send_order": [[t.client, t.round] for t in run.turns]}


def clients_config(args: argparse.Namespace, seed: int) -> clients.ClientsConfig:
    return clients.ClientsConfig(request_rate=args.request_rate, max_parallel=args.max_parallel,
                                 ready_queue_policy=args.ready_queue_policy,
                                 round_barrier=args.round_barrier == "on", seed=seed)


def drive_in_process(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                     progress: tqdm) -> clients.ClientsRun:
    return asyncio.run(drive_clients(engine, spec, config, progress))


async def drive_clients(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                        progress: tqdm) -> clients.ClientsRun:
    """The clients' conversations through an AsyncEngine over `engine`, as a server drives it;
    closed at the end (its thread then lets go of the engine, whose stats the caller reads)."""
    async with AsyncEngine(engine) as served:
        return await clients.run_clients(EngineBackend(served), user_turns(spec),
                                         turn_params(spec), config,
                                         on_turn=lambda turn: progress.update(1))


async def drive_url(url: str, spec: MultiTurnSpec, config: clients.ClientsConfig,
                    progress: tqdm) -> clients.ClientsRun:
    """The clients' conversations through the server at `url`: POST /generate, streamed, with
    the sampling params the in-process path gives the engine."""
    from jhicache.bench import remote  # httpx: in the serve and test extras, not the base install

    connections = config.max_parallel or spec.num_clients
    async with remote.http_backend(url, connections) as backend:
        return await clients.run_clients(backend, user_turns(spec), turn_params(spec), config,
                                         on_turn=lambda turn: progress.update(1))


def turn_params(spec: MultiTurnSpec) -> list[list[SamplingParams]]:
    """Each turn's sampling: greedy, its drawn answer length."""
    return [[SamplingParams(max_new_tokens=n) for n in row] for row in output_lengths(spec)]


def bench_multiturn(args: argparse.Namespace, vocab: int, save: Callable[[dict], None]) -> dict:
    """Runs each mode in turn; `save` gets the result so far after every mode (a long GPU run cut
    short by a time limit keeps the modes it finished)."""
    modes = args.modes  # a tuple: mode_list parsed it
    spec = multiturn_spec(args, vocab)
    args._device_tokens = device_tokens_for(args, spec)
    result: dict = {"spec": {**dataclasses.asdict(spec), **sending(args)}, "modes": {}}
    requests = spec.num_clients * spec.num_rounds
    with tqdm(total=2 * len(modes) * requests, desc="multiturn", unit="request", file=sys.stderr,
              # None: no bar unless stderr is a terminal (no fragments in logs)
              disable=None) as progress:
        for mode in modes:
            result["modes"][mode] = run_multiturn_mode(args, spec, mode, progress)
            save(result)
            ttfts = " ".join(f"{r['mean_ttft_s']:.3f}" for r in result["modes"][mode]["rounds"])
            progress.write(f"{mode}: mean TTFT per round (s) {ttfts}")
    return result


def bench_remote(args: argparse.Namespace) -> dict:
    """The workload against the server at --url, as it was started (its cache mode and pools,
    warmed up by itself): /flush_cache, then the measured run."""
    from jhicache.bench import remote

    info = remote.model_info(args.url)
    vocab = info.get("vocab_size") or preset_config(args.preset).vocab_size
    spec = multiturn_spec(args, vocab)
    requests = spec.num_clients * spec.num_rounds
    with tqdm(total=requests, desc="multiturn", unit="request", file=sys.stderr,
              disable=None) as progress:
        remote.flush_cache(args.url)  # as a fresh engine: nothing cached from before
        before = remote.serving_compiles(args.url)
        run = asyncio.run(drive_url(args.url, spec, clients_config(args, args.seed), progress))
        after = remote.serving_compiles(args.url)
    server = {"url": args.url, "model_info": info, "vocab_size": vocab,
              "vocab_from": "/get_model_info" if info.get("vocab_size") else "--preset",
              "note": REMOTE_NOTE}
    compiles = (None if before is None or after is None
                else {"count": int(after - before), "seconds": None, "programs": None,
                      "from": "the server's /metrics"})
    mode = {**run_summary(run, spec), "stats": None, "device_kv_tokens": info.get("pool_tokens"),
            "compiles_during_run": compiles}
    # The engine's facts are the server's: its model name, and no page size or dtype of ours.
    engine = {"preset": info.get("served_model_name") or args.url, "page_size": None,
              "dtype": None, "write_policy": None}
    return {**engine, "spec": {**dataclasses.asdict(spec), **sending(args)}, "server": server,
            "modes": {"server": mode}}


REMOTE_NOTE = ("--url: one measured run against the server as it was started (warmed up by "
               "itself): its own cache mode, pools and weights (--modes does not apply); "
               "/flush_cache before the run; TTFT is send to the first event with tokens; hits "
               "from each answer's meta_info; compiles: the server's /metrics "
               "(jhicache:compiles_total, serving) before and after; engine counters: the "
               "server's /metrics; device and backend: this client's, not the server's")


def sending(args: argparse.Namespace) -> dict:
    """How the requests were sent, for the JSON (`inf` spelt as on the command line: JSON has
    no infinity)."""
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    return {"request_rate": rate, "max_parallel": args.max_parallel or args.clients,
            "ready_queue_policy": args.ready_queue_policy, "round_barrier": args.round_barrier}


# ---- isolated host hit ---------------------------------------------------------------------

def ttft_of(engine: Engine, prompt: list[int]) -> tuple[float, object]:
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    return out.ttft_s, out


def push_to_host(engine: Engine) -> float:
    """Evicts every unlocked device page (writing back what the host lacks) and waits for the
    copies; returns the seconds that took, end to end."""
    start = time.perf_counter()
    engine.cache.evict_device(engine.cache.evictable_device_pages)
    engine.cache.flush()
    return time.perf_counter() - start


def stats_delta(engine: Engine, before: dict, keys: tuple[str, ...]) -> dict:
    """How much each of `keys` in engine.stats() grew since `before`, as `engine_<key>`."""
    after = engine.stats().as_dict()
    return {f"engine_{k}": after[k] - before[k] for k in keys}


def timed_load_alone(engine: Engine, prompt: list[int]) -> float:
    """Seconds for the load-back of `prompt`'s host run with no compute around it."""
    match = engine.cache.match(prompt, leave_last=True)
    start = time.perf_counter()
    ticket = engine.cache.load_back(match)
    if ticket is None:
        return float("nan")
    engine.cache.launch()
    ticket.wait_all()
    seconds = time.perf_counter() - start
    engine.cache.flush()
    engine.cache.poll()
    return seconds


def host_hit_trial(engine: Engine, rng: np.random.Generator, args: argparse.Namespace) -> dict:
    vocab = engine.model_config.vocab_size
    prefix, other = random_prompts(rng, vocab, 2, args.host_hit_prefix)
    turns = random_prompts(rng, vocab, 7, args.host_hit_turn)
    none_s, _ = ttft_of(engine, prefix + turns[0])  # nothing cached: computes the whole prompt
    stats = engine.stats()
    write_s = push_to_host(engine)
    written = engine.stats().write_back_bytes - stats.write_back_bytes
    copy_s = engine.stats().write_back_s - stats.write_back_s  # its device->host copies alone
    before = engine.stats().as_dict()
    # prefix only on host: load-back
    host_s, host_out, timeline = traced_ttft(engine, prefix + turns[1])
    measured = stats_delta(engine, before, ("load_gated_steps", "load_back_s"))
    measured["gate_timeouts"] = engine.device_pool.gate_timeouts()  # must stay 0
    device_s, _ = ttft_of(engine, prefix + turns[2])  # prefix now on device
    beside_s = device_hit_beside_write_back(engine, prefix, other, turns[3:6])
    push_to_host(engine)
    load_s = timed_load_alone(engine, prefix + turns[6])
    return {"no_cache_ttft_s": none_s, "host_hit_ttft_s": host_s, "device_hit_ttft_s": device_s,
            "host_hit_tokens": host_out.host_hit_tokens, "load_alone_s": load_s,
            "write_back_s": write_s, "write_back_bytes": written, "write_back_copy_s": copy_s,
            "device_hit_beside_write_back_ttft_s": beside_s, "host_hit_timeline": timeline,
            **measured}


def traced_ttft(engine: Engine, prompt: list[int]) -> tuple[float, object, dict]:
    """`ttft_of` through `add_request` and `step`, with the host clock of each `step` call's
    return in ms from the `add_request` call (the first dispatches the whole forward; with
    overlap scheduling a later one reads its token), of the first token's arrival, and of
    Python's garbage collections until then (host pauses no engine phase shows)."""
    with gc_pauses() as pauses:
        start = time.perf_counter()
        request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=1))
        returned, out = [], None
        while out is None:
            out = next((o for o in engine.step() if o.request_id == request_id), None)
            returned.append(time.perf_counter())
    while engine.has_unfinished():
        engine.step()
    ms = lambda at: (at - start) * 1e3  # noqa: E731
    return out.ttft_s, out, {
        "steps_returned_ms": [ms(t) for t in returned], "first_token_ms": ms(returned[-1]),
        "gc_pauses": [{"generation": g, "at_ms": ms(a), "ms": (b - a) * 1e3}
                      for g, a, b in pauses],
        "note": "host clock from the add_request call (TTFT counts from the request's arrival, "
                "after validation)"}


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[tuple[int, float, float]]]:
    """(generation, start, end) on the host clock of each garbage collection inside the block,
    through `gc.callbacks`: a probe for the benchmarks, not the engine's data path."""
    pauses: list[tuple[int, float, float]] = []
    started = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], started[0], time.perf_counter()))

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


def device_hit_beside_write_back(engine: Engine, prefix: list[int], other: list[int],
                                 turns: list[list[int]]) -> float:
    """TTFT of a device hit on `prefix` while `other`'s pages are being written back."""
    # `other` cached on device, written back by the eviction below
    ttft_of(engine, other + turns[0])
    ttft_of(engine, prefix + turns[1])  # `prefix` used last: the eviction takes `other`
    # Sized without `match(other)`: a match is an access, and would make `other` the newest.
    engine.cache.evict_device(len(other) // engine.config.page_size)
    if engine.cache.match(other).device_len or engine.cache.match(prefix).host_len:
        raise RuntimeError("the eviction did not take exactly `other`: no device hit to time")
    ttft_s, _ = ttft_of(engine, prefix + turns[2])
    engine.cache.flush()
    return ttft_s


def host_hit_engine(args: argparse.Namespace, **tuning: int) -> Engine:
    """The host-hit bench's engine: hierarchical, every host run loaded back, a device pool of
    four times (the prefix, its turn and two pages) tokens. `tuning`: `TransferTuning` fields
    its transfer controller uses instead (a probe for the benchmark scripts)."""
    tokens = 4 * (args.host_hit_prefix + args.host_hit_turn + 2 * args.page_size)
    engine = make_engine(args, cache_mode="hierarchical", device_kv_tokens=tokens,
                         load_back_threshold=1)
    if tuning:
        controller = engine.cache.controller
        controller.tuning = dataclasses.replace(controller.tuning, **tuning)
    return engine


def bench_host_hit(args: argparse.Namespace) -> dict:
    """`--host-hit-trials` trials after a warm-up one, each with its own prompts and the PCIe
    ceilings measured beside it; the figures of the trial whose ratio is the median (the lower
    one for an even count), every trial under "trials", and the ratios' range."""
    engine = host_hit_engine(args)
    rng = np.random.default_rng(args.seed + 1)
    host_hit_trial(engine, rng, args)  # compiles every shape involved
    trials = [trial_rates(host_hit_trial(engine, rng, args), engine, args)
              for _ in range(args.host_hit_trials)]
    ratios = [t["host_hit_ratio"] for t in trials]
    median = sorted(range(len(trials)), key=ratios.__getitem__)[(len(trials) - 1) // 2]
    return {**trials[median], "trials": trials, "median_trial": median,
            "host_hit_ratio_range": [min(ratios), max(ratios)]}


def trial_rates(trial: dict, engine: Engine, args: argparse.Namespace) -> dict:
    """A trial's rates and ratios, against PCIe ceilings measured now (the same run)."""
    exposed = trial["host_hit_ttft_s"] - trial["device_hit_ttft_s"]
    trial["load_hidden_fraction"] = float(np.clip(1.0 - exposed / trial["load_alone_s"], 0.0, 1.0))
    load_bytes = trial["host_hit_tokens"] * bytes_per_token(engine)
    trial["load_gbps"] = load_bytes / trial["load_alone_s"] / 1e9
    trial["pcie_s"] = pcie_copy_seconds(load_bytes)
    trial["pcie_gbps"] = load_bytes / trial["pcie_s"] / 1e9
    trial["write_back_gbps"] = trial["write_back_bytes"] / trial["write_back_s"] / 1e9
    trial["write_back_copy_gbps"] = trial["write_back_bytes"] / trial["write_back_copy_s"] / 1e9
    trial["pcie_to_host_gbps"] = load_bytes / pcie_copy_seconds(load_bytes, to_host=True) / 1e9
    trial["host_hit_ratio"] = trial["host_hit_ttft_s"] / max(trial["pcie_s"],
                                                             trial["device_hit_ttft_s"])
    trial["prefix_tokens"], trial["turn_tokens"] = args.host_hit_prefix, args.host_hit_turn
    return trial


def pcie_copy_seconds(nbytes: int, reps: int = 5, to_host: bool = False) -> float:
    """Median seconds of one contiguous copy of `nbytes`, pinned_host -> device (or back): the
    PCIe ceiling, through XLA's own transfer."""
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    src, dst = (device, host) if to_host else (host, device)
    source = jax.device_put(np.ones(nbytes // 4, np.float32), src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        jax.device_put(source, dst).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def bytes_per_token(engine: Engine) -> int:
    layout = engine.device_pool.layout
    return layout.page_bytes // layout.page_size


# ---- entry point ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    """Runs what `args.what` names; writes the JSON to `args.out` after each part and at the end."""
    result: dict = {"date": datetime.date.today().isoformat(),
                    "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                    "jax": jax.__version__, "preset": args.weights or args.preset,
                    "page_size": args.page_size, "dtype": args.dtype,
                    "write_policy": args.write_policy}
    if args.what in ("all", "model"):
        result["model"] = bench_model(args)
        print(report.model_table(result["model"]))
        save_json(result, args.out)
    if args.url is not None:
        result.update(bench_remote(args))
        print(result["server"]["note"])
        print(report.multiturn_table(result))
        return result
    if args.what in ("all", "multiturn"):
        result.update(bench_multiturn(args, model_vocab(args),
                                      lambda partial: save_json({**result, **partial}, args.out)))
        print(report.multiturn_table(result))
        save_json(result, args.out)
    if args.what == "serve-overhead":
        # The server (fastapi, uvicorn: the serve extra) is needed by this command alone, so it
        # is imported here.
        from jhicache.bench import serve_overhead

        result["serve_overhead"] = serve_overhead.bench_serve_overhead(
            args, model_vocab(args),
            lambda part: save_json({**result, "serve_overhead": part}, args.out))
        print(report.serve_overhead_table(result["serve_overhead"]))
    if args.what in ("all", "host-hit"):
        result["host_hit"] = bench_host_hit(args)
        print(report.host_hit_table(result["host_hit"]))
    return result


def model_vocab(args: argparse.Namespace) -> int:
    if args.weights:
        return make_engine(args).model_config.vocab_size
    return preset_config(args.preset).vocab_size


def save_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--url" or a.startswith("--url=") for a in argv):
        # The client needs no accelerator memory, and the server on the same GPU needs all
        # of it: JAX's default preallocation (75%) at the first backend call would take it.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = parse_args(argv)
    if args.what == "kernels":
        if jax.default_backend() != "gpu":
            print("the kernel benchmark times Triton kernels against PCIe, HBM and cuDNN: "
                  "it needs a GPU", file=sys.stderr)
            return 2
        from jhicache.bench.kernels.cli import main as bench_kernels

        bench_kernels([] if args.out is None else ["--out", args.out])
        return 0
    note = None if args.url else timing_note(jax.default_backend())  # --url: the server's
    if note:
        print(note, flush=True)
    try:
        result = run(args)
    except ServerError as e:  # a server that is down or misbehaves: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    save_json(result, args.out)
    if args.plot:  # parse_args made sure that the run has multiturn modes and matplotlib is there
        report.save_plot(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def timing_note(backend: str) -> str | None:
    """What a non-GPU run's timings are worth: the bench is tuned for, and only meaningful on, a
    GPU."""
    if backend == "gpu":
        return None
    return (f"note: on the {backend.upper()} backend, timings only check that the bench runs; "
            "they say nothing about performance")


if __name__ == "__main__":
    sys.exit(main())
