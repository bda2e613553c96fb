"""Host time of dispatching one jitted program against how many arrays it takes and returns,
and against how many kernels it launches and of which kind: the probe behind the question what
sets a step's host time (the forward's programs take every layer's weights and K/V pages as
separate arrays, and launch XLA's kernels with Pallas calls between them).

Usage: PYTHONPATH=. python3 benchmarks/dispatch_probe.py [--reps 200] --out FILE.json
Run it again under `XLA_FLAGS=--xla_gpu_enable_command_buffer=` to see what XLA's command
buffers (CUDA graphs) save; the result records the flags.

- `rows`: n small arrays in, one scalar out (`in_one_out_us`), or n donated arrays updated in
  place (`donated_in_place_us`).
- `kernel_rows`: one array in and out through a chain of `layers` dependent small matmuls
  (each with a tanh, so each is a kernel of its own), alone (`xla_only`) or each followed by a
  trivial Pallas call (`with_pallas`): host dispatch time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jhicache.pallas_kernels.backend import use_interpreter

from benchmarks.kernels.timing import dispatch_us
from jhicache.bench.command import save_json


def _doubled(x: jax.Array) -> jax.Array:
    """A trivial Pallas call: 2x."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=use_interpreter())(x)


def _chain(layers: int, pallas: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def run(x: jax.Array, w: jax.Array) -> jax.Array:
        for _ in range(layers):
            x = jnp.tanh(x @ w)
            if pallas:
                x = _doubled(x)
        return x
    return jax.jit(run)


def kernel_rows(reps: int) -> list[dict]:
    """Host dispatch time of chains of small kernels, with and without Pallas calls. (Their
    GPU time is not taken here: on the H200, 20 calls of the 28-layer chain timed back to back
    after 3 warm-up calls took 1.5 ms each, and 0.05 ms after 200 calls, so time per kernel is
    read from the forward's own trace instead.)"""
    x, w = jnp.ones((16, 64), jnp.bfloat16), jnp.full((64, 64), 0.01, jnp.bfloat16)
    rows = []
    for layers in (28, 112, 448):
        for pallas in (False, True):
            fn = _chain(layers, pallas)
            jax.block_until_ready(fn(x, w))  # compiles
            rows.append({"layers": layers, "program": "with_pallas" if pallas else "xla_only",
                         "dispatch_us": dispatch_us(lambda: fn(x, w), reps)})
            print(rows[-1], flush=True)
    return rows


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
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows,
               "kernel_rows": kernel_rows(args.reps)}, args.out)


if __name__ == "__main__":
    main()
