"""`python -m jhicache.bench`: runs the benchmarks named, prints their tables, writes JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax

from jhicache.bench import report
from jhicache.bench.backends import ServerError
from jhicache.bench.cli import parse_args
from jhicache.bench.engines import make_engine
from jhicache.bench.model import bench_model
from jhicache.bench.multiturn import bench_multiturn
from jhicache.bench.remote_run import bench_remote
from jhicache.models.presets import preset_config


def run(args: argparse.Namespace) -> dict:
    """Runs what `args.what` names; writes the JSON to `args.out` after each part and at the end."""
    result = result_header(args)
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
    return result


def result_header(args: argparse.Namespace) -> dict:
    """What every result file starts with: when, on what, with which model and pages."""
    return {"date": datetime.date.today().isoformat(),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "preset": args.weights or args.preset,
            "page_size": args.page_size, "dtype": args.dtype, "write_policy": args.write_policy}


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
        leave_device_memory()
    args = parse_args(argv)
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


def leave_device_memory() -> None:
    """Turns JAX's GPU memory preallocation off in this process (before its first backend
    call) and the engine processes it starts: the client needs no accelerator memory, and the
    server on the same GPU or an engine process needs it (75% would be taken otherwise)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def timing_note(backend: str) -> str | None:
    """What a non-GPU run's timings are worth: the bench is tuned for, and only meaningful on, a
    GPU."""
    if backend == "gpu":
        return None
    return (f"note: on the {backend.upper()} backend, timings only check that the bench runs; "
            "they say nothing about performance")
