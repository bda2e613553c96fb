"""Probe, not yet run on a GPU: can kernels on XLA's compute stream wait, on the device, for
layers that our own copy stream is still loading? If so, a host hit's forward could be dispatched
whole at once (no layer split, no host wait per layer group, nothing compiled per group size).

    PYTHONPATH=. timeout 120 python3 benchmarks/spin_wait_probe.py --out probe.json  # on a GPU
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 benchmarks/spin_wait_probe.py --cpu-check

The mechanism: after each layer's host->device copies the copy stream writes the load's sequence
number into that layer's slot of a device flag array (`cuStreamWriteValue32`, which fences the
stream's earlier writes before its own). A Pallas kernel that reads a layer first spins, in
every program, on an atomic read of the flag until it reaches the step's sequence number (at
most `SPIN_LIMIT` reads; a program that runs out reports it), then reads the layer.

On the GPU it measures, with 28 layers of 16.8 MB (Qwen2-7B, 8192 tokens):
- `sums_match`: one jitted program that sums each layer after its wait, dispatched right after
  the copies were queued (each layer zeroed on the device before), against the float32 sums of
  the host values; `timed_out` must be 0;
- `wall_ms`: copies plus that program, without and with a 4096 x 4096 matmul after each layer's
  sum (on the order of a 7B layer's compute), against the copies alone and the program alone
  (flags already set), all in the same run.
`--cpu-check` runs the kernel in interpret mode on flags already set (and one unset, to see the
bounded spin report), which is all the CPU can check.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jhicache.bench.command import save_json

LAYERS, LAYER_BYTES = 28, 8192 * 4 * 128 * 2 * 2  # K and V of 8192 tokens, 4 heads x 128, bf16
BLOCK = 4096  # bf16 elements per program (Triton blocks are powers of two)
FLAG_SLOTS = 32  # one per layer, padded to a power of two
SPIN_LIMIT = 1 << 16  # atomic reads a program makes before it gives up and reports it


READS = ("add", "max", "or", "volatile")  # ways a program reads its flag (--diagnose tries all)


def _read_flag(flags_ref, layer, how: str) -> jax.Array:
    """flags[layer], read so that a value another stream wrote shows: an atomic that changes
    nothing (add 0, max 0, or 0; each acquiring) or a volatile load (which bypasses L1)."""
    at = (pl.ds(layer, 1),)
    zero = jnp.zeros((1,), jnp.int32)
    if how == "volatile":
        return plgpu.load(flags_ref.at[at], volatile=True)[0]
    op = {"add": plgpu.atomic_add, "max": plgpu.atomic_max, "or": plgpu.atomic_or}[how]
    return op(flags_ref, at, zero)[0]


def _wait_sum_kernel(flags_ref, seq_ref, layer_ref, after_ref, x_ref, sum_ref, late_ref, seen_ref,
                     *, limit: int, how: str):
    """One program: spin until flags[layer] >= seq, then sum this program's block. late = 1 when
    the spin ran out first. `after_ref` is not read: it only orders the kernel after the
    computation that produced it, as a layer's attention comes after the layer before it."""
    target, layer = seq_ref[0], layer_ref[0]
    read = lambda: _read_flag(flags_ref, layer, how)  # noqa: E731
    seen, _ = lax.while_loop(lambda c: (c[0] < target) & (c[1] < limit),
                             lambda c: (read(), c[1] + 1), (read(), 0))
    late_ref[0] = (seen < target).astype(jnp.int32)
    seen_ref[0] = seen
    sum_ref[0] = jnp.sum(x_ref[...].astype(jnp.float32))


def wait_sum(flags: jax.Array, seq: jax.Array, x: jax.Array, layer: int,
             after: jax.Array | None = None, *, limit: int = SPIN_LIMIT,
             interpret: bool = False,
             how: str = "add") -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of x, programs that ran out of spins, least flag value a program saw last), read
    only after flags[layer] >= seq[0], and run after `after` (any [1] float32 array) is
    computed. The layer index is an argument, not a constant, so every layer's call is the
    same Triton kernel (one compile, not one per layer)."""
    after = jnp.zeros((1,), jnp.float32) if after is None else after
    index = jnp.full((1,), layer, jnp.int32)
    blocks = x.shape[0] // BLOCK
    sums, late, seen = pl.pallas_call(
        functools.partial(_wait_sum_kernel, limit=limit, how=how),
        grid=(blocks,),
        in_specs=[pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec(),
                  pl.BlockSpec((BLOCK,), lambda i: (i,))],
        out_specs=[pl.BlockSpec((1,), lambda i: (i,))] * 3,
        out_shape=[jax.ShapeDtypeStruct((blocks,), jnp.float32),
                   jax.ShapeDtypeStruct((blocks,), jnp.int32),
                   jax.ShapeDtypeStruct((blocks,), jnp.int32)],
        interpret=interpret)(flags, seq, index, after, x)
    return jnp.sum(sums), jnp.sum(late), jnp.min(seen)


def reference_sum(x: np.ndarray) -> float:
    return float(x.astype(np.float32).sum())


def cpu_check(how: str) -> dict:
    """The kernel's logic in interpret mode: flags set -> sums and no late program; one flag
    unset -> every program of that layer runs out of its (small) spin budget."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(2 * BLOCK), jnp.bfloat16)
    flags = jnp.zeros((FLAG_SLOTS,), jnp.int32).at[0].set(3).at[1].set(1)
    seq = jnp.array([2], jnp.int32)
    total, late, _ = wait_sum(flags, seq, x, 0, limit=4, interpret=True, how=how)
    _, late_unset, _ = wait_sum(flags, seq, x, 1, limit=4, interpret=True, how=how)
    # two layers, each after the last
    program = _layer_program(True, width=8, interpret=True, how=how)
    sums, late_program, _ = program(flags.at[1].set(2), seq, [x, x + 1], jnp.ones((8, 8)))
    want = [reference_sum(np.asarray(x)), reference_sum(np.asarray(x + 1))]
    return {"sum_close": bool(abs(float(total) - reference_sum(np.asarray(x))) < 1.0),
            "late_when_set": int(late), "late_when_unset": int(late_unset),
            "program_sums_close": bool(np.allclose(np.asarray(sums), want, atol=1.0)),
            "program_late": int(late_program)}


def _layer_program(with_compute: bool, width: int = 4096, interpret: bool = False,
                   how: str = "add"):
    """Per layer: the wait-and-sum, then (optionally) a matmul that depends on the sum."""
    w = jnp.ones((width, width), jnp.bfloat16) * 1e-4

    def program(flags, seq, layers, h):
        sums, late, after = [], jnp.int32(0), None
        for layer, x in enumerate(layers):
            total, lost, _ = wait_sum(flags, seq, x, layer, after,  # after the layer before
                                      interpret=interpret, how=how)
            sums.append(total)
            late += lost
            if with_compute:
                h = (h + total.astype(h.dtype)) @ w  # after the wait: it needs the sum
            after = (h[0, :1] if with_compute else total[None]).astype(jnp.float32)
        return jnp.stack(sums), late, h

    return jax.jit(program)


def _progress(*parts: object) -> None:
    """One line on stderr now: a run cut short by a timeout still shows how far it got."""
    print(*parts, file=sys.stderr, flush=True)


def _check(call: str, result: int) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: CUDA error {result}")


def gpu_probe(how: str) -> dict:
    from jhicache.cache.cuda_driver import CudaDriver, load_library
    from jhicache.cache.host_memory import HostMemory

    lib = load_library()
    assert lib is not None, "no libcuda"
    drv = CudaDriver(lib)
    stream = drv.stream(priority=drv.priority_range()[1])
    count = LAYER_BYTES // 2  # bf16 elements a layer
    values = (np.random.default_rng(0).standard_normal(LAYERS * count, dtype=np.float32)
              .astype(jnp.bfloat16))
    host = HostMemory(LAYERS * LAYER_BYTES, drv)
    host.array.view(jnp.bfloat16)[:] = values
    expected = [reference_sum(values[i * count:(i + 1) * count]) for i in range(LAYERS)]
    layers = [jnp.zeros((count,), jnp.bfloat16) for _ in range(LAYERS)]
    flags = jnp.zeros((FLAG_SLOTS,), jnp.int32)
    jax.block_until_ready((layers, flags))
    flag_ptr = flags.unsafe_buffer_pointer()
    h = jnp.ones((4096, 4096), jnp.bfloat16)
    out: dict = {}

    def load(seq: int) -> None:
        """Each layer's copy, then its flag: the copy stream's order makes the flag follow it."""
        for i, x in enumerate(layers):
            drv.copy(np.array([x.unsafe_buffer_pointer()], np.uint64),
                     np.array([host.address + i * LAYER_BYTES], np.uint64),
                     np.array([LAYER_BYTES], np.uint64), stream, to_device=True)
            drv.write_value32(stream, flag_ptr + 4 * i, seq)

    def clear() -> None:
        """Zeroes every layer on the device, so a read before its copy lands shows."""
        for x in layers:
            _check("cuMemsetD8", lib.cuMemsetD8_v2(ctypes.c_uint64(x.unsafe_buffer_pointer()),
                                                   ctypes.c_ubyte(0),
                                                   ctypes.c_size_t(LAYER_BYTES)))
        _check("cuCtxSynchronize", lib.cuCtxSynchronize())

    seq = 0
    for with_compute in (False, True):
        name = "with_compute" if with_compute else "no_compute"
        program = _layer_program(with_compute, how=how)
        start = time.perf_counter()
        jax.block_until_ready(program(flags, jnp.array([0], jnp.int32), layers, h))  # compile
        out[f"{name}_first_call_s"] = time.perf_counter() - start
        _progress(name, "first call (compile)", out[f"{name}_first_call_s"])
        for trial in range(3):
            seq += 1
            clear()
            start = time.perf_counter()
            load(seq)
            sums, late, h_out = program(flags, jnp.array([seq], jnp.int32), layers, h)
            jax.block_until_ready((sums, late, h_out))
            out[f"{name}_{trial}"] = {
                "wall_ms": (time.perf_counter() - start) * 1e3, "timed_out": int(late),
                "sums_match": bool(np.allclose(np.asarray(sums), expected, rtol=1e-3, atol=1.0))}
            _progress(name, trial, out[f"{name}_{trial}"])
        start = time.perf_counter()
        jax.block_until_ready(program(flags, jnp.array([0], jnp.int32), layers, h))
        out[f"{name}_program_alone_ms"] = (time.perf_counter() - start) * 1e3
    _check("cuCtxSynchronize", lib.cuCtxSynchronize())
    start = time.perf_counter()
    load(seq + 1)
    _check("cuCtxSynchronize", lib.cuCtxSynchronize())
    out["copies_alone_ms"] = (time.perf_counter() - start) * 1e3
    host.close()
    return out


def diagnose() -> dict:
    """Small GPU checks of the pieces, each with a short spin budget: the kernel's atomic read of
    flags set by XLA, of a flag written by cuStreamWriteValue32 before the kernel runs, and what
    the flag array holds afterwards as JAX reads it."""
    from jhicache.cache.cuda_driver import CudaDriver, load_library

    lib = load_library()
    drv = CudaDriver(lib)
    stream = drv.stream()
    x = jnp.ones((8 * BLOCK,), jnp.bfloat16)
    out: dict = {}
    for how in READS:
        run = jax.jit(lambda f, s, how=how: wait_sum(f, s, x, 3, limit=1 << 12, how=how))

        def read(name: str, flags: jax.Array, seq: int, run=run, how=how) -> None:
            total, late, seen = run(flags, jnp.array([seq], jnp.int32))
            out[f"{how}_{name}"] = {"late": int(late), "min_seen": int(seen), "sum": float(total),
                                    "flags_as_jax_reads": np.asarray(flags)[:4].tolist()}
            _progress(how, name, out[f"{how}_{name}"])

        read("set_by_xla", jnp.full((FLAG_SLOTS,), 7, jnp.int32), 7)
        flags = jnp.zeros((FLAG_SLOTS,), jnp.int32)
        jax.block_until_ready(flags)
        ptr = flags.unsafe_buffer_pointer()
        drv.write_value32(stream, ptr + 12, 9)
        _check("cuCtxSynchronize", lib.cuCtxSynchronize())
        read("written_by_stream_before", flags, 9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--diagnose", action="store_true", help="small checks of the pieces")
    parser.add_argument("--read", choices=READS, default="add", help="how programs read a flag")
    args = parser.parse_args()
    if args.cpu_check:
        result = cpu_check(args.read)
    else:
        result = diagnose() if args.diagnose else gpu_probe(args.read)
    print(json.dumps(result, indent=1))
    save_json(result, args.out)


if __name__ == "__main__":
    main()
