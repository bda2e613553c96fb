"""The server's overhead per request, measured (`python -m jhicache.bench serve-overhead`): the
bench's multi-turn workload through the HTTP server and in process, side by side."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable

from tqdm import tqdm

from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients, multiturn
from jhicache.bench.remote_run import drive_url
from jhicache.bench.workload import MultiTurnSpec
from jhicache.engine import Engine
from jhicache.serve.context import ServerContext
from jhicache.serve.thread import ServerThread

HOW = ("in process: clients -> AsyncEngine; HTTP: clients -> httpx -> 127.0.0.1 -> uvicorn (a "
       "thread of this process, sharing its GIL) -> POST /generate -> AsyncEngine; each path a "
       "warm-up run on the measured run's prompts (so that it compiles the batch shapes the "
       "measured run meets), then the measured run, each run on a fresh engine of the same "
       "config, weights seed and prompts; HTTP - in process = what the server adds")


def drive_over_http(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                    progress: tqdm) -> clients.ClientsRun:
    """multiturn.Drive through a server over `engine` (closed, with the server, at the end)."""
    ctx = ServerContext.create(AsyncEngine(engine), None, "bench", "bench")
    with ServerThread(ctx) as server:
        return asyncio.run(drive_url(server.url, spec, config, progress))


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
    """One mode in process, then over HTTP; the engines go once summarised (one at a time)."""
    runs, summaries = {}, {}
    for path, drive in (("in_process", multiturn.drive_in_process), ("http", drive_over_http)):
        measured = multiturn.measured_run(args, spec, mode, progress, drive)
        runs[path] = measured.run
        summaries[path] = multiturn.measured_summary(measured, spec)
        del measured
    same = runs["in_process"].histories == runs["http"].histories
    return {**summaries, "same_tokens": same,
            "overhead": overhead(summaries["in_process"], summaries["http"])}


def bench_serve_overhead(args: argparse.Namespace, vocab: int,
                         save: Callable[[dict], None]) -> dict:
    """Each mode (hierarchical unless --modes names them) both ways; `save` gets the result
    after each mode."""
    modes = args.modes if "--modes" in args.given else ("hierarchical",)
    spec = multiturn.multiturn_spec(args, vocab)
    args._device_tokens = multiturn.device_tokens_for(args, spec)
    result: dict = {"spec": {**dataclasses.asdict(spec), **multiturn.sending(args)}, "how": HOW,
                    "modes": {}}
    total = 4 * len(modes) * spec.num_clients * spec.num_rounds  # 2 paths x (warm-up, measured)
    with tqdm(total=total, desc="serve-overhead", unit="request", file=sys.stderr,
              disable=None) as progress:
        for mode in modes:
            result["modes"][mode] = compare_mode(args, spec, mode, progress)
            save(result)
    return result
