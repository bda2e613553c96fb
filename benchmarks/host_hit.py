"""The host-hit bench: TTFT of a prefix cached nowhere, on device or on host, and ceilings."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jhicache.models import DecoderConfig

from benchmarks import cli, tables
from benchmarks.cli import sized
from benchmarks.rows import Rule, Target
from jhicache.bench.clients import median_index
from jhicache.bench.engines import make_engine
from jhicache.bench.workload import random_prompts
from jhicache.config import KVDtype, TransferTuning
from jhicache.engine import Engine
from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams


def _ttft(out: RequestOutput) -> float:
    """A finished request's TTFT (set once its first token is known)."""
    assert out.ttft_s is not None
    return out.ttft_s


def ttft_of(engine: Engine, prompt: list[int]) -> tuple[float, RequestOutput]:
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    return _ttft(out), out


def push_to_host(engine: Engine) -> float:
    """Evicts every unlocked device page (writing back what the host lacks) and waits for the
    copies; returns the seconds that took, end to end."""
    start = time.perf_counter()
    engine.evict()
    return time.perf_counter() - start


def stats_delta(engine: Engine, before: dict, keys: tuple[str, ...]) -> dict:
    """How much each of `keys` in engine.stats() grew since `before`, as `engine_<key>`."""
    after = engine.stats().as_dict()
    return {f"engine_{k}": after[k] - before[k] for k in keys}


def timed_load_alone(engine: Engine, prompt: list[int]) -> float:
    """Seconds for the load-back of `prompt`'s host run with no compute around it."""
    start = time.perf_counter()
    if not engine.load_back(prompt):
        return float("nan")
    return time.perf_counter() - start


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
    engine.check_invariants()  # raises if a kernel stopped waiting for a layer's loads
    measured["gate_timeouts"] = 0  # so none did
    device_s, _ = ttft_of(engine, prefix + turns[2])  # prefix now on device
    beside_s = device_hit_beside_write_back(engine, prefix, other, turns[3:6])
    push_to_host(engine)
    load_s = timed_load_alone(engine, prefix + turns[6])
    return {"no_cache_ttft_s": none_s, "host_hit_ttft_s": host_s, "device_hit_ttft_s": device_s,
            "host_hit_tokens": host_out.host_hit_tokens, "load_alone_s": load_s,
            "write_back_s": write_s, "write_back_bytes": written, "write_back_copy_s": copy_s,
            "device_hit_beside_write_back_ttft_s": beside_s, "host_hit_timeline": timeline,
            **measured}


def traced_ttft(engine: Engine, prompt: list[int]) -> tuple[float, RequestOutput, dict]:
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
    return _ttft(out), out, {
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
    pages = len(other) // engine.config.page_size
    freed = engine.evict(pages, wait=False)
    ttft_s, out = ttft_of(engine, prefix + turns[2])
    if freed < pages or out.host_hit_tokens or out.device_hit_tokens < len(prefix):
        raise RuntimeError("the eviction did not take exactly `other`: no device hit to time")
    engine.drain()
    return ttft_s


def host_hit_engine(args: argparse.Namespace, **tuning: int) -> Engine:
    """The host-hit bench's engine: hierarchical, every host run loaded back, a device pool of
    four times (the prefix, its turn and two pages) tokens. `tuning`: `TransferTuning` fields
    its transfers use instead (a probe for the benchmark scripts)."""
    tokens = 4 * (args.host_hit_prefix + args.host_hit_turn + 2 * args.page_size)
    return make_engine(args, cache_mode="hierarchical", device_kv_tokens=tokens,
                       load_back_threshold=1, transfer_tuning=TransferTuning(**tuning))


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
    median = median_index(ratios)
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
    """KV bytes of one token over all layers, K and V, as the pools store it."""
    return token_bytes(engine.model_config, KVDtype(engine.config.dtype))


def token_bytes(cfg: DecoderConfig, dtype: KVDtype | str) -> int:
    """KV bytes of one token of a model with `cfg`'s shape over all layers, K and V."""
    itemsize = jnp.dtype(KVDtype(dtype).value).itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def args_token_bytes(args: argparse.Namespace) -> int:
    """A token's KV bytes for a bench's model (`--weights` or `--preset`, `--dtype`), before
    any engine is built."""
    from jhicache.models import preset_config
    from jhicache.models.weights import read_config

    config = read_config(args.weights) if args.weights else preset_config(args.preset)
    return token_bytes(config, args.dtype)


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--host-hit-prefix", **sized(count, 8192, 256),
                   help="cached prefix tokens")
    p.add_argument("--host-hit-turn", **sized(count, 64, 16), help="new turn tokens")
    p.add_argument("--host-hit-trials", **sized(count, 5, 1),
                   help="measured trials (after a warm-up one); the figures printed are the "
                        "median trial's by the host-hit ratio")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target]:
    """The host-hit ratio's target: 1.1 (1.3 for a model as small as 0.5B, whose forward is
    too short to hide a load behind)."""
    bound = 1.3 if "0.5b" in str(args.weights or args.preset).lower() else 1.1
    return "host_hit", Target(str(bound), (Rule("ratio", "ratio", at_most=bound),))


def main(argv: list[str] | None = None) -> int:
    return cli.main("host-hit", "host_hit", __doc__ or "", argv, add_options,
                    lambda args, save: bench_host_hit(args), tables.host_hit_table,
                    page_row)


if __name__ == "__main__":
    sys.exit(main())
