"""The server's overhead per request, measured (`python -m benchmarks.serve_overhead`): the
bench's multi-turn workload through the HTTP server and in process, side by side."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tqdm import tqdm

from benchmarks import cli, tables
from benchmarks.cli import sized
from benchmarks.rows import Rule, Target
from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients, multiturn
from jhicache.bench.command import model_vocab
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, engine_spec, make_engine, warm_up_served
from jhicache.bench.remote_run import drive_url
from jhicache.bench.workload import MultiTurnSpec
from jhicache.serve.context import ServerContext
from jhicache.serve.thread import ServerThread

HOW = ("in process: clients -> AsyncEngine, in this process; HTTP: clients (a process of "
       "their own) -> aiohttp -> 127.0.0.1 -> uvicorn (a thread of this process) -> POST /generate "
       "-> AsyncEngine, its engine stepped in a thread of this process; HTTP + engine process: "
       "the same, the engine built and stepped in a child process (run first, while this process "
       "holds no GPU memory; JAX's preallocation off in both); each path on a fresh engine of the "
       "same config, weights seed and prompts, warmed up before its run with the heap frozen "
       "as a server's start leaves it, then the device-hit probe on it; HTTP - in process = "
       "what the server adds")


@dataclasses.dataclass(frozen=True)
class Runs:
    """A path's two runs on one engine: the workload, then the device-hit probe; over HTTP,
    the CPU time of the clients' process during the workload (None where the clients share
    the engine's process)."""

    workload: clients.ClientsRun
    probe: clients.ClientsRun
    client_cpu_s: float | None = None


def probe_spec(args: argparse.Namespace, spec: MultiTurnSpec) -> MultiTurnSpec:
    """One conversation of short turns, sent one at a time after the workload: each turn after
    the first finds its history on the device, so its TTFT is a one-page prefill plus what the
    path adds."""
    return dataclasses.replace(spec, num_clients=1, num_rounds=args.device_hit_turns,
                               request_length=args.page_size, output_length=4,
                               seed=spec.seed + 1, range_ratio=1.0)


def clients_cpu(runs: Runs) -> dict:
    """The clients' CPU time per workload request (a share of its latency that is the clients'
    own, not the server's), where they ran alone in a process."""
    per = None if runs.client_cpu_s is None else runs.client_cpu_s / len(runs.workload.turns)
    return {"clients_cpu_s": runs.client_cpu_s, "clients_cpu_per_request_s": per}


def probe_summary(run: clients.ClientsRun) -> dict:
    """TTFT of the probe's device hits (every turn but the first) as the clients saw it, as the
    server (over HTTP) and the engine saw it where they say it, and how much of their prompts
    the device held."""
    hits = [t for t in run.turns if t.round > 0]
    prompt = sum(t.prompt_len for t in hits)

    def p50(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return clients.percentiles(known, (50,))["p50_s"] if len(known) == len(values) else None

    return {"turns": len(hits), "ttft": clients.percentiles([t.ttft_s for t in hits], (50, 90)),
            "server_ttft_p50_s": p50([t.server_ttft_s for t in hits]),
            "engine_ttft_p50_s": p50([t.engine_ttft_s for t in hits]),
            "device_hit_rate": sum(t.device_hit_tokens for t in hits) / prompt if prompt else 0.0}


async def drive_both(drive: Callable[[MultiTurnSpec, clients.ClientsConfig], Awaitable[
        clients.ClientsRun]], args: argparse.Namespace, spec: MultiTurnSpec,
        own_process: bool = False) -> Runs:
    """The workload, then the probe, through one path; with `own_process` (the clients alone
    in this process), the process's CPU time during the workload too."""
    cpu = time.process_time()
    workload = await drive(spec, multiturn.clients_config(args, args.seed))
    cpu = time.process_time() - cpu
    return Runs(workload, await drive(probe_spec(args, spec),
                                      multiturn.clients_config(args, args.seed + 1)),
                cpu if own_process else None)


def drive_url_elsewhere(url: str, args: argparse.Namespace, spec: MultiTurnSpec,
                        progress: tqdm) -> Runs:
    """`drive_both` through the server at `url` from a process of its own, as a deployment's
    clients are: the clients' HTTP and JSON work then shares no interpreter with the server."""
    context = multiprocessing.get_context("spawn")  # no copy of this process's JAX state
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        runs = pool.submit(_drive_url, url, args, spec).result()
    progress.update(len(runs.workload.turns) + len(runs.probe.turns))
    return runs


def _drive_url(url: str, args: argparse.Namespace, spec: MultiTurnSpec) -> Runs:
    from jhicache.bench import remote  # noqa: F401 (imported here: not in the clients' CPU time)

    with tqdm(disable=True) as progress:
        return asyncio.run(drive_both(
            lambda turns, config: drive_url(url, turns, config, progress,
                                            multiturn.turn_sampling(args)), args, spec,
            own_process=True))


def thread_run(args: argparse.Namespace, spec: MultiTurnSpec, mode: str, progress: tqdm,
               over_http: bool) -> dict:
    """One mode's runs on a fresh engine stepped in a thread of this process: driven in
    process, or through a server in a thread here; its summary, as
    `multiturn.measured_summary`'s, with the probe's."""
    overrides = multiturn.mode_overrides(args, spec, mode)
    engine = make_engine(args, **overrides)
    run_spec = dataclasses.replace(spec, vocab_size=engine.model_config.vocab_size)

    async def in_process(turns: MultiTurnSpec, config: clients.ClientsConfig
                         ) -> clients.ClientsRun:
        return await multiturn.drive_clients(engine, turns, config, progress,
                                             multiturn.turn_sampling(args))

    with as_served(engine), CompileCounter() as compiles:
        if over_http:
            ctx = ServerContext.create(AsyncEngine(engine), None, "bench", "bench")
            with ServerThread(ctx) as server:
                runs = drive_url_elsewhere(server.url, args, run_spec, progress)
        else:
            runs = asyncio.run(drive_both(in_process, args, run_spec))
    engine.check_invariants()
    measured = multiturn.MeasuredRun(runs.workload, engine, overrides["device_kv_tokens"],
                                     compiles.count, compiles.seconds, tuple(compiles.programs))
    return {**multiturn.measured_summary(measured, spec), "device_hit": probe_summary(runs.probe),
            **clients_cpu(runs), "histories": runs.workload.histories}


def process_run(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                progress: tqdm) -> dict:
    """One mode's runs through a server whose engine is built, warmed up and stepped in an
    engine process; its summary, as `thread_run`'s."""
    overrides = multiturn.mode_overrides(args, spec, mode)
    engine = AsyncEngine(engine_spec(args, **overrides))
    try:
        warm_up_served(engine)
        run_spec = dataclasses.replace(spec, vocab_size=engine.info.vocab_size)
        before = engine.compile_counts()["serving"]
        ctx = ServerContext.create(engine, None, "bench", "bench")
        # closes the engine at its end; this process's heap frozen too, as a server's is
        with ServerThread(ctx) as server, as_served():
            runs = drive_url_elsewhere(server.url, args, run_spec, progress)
            compiles = engine.compile_counts()["serving"] - before
            stats, startup = engine.stats(), engine.startup()
    finally:
        engine.close()
    warmup = startup.warmup
    return {**multiturn.run_summary(runs.workload, spec), "stats": stats.as_dict(),
            "device_kv_tokens": overrides["device_kv_tokens"],
            "warmup": None if warmup is None else dataclasses.asdict(warmup),
            "compiles_during_run": {"count": compiles, "seconds": None, "programs": []},
            "device_hit": probe_summary(runs.probe), **clients_cpu(runs),
            "histories": runs.workload.histories}


def overhead(here: dict, http: dict) -> dict:
    """HTTP minus in process: per request (mean end-to-end latency), and of TTFT and ITL."""
    def minus(*keys: str) -> float | None:
        a: Any = functools.reduce(dict.__getitem__, keys, here)
        b: Any = functools.reduce(dict.__getitem__, keys, http)
        return None if a is None or b is None else b - a

    return {"mean_e2e_s": minus("e2e", "mean_s"), "p50_e2e_s": minus("e2e", "p50_s"),
            "mean_ttft_s": minus("ttft", "mean_s"), "p50_ttft_s": minus("ttft", "p50_s"),
            "p50_itl_s": minus("itl", "p50_s"),
            "p50_device_hit_ttft_s": minus("device_hit", "ttft", "p50_s"),
            "throughput_ratio": http["throughput_tokens_per_s"] / here["throughput_tokens_per_s"]}


def compare_mode(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                 progress: tqdm) -> dict:
    """One mode over HTTP with an engine process, in process, and over HTTP with the engine in
    a thread; the engines go once summarised (one at a time)."""
    summaries = {"http_process": process_run(args, spec, mode, progress),
                 "in_process": thread_run(args, spec, mode, progress, over_http=False),
                 "http": thread_run(args, spec, mode, progress, over_http=True)}
    histories = {path: summary.pop("histories") for path, summary in summaries.items()}
    same = histories["in_process"] == histories["http"] == histories["http_process"]
    here = summaries["in_process"]
    return {**summaries, "same_tokens": same, "overhead": overhead(here, summaries["http"]),
            "overhead_process": overhead(here, summaries["http_process"])}


def bench_serve_overhead(args: argparse.Namespace, vocab: int,
                         save: Callable[[dict], None]) -> dict:
    """Each mode (hierarchical unless --modes names them) both ways; `save` gets the result
    after each mode."""
    modes = args.modes if "--modes" in args.given else ("hierarchical",)
    spec = multiturn.multiturn_spec(args, vocab)
    args._device_tokens = multiturn.device_tokens_for(args, spec)
    result: dict = {"spec": {**dataclasses.asdict(spec), **multiturn.sending(args)}, "how": HOW,
                    "modes": {}}
    # a run and a probe per path
    total = 3 * len(modes) * (spec.num_clients * spec.num_rounds + args.device_hit_turns)
    with tqdm(total=total, desc="serve-overhead", unit="request", file=sys.stderr,
              disable=None) as progress:
        for mode in modes:
            result["modes"][mode] = compare_mode(args, spec, mode, progress)
            save(result)
    return result


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--device-hit-turns", **sized(count, 16, 3),
                   help="turns of the device-hit probe after the workload (one conversation, "
                        "one request at a time)")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target] | None:
    """The engine process against in process, where the hierarchical mode ran; a model as small
    as 0.5B, whose steps are short beside the server's work per output, aims at 0.8x of the
    throughput and states no ITL bound."""
    if "hierarchical" not in result["modes"]:
        return None
    hit = Rule("process_hit_ttft_ms", "device-hit TTFT", at_most=5.0)
    if "0.5b" in str(args.weights or args.preset).lower():
        return "serve_paths", Target(
            "engine process: throughput >= 0.8x, device-hit TTFT p50 <= +5 ms",
            (Rule("process_ratio", "throughput", at_least=0.8), hit))
    return "serve_paths", Target(
        "engine process: throughput >= 0.9x, ITL p50 <= +0.5 ms, device-hit TTFT p50 <= +5 ms",
        (Rule("process_ratio", "throughput", at_least=0.9),
         Rule("process_itl_ms", "ITL", at_most=0.5), hit))


def main(argv: list[str] | None = None) -> int:
    return cli.main("serve-overhead", "serve_overhead", __doc__ or "", argv, add_options,
                    lambda args, save: bench_serve_overhead(args, model_vocab(args), save),
                    tables.serve_overhead_table, page_row,
                    own_device_memory=False)


if __name__ == "__main__":
    sys.exit(main())
