"""What a scored prompt's head costs on the device: the vocabulary projection of every prompt row
and its reduction to each row's logsumexp, top entry and target logit, against the projection
alone (the ceiling: the matmul's FLOPs cannot be avoided), timed with device completion.

    PYTHONPATH=. python3 benchmarks/head_rows_probe.py [--preset qwen2-7b] [--rows 4096]
        --out FILE.json

Variants, each over `--rows` rows of random bf16 hidden states and the preset's head weight:
- `matmul_f32`: the product alone, [rows, vocab] float32 written out whole;
- `blocks_<b>_<reduction>`: as the engine's `head_rows` does it, `b` rows at a time (lax.map),
  each block's float32 logits reduced by `one_pass` (`row_logprobs_top1`: one variadic reduce),
  `three_pass` (logsumexp, max, argmax) or `lse` (logsumexp alone, a lower bound on a reduce);
- `fused_<bm>x<bn>`: a Pallas kernel that keeps each logits tile in registers and folds it
  into a running logsumexp, max and target logit, so that no logits reach memory.
Each fused variant's results are checked against `one_pass`'s (largest differences recorded).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.models.presets import PRESETS
from jhicache.pallas_kernels.backend import use_interpreter

from benchmarks.kernels.timing import timeit
from jhicache.bench.command import save_json
from jhicache.logprobs import row_logprobs_top1

Reduce = Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]]


def one_pass(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    """The engine's reduction (`row_logprobs_top1`) of rows whose targets are their tokens
    alone (no asked ids): the token's log probability, the top one and its id."""
    return row_logprobs_top1(logits, targets[:, None])[:3]


def three_pass(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    return chosen, jnp.max(logits, axis=-1) - lse, jnp.argmax(logits, axis=-1)


def lse_only(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    return (jax.nn.logsumexp(logits, axis=-1),)


REDUCTIONS: dict[str, Reduce] = {"one_pass": one_pass, "three_pass": three_pass,
                                 "lse": lse_only}


def blocks(x: jax.Array, w: jax.Array, targets: jax.Array, block: int,
           reduce: Reduce) -> tuple[jax.Array, ...]:
    """The engine's head_rows without the final norm: `block` rows at a time through lax.map."""
    rows = x.shape[0]
    parts = (x.reshape(rows // block, block, -1), targets.reshape(-1, block))

    def one(b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        return reduce(jnp.dot(b[0], w, preferred_element_type=jnp.float32), b[1])

    out = jax.lax.map(one, parts)
    return jax.tree.map(lambda a: a.reshape(rows, *a.shape[2:]), out)


def _fused_kernel(x_ref, w_ref, t_ref, max_ref, sum_ref, arg_ref, tgt_ref, *, bm: int,
                  bn: int, bk: int, span: int):
    """Program (row block i, vocab split s): over s's `span` columns, `bn` at a time, the
    running max, sum of exp(logit - max), first argmax and target logit of each of i's rows."""
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * bm, bm), bm)
    first_col = pl.program_id(1) * span
    target = t_ref[rows]
    hidden = x_ref.shape[1]

    def tile(j, carry):
        high, total, arg, tgt = carry
        c0 = pl.multiple_of(first_col + j * bn, bn)
        cols = pl.ds(c0, bn)

        def k_step(k, acc):
            ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
            return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols],
                                 preferred_element_type=jnp.float32)

        logits = jax.lax.fori_loop(0, hidden // bk, k_step, jnp.zeros((bm, bn), jnp.float32))
        ids = c0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
        tile_max = jnp.max(logits, axis=1)
        tile_arg = jnp.min(jnp.where(logits == tile_max[:, None], ids, 2**30), axis=1)
        new_high = jnp.maximum(high, tile_max)
        total = (total * jnp.exp(high - new_high)
                 + jnp.sum(jnp.exp(logits - new_high[:, None]), axis=1))
        arg = jnp.where(tile_max > high, tile_arg, arg)
        tgt = tgt + jnp.sum(jnp.where(ids == target[:, None], logits, 0.0), axis=1)
        return new_high, total, arg, tgt

    init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
            jnp.zeros((bm,), jnp.int32), jnp.zeros((bm,), jnp.float32))
    high, total, arg, tgt = jax.lax.fori_loop(0, span // bn, tile, init)
    max_ref[rows] = high
    sum_ref[rows] = total
    arg_ref[rows] = arg
    tgt_ref[rows] = tgt


@functools.partial(jax.jit, static_argnames=("bm", "bn", "bk", "splits", "warps", "stages"))
def fused(x: jax.Array, w: jax.Array, targets: jax.Array, *, bm: int, bn: int, bk: int,
          splits: int, warps: int, stages: int) -> tuple[jax.Array, ...]:
    rows, vocab = x.shape[0], w.shape[1]
    span = vocab // splits
    part = jax.ShapeDtypeStruct((splits, rows), jnp.float32)
    spec = pl.BlockSpec((None, rows), lambda i, s: (s, 0))
    high, total, arg, tgt = pl.pallas_call(
        functools.partial(_fused_kernel, bm=bm, bn=bn, bk=bk, span=span),
        out_shape=(part, part, jax.ShapeDtypeStruct((splits, rows), jnp.int32), part),
        grid=(rows // bm, splits),
        out_specs=(spec, spec, spec, spec),
        interpret=use_interpreter(),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, w, targets)
    top = jnp.max(high, axis=0)
    lse = top + jnp.log(jnp.sum(total * jnp.exp(high - top), axis=0))
    best = jnp.argmax(high, axis=0)  # the first split holding the max: its first argmax
    ids = jnp.take_along_axis(arg, best[None], axis=0)[0]
    return jnp.sum(tgt, axis=0) - lse, (top - lse)[:, None], ids[:, None]


FUSED = {"fused_64x128": dict(bm=64, bn=128, bk=64, warps=4, stages=3),
         "fused_128x128": dict(bm=128, bn=128, bk=64, warps=8, stages=3),
         "fused_128x256": dict(bm=128, bn=256, bk=64, warps=8, stages=3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-7b", choices=tuple(PRESETS))
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--splits", type=int, default=4, help="fused: vocabulary splits")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = PRESETS[args.preset]
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (args.rows, config.hidden_size), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (config.hidden_size, config.vocab_size), jnp.bfloat16)
         * 0.05).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (args.rows,), 0, config.vocab_size, jnp.int32)
    flops = 2 * args.rows * config.hidden_size * config.vocab_size
    res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "preset": args.preset, "rows": args.rows, "tflop": flops / 1e12, "ms": {}}

    def record(name: str, fn: Callable[[], object]) -> None:
        try:
            seconds = timeit(fn, reps=10)
        except Exception as e:  # noqa: BLE001  a variant that fails is a result to record
            res["ms"][name] = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        else:
            res["ms"][name] = seconds * 1e3
            print(f"{name:>28}: {seconds * 1e3:8.2f} ms  {flops / seconds / 1e12:6.0f} TFLOP/s",
                  flush=True)

    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    record("matmul_f32", lambda: matmul(x, w))
    ref = None
    for block in (256, 512, 1024, 2048):
        for name, reduce in REDUCTIONS.items():
            if block != 256 and name != "one_pass":
                continue
            fn = jax.jit(functools.partial(blocks, block=block, reduce=reduce))
            record(f"blocks_{block}_{name}", lambda fn=fn: fn(x, w, targets))
            if ref is None and name == "one_pass":
                ref = fn(x, w, targets)
    res["fused_diff"] = {}
    for name, cfg in FUSED.items():
        # the most splits up to --splits that divide the vocabulary into whole tiles
        splits = max(s for s in range(1, args.splits + 1)
                     if config.vocab_size % (s * cfg["bn"]) == 0)
        fn = functools.partial(fused, bm=cfg["bm"], bn=cfg["bn"], bk=cfg["bk"], splits=splits,
                               warps=cfg["warps"], stages=cfg["stages"])
        record(name, lambda fn=fn: fn(x, w, targets))
        if isinstance(res["ms"][name], float) and ref is not None:
            got = fn(x, w, targets)
            res["fused_diff"][name] = {
                "chosen": float(jnp.max(jnp.abs(got[0] - ref[0]))),
                "top": float(jnp.max(jnp.abs(got[1] - ref[1]))),
                "ids_differ": int(jnp.sum(got[2] != ref[2]))}
            print(f"{name:>28}: differs from one_pass by {res['fused_diff'][name]}", flush=True)
    save_json(res, args.out)


if __name__ == "__main__":
    main()
