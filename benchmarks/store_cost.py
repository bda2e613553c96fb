"""The store-cost bench: the multi-turn workload on an engine whose storage tier is a Mooncake
store (a master this bench starts; the engine's client holds the store's memory) against the
same workload with no storage tier, the two alternating in one process: what a storage tier
costs the engine's throughput when its store helps nothing. `--store unused`: the store works
and the pages that reach the host tier are written to it (under the default write policies,
those evicted from the device), but none is hit from it (the conversations' prefixes stay in
the host tier); `--store unreachable`: its master stops once the engine is warm, so every read
is a miss and every write a failure."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import cli, mooncake_local
from benchmarks.cli import sized
from benchmarks.rows import Rule, Target
from jhicache.bench.command import model_vocab
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, make_engine
from jhicache.bench.multiturn import (
    clients_config,
    device_tokens_for,
    drive_in_process,
    mode_overrides,
    multiturn_spec,
    run_summary,
    turn_sampling,
)
from jhicache.bench.workload import MultiTurnSpec
from jhicache.engine import Engine

UNREACHABLE_WAIT_S = 60.0  # how long the store's client may take to see its master gone
CLOSE_S = 60.0  # an engine's close: its storage writes what it can in this time, then stops


def bench_store_cost(args: argparse.Namespace, vocab: int) -> dict:
    """`--pairs` pairs of runs, one with the store and one without a storage tier, the store's
    first in even pairs and second in odd ones (so that a drift over the process's life falls
    on both), each on a fresh engine warmed up as a server's is; every run's summary and the
    throughput ratio of every run with the store to every run without."""
    spec = dataclasses.replace(multiturn_spec(args, vocab), vocab_size=vocab)
    args._device_tokens = device_tokens_for(args, spec)
    root = Path(tempfile.mkdtemp(prefix="jhicache-store-cost-"))
    runs: dict[str, list[dict]] = {"store": [], "no_storage": []}
    try:
        for pair in range(args.pairs):
            for with_store in (True, False) if pair % 2 == 0 else (False, True):
                log = root / f"master-{pair}.log" if with_store else None
                runs["store" if with_store else "no_storage"].append(_run(args, spec, log))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [s["throughput_tokens_per_s"] / n["throughput_tokens_per_s"]
              for s in runs["store"] for n in runs["no_storage"]]
    return {"store": args.store, "segment_bytes": args.segment_mib << 20,
            "spec": dataclasses.asdict(spec), "runs": runs, "ratios": ratios}


def _run(args: argparse.Namespace, spec: MultiTurnSpec, master_log: Path | None) -> dict:
    """One measured run on a fresh engine: with `master_log`, its storage tier a Mooncake
    store whose master logs there (`--store unreachable`: stopped after the warm-up, before the
    first request); without, no storage tier. Its stats are the run's, taken before the engine
    closes (a close writes every cached page the store lacks)."""
    plain = argparse.Namespace(**{**vars(args), "storage_dir": None, "mooncake_config": None})
    overrides = mode_overrides(plain, spec, "hierarchical")
    master = None
    try:
        if master_log is not None:
            master = mooncake_local.Master(master_log, segment_bytes=args.segment_mib << 20)
            master.start()
            overrides.update(storage_backend="mooncake",
                             storage_backend_config=json.dumps(master.config))
        engine = make_engine(args, **overrides)
        try:
            with as_served(engine), CompileCounter() as compiles:
                if master is not None and args.store == "unreachable":
                    master.stop()
                    _wait_unreachable(engine)
                with tqdm(disable=True) as progress:
                    run = drive_in_process(engine, spec, clients_config(args, args.seed),
                                           progress, turn_sampling(args))
            engine.check_invariants()
            stats = engine.stats().as_dict()
        finally:
            engine.close(timeout_s=CLOSE_S)
    finally:
        if master is not None:
            master.stop()
    return {**run_summary(run, spec), "stats": stats,
            "compiles_during_run": {"count": compiles.count, "seconds": compiles.seconds}}


def _wait_unreachable(engine: Engine) -> None:
    """Until the storage tier's client sees the master gone (its heartbeat notices)."""
    deadline = time.monotonic() + UNREACHABLE_WAIT_S
    while engine.stats().storage_reachable:
        if time.monotonic() > deadline:
            raise RuntimeError("the Mooncake client still sees its master after "
                               f"{UNREACHABLE_WAIT_S:.0f} s")
        time.sleep(0.1)


def table(result: dict) -> str:
    def line(name: str, run: dict) -> str:
        stats = run["stats"]
        return (f"  {name}: {run['throughput_tokens_per_s']:,.0f} tok/s, ITL p50 "
                f"{run['itl']['p50_s'] * 1e3:.2f} ms, TTFT p50 {run['ttft']['p50_s'] * 1e3:.1f} "
                f"ms; storage hits {stats['storage_hit_tokens']} tokens, write failures "
                f"{stats['storage_write_failures_io']}; "
                f"{run['compiles_during_run']['count']} compiles")

    runs, store = result["runs"], f"store {result['store']}"
    lines = [line(store, r) for r in runs["store"]]
    if any(r["stats"]["storage_hit_tokens"] for r in runs["store"]):
        lines.append("  (the store was hit: it helped, so this is no store that helps nothing)")
    lines += [line("no storage tier", r) for r in runs["no_storage"]]
    ratios = ", ".join(f"{r:.3f}" for r in result["ratios"])
    return "\n".join([f"multi-turn, a Mooncake {store} against no storage tier", *lines,
                      f"  throughput ratios, every run with the store over every run "
                      f"without: {ratios}"])


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--store", choices=("unused", "unreachable"), default="unused",
                   help="the store works but is never hit, or its master stops once the engine "
                        "is warm")
    p.add_argument("--pairs", type=count["type"], metavar="N", default=2,
                   help="runs with the store and without a storage tier, each")
    p.add_argument("--segment-mib", **sized(count, 8192, 256),
                   help="the store's memory, held by the engine's own client (MiB)")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target]:
    return "store_cost", Target(">= 0.98 (within 2%)", (Rule("ratio", "ratio", at_least=0.98),),
                                samples="pairs")


def main(argv: list[str] | None = None) -> int:
    return cli.main("store-cost", "store_cost", __doc__ or "", argv, add_options,
                    lambda args, save: bench_store_cost(args, model_vocab(args)), table,
                    page_row)


if __name__ == "__main__":
    sys.exit(main())
