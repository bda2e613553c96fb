"""The restart bench: multi-turn conversations on an engine with a storage tier, the engine
closed and a new one started on the same storage midway (the same directory, or the same
Mooncake store), then the conversations' next turns; their hit rate against the same turns on
an engine that was never restarted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import cli, mooncake_local, tables
from benchmarks.host_hit import args_token_bytes
from benchmarks.rows import Rule, Target
from jhicache.arg_types import positive_int
from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients
from jhicache.bench.backends import EngineBackend
from jhicache.bench.command import model_vocab
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, make_engine
from jhicache.bench.multiturn import (
    clients_config,
    device_tokens_for,
    mode_overrides,
    multiturn_spec,
    turn_params,
)
from jhicache.bench.workload import MultiTurnSpec, user_turns
from jhicache.engine import Engine
from jhicache.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Leg:
    """Rounds served by one engine, from the conversations held so far."""

    run: clients.ClientsRun
    stats: dict
    compiles: int  # XLA compiles while it served (0: warm-up covered every step)


def bench_restart(args: argparse.Namespace, vocab: int) -> dict:
    """Straight: every round on one engine. Restarted: the rounds before `--restart-round` on
    an engine, then, on a new engine over the same storage (the first closed as a clean stop
    closes it: every cached page written to storage), the rest. Each engine is warmed up
    before it serves; each run has storage of its own (a directory under `--storage-dir`, or
    a Mooncake store started for it), removed after."""
    spec = dataclasses.replace(multiturn_spec(args, vocab), vocab_size=vocab)
    args._device_tokens = device_tokens_for(args, spec)
    after = args.restart_round if args.restart_round is not None else spec.num_rounds // 2
    if not 0 < after < spec.num_rounds:
        raise ValueError(f"--restart-round {after}: expected 1..{spec.num_rounds - 1}")
    turns, params = user_turns(spec), turn_params(spec)
    root = Path(tempfile.mkdtemp(prefix="jhicache-restart-", dir=args.storage_dir))
    try:
        with _storage(args, spec, root / "straight") as backend:
            straight = _leg(args, spec, backend, turns, params, None)
        with _storage(args, spec, root / "restarted") as backend:
            before = _leg(args, spec, backend, turns[:after], params[:after], None)
            restarted = _leg(args, spec, backend, turns[after:], params[after:],
                             before.run.histories)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    later = [t for t in straight.run.turns if t.round >= after]
    result = {"restart_round": after, "spec": dataclasses.asdict(spec),
              "storage_backend": args.storage_backend,
              "straight": _hits(later), "restarted": _hits(restarted.run.turns),
              "before_restart": _hits(before.run.turns),
              "compiles": [straight.compiles, before.compiles, restarted.compiles],
              "storage_pages_at_restart": before.stats["storage_pages"],
              "same_answers": _answers(later) == _answers(restarted.run.turns, after)}
    result["hit_rate_ratio"] = (result["restarted"]["hit_rate"]
                                / result["straight"]["hit_rate"])
    return result


@contextlib.contextmanager
def _storage(args: argparse.Namespace, spec: MultiTurnSpec, root: Path) -> Iterator[dict]:
    """The engine options of one run's storage: a directory, or a Mooncake store on this
    machine (a master and a store service) holding every page the run writes."""
    if args.storage_backend == "file":
        yield {"storage_dir": str(root)}
        return
    tokens = spec.num_clients * (spec.final_context_tokens + args.page_size)
    with mooncake_local.local_store(root, tokens * args_token_bytes(args) + (64 << 20)) as store:
        yield {"storage_backend": "mooncake", "storage_backend_config": json.dumps(store[0])}


def _leg(args: argparse.Namespace, spec: MultiTurnSpec, backend: dict, turns: Sequence,
         params: Sequence, histories: Sequence[Sequence[int]] | None) -> Leg:
    """A new engine on the storage `backend` (its engine options), warmed up, serves `turns`
    (in process, as a server would), then writes its backups and is closed."""
    no_dir = argparse.Namespace(**{**vars(args), "storage_dir": None})  # (it makes none)
    overrides = {**mode_overrides(no_dir, spec, "hierarchical"), **backend}
    if args.fetch_policy:
        overrides["fetch_policy"] = args.fetch_policy
    engine = make_engine(args, **overrides)
    try:
        with as_served(engine), CompileCounter() as compiles:
            run = asyncio.run(_serve(engine, turns, params, args, histories))
    finally:
        engine.close()  # as a clean stop does: every cached page is written to storage
    return Leg(run, engine.stats().as_dict(), compiles.count)


async def _serve(engine: Engine, turns: Sequence, params: Sequence[Sequence[SamplingParams]],
                 args: argparse.Namespace,
                 histories: Sequence[Sequence[int]] | None) -> clients.ClientsRun:
    async with AsyncEngine(engine) as served:
        return await clients.run_clients(EngineBackend(served), turns, params,
                                         clients_config(args, args.seed), histories=histories)


def _hits(turns: Sequence[clients.Turn]) -> dict:
    """Prompt tokens hit in each tier, and in all, over these turns' prompt tokens."""
    prompt = sum(t.prompt_len for t in turns)
    tiers = {tier: sum(getattr(t, f"{tier}_hit_tokens") for t in turns) / prompt
             for tier in ("device", "host", "storage")}
    return {"prompt_tokens": prompt, "requests": len(turns),
            **{f"{tier}_hit_rate": rate for tier, rate in tiers.items()},
            "hit_rate": sum(tiers.values())}


def _answers(turns: Sequence[clients.Turn], offset: int = 0) -> dict:
    return {(t.client, t.round + offset): t.token_ids for t in turns}


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--restart-round", type=positive_int, metavar="N", default=None,
                   help="the round before which the engine restarts on its storage (unset: "
                        "half the rounds)")
    p.add_argument("--storage-backend", choices=("file", "mooncake"), default="file",
                   help="the storage tier: a directory (under --storage-dir), or a Mooncake "
                        "Store started on this machine for each run (a master and a store "
                        "service holding the pages)")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target]:
    return "restart", Target(">= 0.95", (Rule("ratio", "ratio", at_least=0.95),))


def main(argv: list[str] | None = None) -> int:
    return cli.main("restart", "restart", __doc__ or "", argv, add_options,
                    lambda args, save: bench_restart(args, model_vocab(args)),
                    tables.restart_table, page_row)


if __name__ == "__main__":
    sys.exit(main())
