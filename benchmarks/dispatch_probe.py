"""Host time of dispatching one jitted program against how many arrays it takes and returns,
and against how many kernels it launches and of which kind: the probe behind the question what
sets a step's host time (the forward's programs take every layer's weights and K/V pages as
separate arrays, and launch XLA's kernels with Pallas calls between them).

Usage: PYTHONPATH=. python3 benchmarks/dispatch_probe.py [--reps 200] [--ffi-calls] --out FILE.json
Run it again under `XLA_FLAGS=--xla_gpu_enable_command_buffer=` to see what XLA's command
buffers (CUDA graphs) save; the result records the flags.

- `rows`: n small arrays in, one scalar out (`in_one_out_us`), or n donated arrays updated in
  place (`donated_in_place_us`).
- `kernel_rows`: one array in and out through a chain of `layers` dependent small matmuls
  (each with a tanh, so each is a kernel of its own), alone (`xla_only`) or each followed by a
  trivial Pallas call lowered by Pallas's Triton backend (`with_pallas`) or by its Mosaic GPU
  backend (`with_mosaic`): host dispatch time, and for the 28-layer chains where the compiled
  program's custom calls run (`custom_calls`: per target, how many sit inside XLA's command
  buffers and how many outside). Triton calls split XLA's command buffers on jax 0.11.2;
  jaxlib registers Mosaic GPU's custom call as command-buffer compatible, which `with_mosaic`
  against `xla_only` shows or refutes.
"""

from __future__ import annotations

import argparse
import os
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as pltriton
from jhicache.pallas_kernels.backend import lower_to_ffi_calls, use_interpreter

from benchmarks.kernels.timing import dispatch_us
from jhicache.bench.command import save_json

# the kernel rows' programs: the Pallas backend of the call after each matmul (None: no call)
PROGRAMS = {"xla_only": None, "with_pallas": "triton", "with_mosaic": "mosaic_gpu"}


def _doubled(x: jax.Array, backend: str) -> jax.Array:
    """A trivial Pallas call, 2x, lowered by Pallas's `backend` ("triton" or "mosaic_gpu")."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if backend == "triton":
        return pl.pallas_call(kernel, out_shape=out, compiler_params=pltriton.CompilerParams(),
                              interpret=use_interpreter())(x)
    # (jax 0.11.2 has no lowering for `pallas_call` with Mosaic GPU params: `kernel` it is)
    return plmgpu.kernel(kernel, out_type=out, interpret=use_interpreter())(x)


def _chain(layers: int, backend: str | None) -> jax.stages.Wrapped:
    def run(x: jax.Array, w: jax.Array) -> jax.Array:
        for _ in range(layers):
            x = jnp.tanh(x @ w)
            if backend is not None:
                x = _doubled(x, backend)
        return x
    return jax.jit(run)


def custom_call_placement(hlo: str) -> dict[str, dict[str, int]]:
    """Custom-call targets in an optimized HLO module's text, counted by where they sit: inside a
    command buffer (a computation XLA's command-buffer pass outlined, named `command_buffer...`,
    which runs as one CUDA graph) or outside one (launched on its own)."""
    placement: dict[str, dict[str, int]] = {}
    computation = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.removeprefix("ENTRY ").lstrip("%").split(" ", 1)[0]
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target:
            where = "in_command_buffer" if computation.startswith("command_buffer") else "outside"
            counts = placement.setdefault(target.group(1), {"in_command_buffer": 0, "outside": 0})
            counts[where] += 1
    return placement


def kernel_rows(reps: int) -> list[dict]:
    """Host dispatch time of chains of small kernels, with and without Pallas calls. (Their
    GPU time is not taken here: on the H200, 20 calls of the 28-layer chain timed back to back
    after 3 warm-up calls took 1.5 ms each, and 0.05 ms after 200 calls, so time per kernel is
    read from the forward's own trace instead.)"""
    x, w = jnp.ones((16, 64), jnp.bfloat16), jnp.full((64, 64), 0.01, jnp.bfloat16)
    rows: list[dict[str, object]] = []
    for layers in (28, 112, 448):
        outputs: dict[str, jax.Array] = {}
        for program, backend in PROGRAMS.items():
            fn = _chain(layers, backend)
            try:
                outputs[program] = jax.block_until_ready(fn(x, w))  # compiles
            except Exception as e:  # noqa: BLE001  a backend this jax cannot lower: say so
                rows.append({"layers": layers, "program": program, "error": repr(e)[:300]})
            else:
                rows.append({"layers": layers, "program": program,
                             "dispatch_us": dispatch_us(lambda: fn(x, w), reps)})
                if layers == 28:  # where its calls run (compiling once more, so only the shortest)
                    hlo = fn.lower(x, w).compile().as_text() or ""
                    rows[-1]["custom_calls"] = custom_call_placement(hlo)
            print(rows[-1], flush=True)
        if {"with_pallas", "with_mosaic"} <= outputs.keys():  # the same computation
            rows[-1]["outputs_equal"] = bool((outputs["with_pallas"]
                                              == outputs["with_mosaic"]).all())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ffi-calls", action="store_true",
                        help="lower the Pallas-Triton calls to jaxlib's FFI call "
                             "(`backend.lower_to_ffi_calls`), before any program is built")
    args = parser.parse_args()
    ffi_calls = lower_to_ffi_calls() if args.ffi_calls else False
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
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "ffi_calls": ffi_calls, "rows": rows,
               "kernel_rows": kernel_rows(args.reps)}, args.out)


if __name__ == "__main__":
    main()
