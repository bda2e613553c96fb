"""What a decode step's sampling costs on the device, by kind of batch: `sample` with the cuts
its batch asks for (`Filters`: top-k, top-p, both, neither) and greedy, on random float32 logits
of the preset's vocabulary, timed with device completion (median of calls dispatched back to
back, the host's dispatch hidden).

    PYTHONPATH=. python3 benchmarks/sampler_probe.py [--preset qwen2-7b] --out FILE.json

Each batch size times every row sampling at temperature 1.0: with top-p 0.9 (`top_p`), top-k
50 (`top_k`), both (`top_k_top_p`), neither but both cuts taken (`sample_no_filter`: the passes
alone), neither (`unfiltered`); and `greedy`. The difference between `top_p` and `unfiltered` is
what a top-p request adds to a step's sampling. `penalties` times the program a step whose
requests set a penalty or min_tokens runs before its sampler (`jhicache.penalties.penalize`,
every row penalised, over a table of 64 rows), and `count` the scatter after it: what such a
step adds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jhicache.models.presets import PRESETS

from jhicache.bench.command import save_json
from jhicache.penalties import PenaltyRows, count_sampled, penalize
from jhicache.sampling import Filters, SamplingParams, greedy, sample, sampling_arrays

BATCHES = (1, 8, 32, 64)
CALLS = 20  # dispatched back to back per timing


def back_to_back_ms(step: Callable[[], jax.Array], reps: int = 5) -> float:
    """Median over `reps` of the device time of one call: `CALLS` calls dispatched back to back,
    waited for at the end, over `CALLS`."""
    jax.block_until_ready(step())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = [step() for _ in range(CALLS)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / CALLS)
    return statistics.median(times) * 1e3


def timings(batch: int, vocab: int, seed: int) -> dict[str, float]:
    logits = jax.random.normal(jax.random.key(seed), (batch, vocab), jnp.float32) * 4
    steps = [0] * batch

    def arrays(**params: float | int) -> list[jax.Array]:
        rows = [SamplingParams(temperature=1.0, seed=i, **params)  # type: ignore[arg-type]
                for i in range(batch)]
        return [jnp.asarray(a) for a in sampling_arrays(rows, steps, batch)]

    out: dict[str, float] = {}
    variants: tuple[tuple[str, dict[str, float | int], Filters], ...] = (
        ("top_p", {"top_p": 0.9}, Filters.TOP_P), ("top_k", {"top_k": 50}, Filters.TOP_K),
        ("top_k_top_p", {"top_k": 50, "top_p": 0.9}, Filters.BOTH),
        ("sample_no_filter", {}, Filters.BOTH), ("unfiltered", {}, Filters.NONE))
    for name, params, filters in variants:
        cuts = arrays(**params)
        out[name] = back_to_back_ms(lambda: sample(logits, *cuts, rows=batch, filters=filters))
    out["greedy"] = back_to_back_ms(lambda: greedy(logits, rows=batch))
    table = jax.random.randint(jax.random.key(seed), (64, vocab), 0, 16, jnp.int32)
    rows = PenaltyRows((), np.arange(batch, dtype=np.int32), np.full(batch, 1.1, np.float32),
                       np.full(batch, 0.5, np.float32), np.full(batch, 0.5, np.float32),
                       np.ones(batch, np.bool_))
    packed = jnp.asarray(rows.packed())
    out["penalties"] = back_to_back_ms(lambda: penalize(logits, table, packed))
    sampled = jnp.zeros(batch, jnp.int32)
    out["count"] = chained_ms(lambda t: count_sampled(t, packed, sampled), table)
    return out


def chained_ms(step: Callable[[jax.Array], jax.Array], first: jax.Array, reps: int = 5) -> float:
    """`back_to_back_ms` of a program that takes its argument donated: each call is given the
    one before's output, and the last is waited for (the calls form one chain)."""
    current = jax.block_until_ready(step(first))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(CALLS):
            current = step(current)
        jax.block_until_ready(current)
        times.append((time.perf_counter() - start) / CALLS)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-7b", choices=tuple(PRESETS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    vocab = PRESETS[args.preset].vocab_size
    res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "preset": args.preset, "vocab": vocab, "ms": {}}
    for batch in BATCHES:
        res["ms"][str(batch)] = row = timings(batch, vocab, seed=batch)
        print(f"batch {batch:3d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()),
              flush=True)
    save_json(res, args.out)


if __name__ == "__main__":
    main()
