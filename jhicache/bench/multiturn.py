"""The multi-turn bench in process: each cache mode's measured run on a warm engine."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shutil
import sys
import tempfile
from collections.abc import Callable

from tqdm import tqdm

from jhicache.async_engine import AsyncEngine
from jhicache.bench import clients
from jhicache.bench.backends import EngineBackend
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, make_engine
from jhicache.bench.workload import MultiTurnSpec, output_lengths, user_turns
from jhicache.engine import Engine
from jhicache.sampling import SamplingParams


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


def mode_engine(args: argparse.Namespace, spec: MultiTurnSpec, mode: str) -> tuple[str, int]:
    """The engine's cache mode and device pool tokens for a bench mode."""
    cache_mode, device_tokens = mode, args._device_tokens
    # the reference for hit rates: what reuse a big enough device pool gives
    if mode == "unbounded":
        margin = spec.num_clients * 2 * args.page_size  # each conversation's partial last pages
        cache_mode, device_tokens = "device", max(device_tokens, spec.working_set_tokens + margin)
    return cache_mode, device_tokens


def mode_overrides(args: argparse.Namespace, spec: MultiTurnSpec, mode: str) -> dict:
    """A bench mode's engine settings: cache mode, device pool, and requests no longer than the
    workload's (the page tables, and the grid, fit it)."""
    cache_mode, device_tokens = mode_engine(args, spec, mode)
    longest = -(-spec.final_context_tokens // args.page_size) * args.page_size
    overrides = {"cache_mode": cache_mode, "device_kv_tokens": device_tokens,
                 "max_context_len": longest}
    if cache_mode == "hierarchical":
        overrides.update(storage_overrides(args))
    return overrides


def storage_overrides(args: argparse.Namespace) -> dict:
    """The storage tier's settings: a Mooncake Store (`--mooncake-config`), a temporary
    directory in `--storage-dir`, or none (empty)."""
    if getattr(args, "mooncake_config", None):
        tier = {"storage_backend": "mooncake", "storage_backend_config": args.mooncake_config}
    elif getattr(args, "storage_dir", None):
        tier = {"storage_dir": tempfile.mkdtemp(prefix="jhicache-bench-", dir=args.storage_dir)}
    else:
        return {}
    if getattr(args, "fetch_policy", None):
        tier["fetch_policy"] = args.fetch_policy
    return tier


def measured_run(args: argparse.Namespace, spec: MultiTurnSpec, mode: str,
                 progress: tqdm) -> MeasuredRun:
    """Runs the workload once, in process, on a fresh engine warmed up as a server's is
    (`as_served`); counts the compiles the run made (0 when the grid covers every step)."""
    overrides = mode_overrides(args, spec, mode)
    engine = make_engine(args, **overrides)
    run_spec = dataclasses.replace(spec, vocab_size=engine.model_config.vocab_size)
    with as_served(engine), CompileCounter() as compiles:
        run = drive_in_process(engine, run_spec, clients_config(args, args.seed), progress,
                               turn_sampling(args))
    engine.check_invariants()
    if engine.config.storage_enabled:  # the run's pages are all written, its threads end
        engine.close()
    if "storage_dir" in overrides:  # the storage tier's pages are this run's alone
        shutil.rmtree(overrides["storage_dir"])
    return MeasuredRun(run, engine, overrides["device_kv_tokens"], compiles.count, compiles.seconds,
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


@dataclasses.dataclass(frozen=True)
class TurnSampling:
    """How every turn's answer is drawn: greedy, or at `temperature` (> 0) from the `top_p`
    nucleus with a seed per turn; with `logprobs` alternatives per token where given; with the
    penalties given (their SamplingParams fields)."""

    temperature: float = 0.0
    top_p: float | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


def turn_sampling(args: argparse.Namespace) -> TurnSampling:
    return TurnSampling(getattr(args, "temperature", 0.0), getattr(args, "top_p", None),
                        getattr(args, "logprobs", None), getattr(args, "presence_penalty", 0.0),
                        getattr(args, "frequency_penalty", 0.0),
                        getattr(args, "repetition_penalty", 1.0))


def clients_config(args: argparse.Namespace, seed: int) -> clients.ClientsConfig:
    return clients.ClientsConfig(request_rate=args.request_rate, max_parallel=args.max_parallel,
                                 ready_queue_policy=args.ready_queue_policy,
                                 round_barrier=args.round_barrier == "on", seed=seed)


def drive_in_process(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                     progress: tqdm, sampling: TurnSampling = TurnSampling()
                     ) -> clients.ClientsRun:
    return asyncio.run(drive_clients(engine, spec, config, progress, sampling))


async def drive_clients(engine: Engine, spec: MultiTurnSpec, config: clients.ClientsConfig,
                        progress: tqdm, sampling: TurnSampling = TurnSampling()
                        ) -> clients.ClientsRun:
    """The clients' conversations through an AsyncEngine over `engine`, as a server drives it;
    closed at the end (its thread then lets go of the engine, whose stats the caller reads)."""
    async with AsyncEngine(engine) as served:
        return await clients.run_clients(EngineBackend(served), user_turns(spec),
                                         turn_params(spec, sampling), config,
                                         on_turn=lambda turn: progress.update(1))


def turn_params(spec: MultiTurnSpec, sampling: TurnSampling = TurnSampling()
                ) -> list[list[SamplingParams]]:
    """Each turn's sampling (`[round][client]`): its drawn answer length, and `sampling`, a
    sampled turn seeded by its place (the same tokens whichever path serves it)."""
    sampled = sampling.temperature > 0
    return [[SamplingParams(max_new_tokens=n, temperature=sampling.temperature,
                            top_p=sampling.top_p if sampled else None,
                            seed=r * spec.num_clients + c if sampled else None,
                            logprobs=sampling.logprobs,
                            presence_penalty=sampling.presence_penalty,
                            frequency_penalty=sampling.frequency_penalty,
                            repetition_penalty=sampling.repetition_penalty)
             for c, n in enumerate(row)] for r, row in enumerate(output_lengths(spec))]


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


def sending(args: argparse.Namespace) -> dict:
    """How the requests were sent, for the JSON (`inf` spelt as on the command line: JSON has
    no infinity)."""
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    return {"request_rate": rate, "max_parallel": args.max_parallel or args.clients,
            "ready_queue_policy": args.ready_queue_policy, "round_barrier": args.round_barrier,
            **dataclasses.asdict(turn_sampling(args))}
