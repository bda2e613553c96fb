"""Host time of dispatching one jitted program against how many arrays it takes and returns:
the probe behind the question whether per-array dispatch costs set a step's host time (the
forward's programs take every layer's weights and K/V pages as separate arrays).

Usage: PYTHONPATH=. python3 benchmarks/dispatch_probe.py [--reps 200] --out FILE.json
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jhicache.bench import save_json
from jhicache.bench_kernels.timing import dispatch_us


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
        donated = [xs]

        def update_in_place() -> list[jax.Array]:  # each call takes the arrays the last returned
            donated[0] = update(donated[0])
            return donated[0]

        rows.append({"arrays": n, "in_one_out_us": dispatch_us(lambda: read(xs), args.reps),
                     "donated_in_place_us": dispatch_us(update_in_place, args.reps)})
        print(rows[-1], flush=True)
    save_json({"device": str(jax.devices()[0]), "jax": jax.__version__, "reps": args.reps,
               "rows": rows}, args.out)


if __name__ == "__main__":
    main()
