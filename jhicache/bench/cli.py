"""The command line of `python -m jhicache.bench`: its options, and checks across options."""

from __future__ import annotations

import argparse
import enum
import importlib.util
import math
from typing import Any

import jax

from jhicache.arg_types import (
    Given,
    non_negative_float,
    non_negative_int,
    penalty,
    positive_float,
    positive_int,
)
from jhicache.bench import clients
from jhicache.bench.arg_types import (
    MODES,
    checkpoint_dir,
    fraction,
    mode_list,
    output_file,
    preset_name,
    request_rate,
    server_url,
    storage_directory,
    store_config,
)
from jhicache.bench.engines import engine_config
from jhicache.config import EngineConfig, FetchPolicy, KVDtype, WritePolicy
from jhicache.logprobs import MAX_LOGPROBS
from jhicache.models.presets import PRESETS

DESCRIPTION = """\
`python -m jhicache.bench`: model throughput and the multi-turn cache benchmark.

With no arguments it runs both on the `tiny` preset at CPU-sized defaults (under two minutes
without a GPU). `multiturn --url URL` drives a running server's POST /generate instead of an
engine in this process. The benchmarks that time the engine's parts (host-hit, storage-hit,
scoring, restart, serve-overhead, kernels) live in the repository's `benchmarks/` folder:
`python -m benchmarks.<name>` from the repository root.
"""


# What configures the bench's own engine: with --url the server's flags do instead.
ENGINE_OPTIONS = ("--weights", "--dtype", "--page-size", "--working-set-ratio",
                  "--device-kv-tokens", "--write-policy", "--max-running-requests",
                  "--chunked-prefill-tokens")


def build_parser() -> argparse.ArgumentParser:
    """`python -m jhicache.bench`'s command line: which benchmark, then the shared options."""
    p = common_parser("python -m jhicache.bench", DESCRIPTION)
    p.add_argument("what", nargs="?", default="all", choices=("all", "model", "multiturn"),
                   help="which benchmark; `all` = model + multiturn")
    return p


def common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every bench shares (model, engine, workload, output); sizes default to GPU-
    or CPU-sized values by the JAX backend. `benchmarks/` builds its benches' on it."""
    gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(
        prog=prog, description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Size defaults shown are for this machine's JAX backend ({jax.default_backend()}); "
               "a GPU gets larger ones.")
    p.set_defaults(given=frozenset())
    p.add_argument("--url", type=server_url, metavar="URL", default=None,
                   help="multiturn: drive the server at http://HOST:PORT (POST /generate, token "
                        "ids) instead of an engine here, once, as the server was started; its "
                        "vocabulary from /get_model_info, else --preset's")
    p.add_argument("--preset", type=preset_name, default="tiny", choices=tuple(PRESETS),
                   help="model shape, with seeded random weights")
    p.add_argument("--weights", action=Given, type=checkpoint_dir, metavar="DIR", default=None,
                   help="Hugging Face checkpoint directory of Qwen2, Qwen3 or Llama 3 "
                        "(overrides --preset)")
    p.add_argument("--dtype", action=Given, default="bfloat16" if gpu else "float32",
                   choices=_values(KVDtype), help="weights and KV pages dtype")
    count: dict[str, Any] = {"type": positive_int, "metavar": "N"}
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
    p.add_argument("--range-ratio", type=fraction, metavar="R", default=1.0,
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
    p.add_argument("--storage-dir", type=storage_directory, metavar="DIR", default=None,
                   help="storage-hit: where its storage tier and the disk probe's files go "
                        "(unset: the system's temporary directory); multiturn: a storage tier "
                        "under the hierarchical mode, there (a temporary directory in it, "
                        "removed after; made if missing)")
    p.add_argument("--mooncake-config", type=store_config, metavar="JSON", default=None,
                   help="multiturn: a Mooncake Store tier under the hierarchical mode (instead "
                        "of --storage-dir's files), a client config as the server's "
                        "--storage-backend-config takes (JSON, or @FILE)")
    p.add_argument("--logprobs", type=non_negative_int, metavar="N", default=None,
                   help="multiturn (in process): every request asks for its tokens' log "
                        "probabilities, N alternatives each (at most 20)")
    p.add_argument("--temperature", type=non_negative_float, metavar="T", default=0.0,
                   help="multiturn, serve-overhead: every answer sampled at this temperature, "
                        "each turn with a seed of its own (0: greedy)")
    p.add_argument("--top-p", type=fraction, metavar="P", default=None,
                   help="multiturn, serve-overhead: sampled answers from this nucleus (needs "
                        "--temperature > 0)")
    for name, kind, default, what in (
            ("presence", penalty, 0.0, "OpenAI's presence penalty, in [-2, 2]"),
            ("frequency", penalty, 0.0, "OpenAI's frequency penalty, in [-2, 2]"),
            ("repetition", positive_float, 1.0, "the repetition penalty (Hugging Face's; 1: "
                                               "off)")):
        p.add_argument(f"--{name}-penalty", type=kind, metavar="X", default=default,
                       help=f"multiturn, serve-overhead: every request with {what}")
    p.add_argument("--fetch-policy", default=None, choices=_values(FetchPolicy),
                   help="how a request waits for its pages from storage (unset: storage-hit "
                        "reads them in full first; multiturn and restart take the engine's own)")
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
    if args.logprobs is not None and args.logprobs > MAX_LOGPROBS:
        p.error(f"--logprobs {args.logprobs}: at most {MAX_LOGPROBS}")
    if args.top_p is not None and args.temperature == 0:
        p.error("--top-p filters sampled answers: give --temperature > 0 too")
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
    if args.logprobs is not None:
        p.error("--logprobs asks the engine in this process; with --url it would be ignored")
    if importlib.util.find_spec("aiohttp") is None:
        p.error("--url needs aiohttp: pip install -e '.[serve]'")
