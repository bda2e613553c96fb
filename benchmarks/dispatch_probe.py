"""Host time of dispatching one jitted program against how many arrays it takes and returns:
the probe behind the question whether per-array dispatch costs set a step's host time (the
forward's programs take every layer's weights and K/V pages as separate arrays).

Usage: PYTHONPATH=. python3 benchmarks/dispatch_probe.py [--reps 200] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def dispatch_us(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    """Median host time of `fn(*args)` returning (not its device work) over `reps` calls after
    a warm-up one; the device is idle at each call (its outputs are waited for outside the
    timing). A program that returns a list donated its inputs: the next call takes the list."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        if isinstance(out, list):
            args = (out,)
    return float(np.median(times[1:]) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for n in (14, 56, 112, 364):
        xs = [jnp.ones((64, 64), jnp.bfloat16) for _ in range(n)]
        read = jax.jit(lambda xs: sum(x[0, 0] for x in xs))
        update = jax.jit(lambda xs: [x + 1 for x in xs], donate_argnums=0)
        rows.append({"arrays": n, "in_one_out_us": dispatch_us(read, (xs,), args.reps),
                     "donated_in_place_us": dispatch_us(update, (xs,), args.reps)})
        print(rows[-1], flush=True)
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "reps": args.reps,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
