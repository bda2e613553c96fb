"""What a decode step's sampling costs on the device, by kind of batch: `sample` with the cuts
its batch asks for (`Filters`: top-k, top-p, both, neither) and greedy, on random float32 logits
of the preset's vocabulary, timed with device completion (median of calls dispatched back to
back, the host's dispatch hidden).

    PYTHONPATH=. python3 benchmarks/sampler_probe.py [--preset qwen2-7b] --out FILE.json

Each batch size times every row sampling at temperature 1.0: with top-p 0.9 (`top_p`), top-k
50 (`top_k`), both (`top_k_top_p`), neither but both cuts taken (`sample_no_filter`: the passes
alone), neither (`unfiltered`); and `greedy`. The difference between `top_p` and `unfiltered` is
what a top-p request adds to a step's sampling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jhicache.models.config import PRESETS

from jhicache.bench.command import save_json
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
    return out


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
