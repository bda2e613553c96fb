"""Split-K extend attention vs the un-split kernel: one request, a long cached prefix and a short
new turn.

    PYTHONPATH=. python3 benchmarks/extend_split.py [--prefix 8192] [--new 64] [--sweep 8,16,32,64]

Per model shape (Qwen2-0.5B, Qwen2-7B; page 64, bf16): per-call microseconds (median after warm-up,
each call blocked on) for splits=1, the automatic choice and each --sweep value, and the max abs
error vs the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jhicache.pallas_kernels import extend_attention as ea

SHAPES = {"qwen2-0.5b": dict(heads=14, kv_heads=2, dim=64),
          "qwen2-7b": dict(heads=28, kv_heads=4, dim=128)}
PAGE = 64


def median_us(fn, *args, reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def bench(name: str, heads: int, kv_heads: int, dim: int, *, prefix: int, new: int,
          sweep: list[int], reps: int) -> None:
    seq = prefix + new
    pages = -(-seq // PAGE)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(pages + 4)[None, :pages].astype(np.int32))  # [1, pages]
    keys = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(kk, (pages + 4, PAGE, kv_heads, dim), jnp.float32)
            .astype(jnp.bfloat16) for kk in keys[:2])
    q = jax.random.normal(keys[2], (new, heads, dim), jnp.float32).astype(jnp.bfloat16)
    meta = [jnp.array([x], jnp.int32) for x in (seq, 0, new)]  # seq_lens, query_start, query_lens
    scale = dim**-0.5
    ref = jax.jit(lambda q, k, v: ea.paged_attention_reference(q, k, v, table, meta[0], meta[1],
                                                               meta[2], sm_scale=scale))(q, k, v)
    auto = ea.choose_extend_splits(new, 1, pages * PAGE, heads, kv_heads, dim, block_q=128,
                                   block_k=64)
    print(f"{name}: prefix {prefix} + {new} new tokens, {heads}/{kv_heads} heads, dim {dim}, "
          f"auto splits {auto}")
    base = None
    for splits in dict.fromkeys([1, auto, *sweep]):  # ordered, no repeats
        f = jax.jit(lambda q, k, v, s=splits: ea.paged_attention(q, k, v, table, *meta,
                                                                 sm_scale=scale, splits=s))
        err = float(jnp.abs(f(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32)).max())
        us = median_us(f, q, k, v, reps=reps)
        base = base or us
        tag = " (auto)" if splits == auto else ""
        print(f"  splits {splits:3d}{tag:7s} {us:9.1f} us  x{base / us:5.2f} vs splits 1  "
              f"max abs err {err:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--sweep", default="4,8,16,32,64",
                        help="comma-separated extra split counts")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--models", default=",".join(SHAPES))
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    sweep = [int(s) for s in args.sweep.split(",") if s]
    for name in args.models.split(","):
        bench(name, **SHAPES[name], prefix=args.prefix, new=args.new, sweep=sweep, reps=args.reps)


if __name__ == "__main__":
    main()
