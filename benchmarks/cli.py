"""The scenario benches' command lines (`python -m benchmarks.<name>`): `jhicache.bench`'s shared
options plus each bench's own, and the run that prints a bench's table and writes its JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.rows import Target, add_row
from jhicache.arg_types import positive_int
from jhicache.bench import cli
from jhicache.bench.command import leave_device_memory, result_header, save_json, timing_note

AddOptions = Callable[[argparse.ArgumentParser, dict[str, Any]], None]
SavePart = Callable[[dict], None]
Bench = Callable[[argparse.Namespace, SavePart], dict]
# The page row a run writes into its result file: its kind and target, or None (no row).
PageRow = Callable[[argparse.Namespace, dict], "tuple[str, Target] | None"]


def build_parser(what: str, description: str, add_options: AddOptions) -> argparse.ArgumentParser:
    """The shared options and `add_options`' own."""
    p = cli.common_parser(f"python -m benchmarks.{what.replace('-', '_')}", description)
    p.set_defaults(what=what)
    gpu = jax.default_backend() == "gpu"
    add_options(p, {"type": positive_int, "metavar": "N", "gpu": gpu})
    return p


def parse(what: str, description: str, argv: list[str] | None,
          add_options: AddOptions) -> argparse.Namespace:
    """The command line, with the shared checks across options."""
    p = build_parser(what, description, add_options)
    args = p.parse_args(argv)
    cli.check_combination(p, args)
    return args


def main(what: str, key: str, description: str, argv: list[str] | None,
         add_options: AddOptions, bench: Bench, table: Callable[[dict], str],
         page_row: PageRow, own_device_memory: bool = True) -> int:
    """Runs one bench: its table printed, its result under `key` in the JSON of --out (written
    as each part ends, through `bench`'s SavePart, and at the end), with the page row that
    `page_row` names (`rows.add_row`: result, ceiling, target, met) beside it. Without
    `own_device_memory` (a bench that starts an engine process or server) JAX's
    preallocation is off, in this process and its children."""
    if not own_device_memory:
        leave_device_memory()
    args = parse(what, description, sys.argv[1:] if argv is None else argv, add_options)
    note = timing_note(jax.default_backend())
    if note:
        print(note, flush=True)
    result = result_header(args)
    result[key] = bench(args, lambda part: save_json({**result, key: part}, args.out))
    print(table(result[key]))
    row = page_row(args, result[key])
    if row is not None:
        result = add_row(result, *row)
    save_json(result, args.out)
    return 0


def sized(count: dict[str, Any], gpu_value: int, cpu_value: int) -> dict[str, Any]:
    """A count option's type and metavar, with the default for this machine's backend."""
    return {"type": count["type"], "metavar": count["metavar"],
            "default": gpu_value if count["gpu"] else cpu_value}
