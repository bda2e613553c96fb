"""`multiturn --url`: the multi-turn clients' one measured run against a running server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from tqdm import tqdm

from jhicache.bench import clients
from jhicache.bench.multiturn import (
    TurnSampling,
    clients_config,
    multiturn_spec,
    run_summary,
    sending,
    turn_params,
    turn_sampling,
)
from jhicache.bench.workload import MultiTurnSpec, user_turns
from jhicache.models.presets import preset_config

REMOTE_NOTE = ("--url: one measured run against the server as it was started (warmed up by "
               "itself): its own cache mode, pools and weights (--modes does not apply); "
               "/flush_cache before the run; TTFT is send to the first event with tokens; hits "
               "from each answer's meta_info; compiles: the server's /metrics "
               "(jhicache:compiles_total, serving) before and after; engine counters: the "
               "server's /metrics; device and backend: this client's, not the server's")


async def drive_url(url: str, spec: MultiTurnSpec, config: clients.ClientsConfig,
                    progress: tqdm, sampling: TurnSampling = TurnSampling()
                    ) -> clients.ClientsRun:
    """The clients' conversations through the server at `url`: POST /generate, streamed, with
    the sampling params the in-process path gives the engine."""
    from jhicache.bench import remote  # aiohttp: in the serve extra, not the base install

    connections = config.max_parallel or spec.num_clients
    async with remote.http_backend(url, connections) as backend:
        return await clients.run_clients(backend, user_turns(spec), turn_params(spec, sampling),
                                         config, on_turn=lambda turn: progress.update(1))


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
        run = asyncio.run(drive_url(args.url, spec, clients_config(args, args.seed), progress,
                                    turn_sampling(args)))
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
