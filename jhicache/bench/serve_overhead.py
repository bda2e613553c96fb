"""The server's overhead per request, measured (`python -m jhicache.bench serve-overhead`): the
bench's multi-turn workload through the HTTP server and in process, side by side."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients, multiturn
from jhicache.bench.engines import engine_spec
from jhicache.bench.remote_run import drive_url
from jhicache.bench.workload import MultiTurnSpec
from jhicache.engine import Engine
from jhicache.serve.context import ServerContext
from jhicache.serve.thread import ServerThread

HOW = ("in process: clients -> AsyncEngine; HTTP: clients -> httpx -> 127.0.0.1 -> uvicorn (a "
       "thread of this process, sharing its GIL) -> POST /generate -> AsyncEngine, its engine "
       "stepped in a thread of this process; HTTP + engine process: the same, the engine built "
       "and stepped in a child process; each path on a fresh engine of the same config, "
       "weights seed and prompts, warmed up before its run; HTTP - in process = what the "
       "server adds")


def drive_over_http(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                    progress: tqdm) -> clients.ClientsRun:
    """multiturn.Drive through a server over `engine` (closed, with the server, at the end)."""
    ctx = ServerContext.create(AsyncEngine(engine), None, "bench", "bench")
    with ServerThread(ctx) as server:
        return asyncio.run(drive_url(server.url, spec, config, progress))


def process_run(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                progress: tqdm) -> dict:
    """One mode's measured run through a server whose engine is built, warmed up and stepped
    in an engine process; its summary, as `multiturn.measured_summary`'s."""
    overrides = multiturn.mode_overrides(args, spec, mode)
    engine = AsyncEngine(engine_spec(args, **overrides))
    try:
        engine.start_warmup(progress=False)
        while not engine.is_ready:
            if not engine.is_running:
                raise RuntimeError(f"the engine process stopped: {engine.error}")
            time.sleep(0.05)
        run_spec = dataclasses.replace(spec, vocab_size=engine.info.vocab_size)
        before = engine.compile_counts()["serving"]
        ctx = ServerContext.create(engine, None, "bench", "bench")
        with ServerThread(ctx) as server:  # closes the engine at its end
            run = asyncio.run(drive_url(server.url, run_spec,
                                        multiturn.clients_config(args, args.seed), progress))
            compiles = engine.compile_counts()["serving"] - before
            stats, startup = engine.stats(), engine.startup()
    finally:
        engine.close()
    warmup = startup.warmup
    return {**multiturn.run_summary(run, spec), "stats": stats.as_dict(),
            "device_kv_tokens": overrides["device_kv_tokens"],
            "warmup": None if warmup is None else dataclasses.asdict(warmup),
            "compiles_during_run": {"count": compiles, "seconds": None, "programs": []},
            "histories": run.histories}


def overhead(here: dict, http: dict) -> dict:
    """HTTP minus in process: per request (mean end-to-end latency), and of TTFT and ITL."""
    def minus(section: str, stat: str) -> float | None:
        a, b = here[section][stat], http[section][stat]
        return None if a is None or b is None else b - a

    return {"mean_e2e_s": minus("e2e", "mean_s"), "p50_e2e_s": minus("e2e", "p50_s"),
            "mean_ttft_s": minus("ttft", "mean_s"), "p50_ttft_s": minus("ttft", "p50_s"),
            "p50_itl_s": minus("itl", "p50_s"),
            "throughput_ratio": http["throughput_tokens_per_s"] / here["throughput_tokens_per_s"]}


def compare_mode(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                 progress: tqdm) -> dict:
    """One mode in process, over HTTP, and over HTTP with an engine process; the engines go
    once summarised (one at a time)."""
    histories, summaries = {}, {}
    for path, drive in (("in_process", multiturn.drive_in_process), ("http", drive_over_http)):
        measured = multiturn.measured_run(args, spec, mode, progress, drive)
        histories[path] = measured.run.histories
        summaries[path] = multiturn.measured_summary(measured, spec)
        del measured
    summaries["http_process"] = process_run(args, spec, mode, progress)
    histories["http_process"] = summaries["http_process"].pop("histories")
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
    total = 3 * len(modes) * spec.num_clients * spec.num_rounds  # a run per path
    with tqdm(total=total, desc="serve-overhead", unit="request", file=sys.stderr,
              disable=None) as progress:
        for mode in modes:
            result["modes"][mode] = compare_mode(args, spec, mode, progress)
            save(result)
    return result
