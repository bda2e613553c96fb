"""Does the forward's host dispatch cost depend on whether its inputs are new buffers each step?

    PYTHONPATH=. python3 benchmarks/dispatch_inputs_probe.py --preset qwen2-7b [--out FILE]

XLA runs a program's kernels from recorded command buffers (CUDA graphs) where it can, and must
update a recorded buffer whose arguments moved. Every engine step passes freshly transferred
metadata, so a program's dispatch may pay for those updates. This times the host side of
`ModelRunner.run` (both programs' dispatches, nothing waited for) for one device-hit batch (a
64-token turn over a cached `--prefix`), `--reps` times each way, alternating:
- `same`: the same input arrays every call (their buffers never move);
- `fresh`: the step's inputs built again before each call, as every engine step does (the build
  is not timed).
It prints the median host milliseconds of each and writes them with every sample to `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.batch import model_inputs
from jhicache.bench.command import save_json


def dispatch_ms(engine: Engine, inputs) -> float:
    start = time.perf_counter()
    logits = engine.runner.run(inputs.tokens, inputs.meta, inputs.last_index)
    spent = (time.perf_counter() - start) * 1e3
    jax.block_until_ready(logits)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    cli = parser.parse_args()
    engine = Engine.from_preset(cli.preset, EngineConfig(
        cache_mode="device", device_kv_tokens=4 * (cli.prefix + 128), page_size=64))
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prefix = rng.integers(0, vocab, cli.prefix).tolist()
    engine.generate([prefix + rng.integers(0, vocab, 64).tolist()],
                    SamplingParams(max_new_tokens=1))
    engine.add_request(prefix + rng.integers(0, vocab, 64).tolist(),
                       SamplingParams(max_new_tokens=1))
    batch = engine.scheduler.schedule()
    assert batch is not None
    build = lambda: model_inputs(batch, engine.grid, engine.load_flags)  # noqa: E731
    same = build()
    dispatch_ms(engine, same)  # compiles
    samples: dict[str, list[float]] = {"same": [], "fresh": []}
    for _ in range(cli.reps):
        samples["same"].append(dispatch_ms(engine, same))
        samples["fresh"].append(dispatch_ms(engine, build()))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{cli.preset}, {cli.prefix} + 64: host dispatch of both programs, median of "
          f"{cli.reps}: same inputs {medians['same']:.3f} ms, fresh inputs "
          f"{medians['fresh']:.3f} ms")
    save_json({"preset": cli.preset, "prefix": cli.prefix, "device": jax.devices()[0].device_kind,
               "median_ms": medians, "samples_ms": samples}, cli.out)


if __name__ == "__main__":
    main()
