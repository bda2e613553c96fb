"""The forward against its HBM floor: a device-hit forward's GPU time, per kernel, and a fresh
prompt's TTFT.

    PYTHONPATH=. python3 benchmarks/forward_floor.py --preset qwen2-7b [--fresh 8192] --out F.json

- Device hit: a `--new`-token turn over a `--prefix`-token prefix cached on device. Its jitted
  programs are dispatched 10 times back to back (the host hidden behind the GPU) and once at a
  time (blocked on each); the floor is the bytes the forward must read (every weight it uses:
  the layers and the head, not the embedding rows it looks up; plus the K/V of every cached and
  new token) over the HBM read ceiling measured in the same run (`bench.kernels`' hbm_read).
- Per kernel: one more forward traced by `jax.profiler` (CUPTI), its GPU events summed by
  kernel name (the trace's own durations; the profiler adds a little to each).
- Host time of one forward's dispatch (`dispatch_us`: both programs, the device idle at each
  call), and the `XLA_FLAGS` it ran under, for comparing XLA settings.
- `--fresh N`: the engine's TTFT for N-token prompts with nothing cached (chunked as the engine
  chunks them), after one that compiles.
- `--decode-batch B`: instead of the device hit, one decode step of B requests whose
  `--prefix`-token contexts are on device (a multi-turn bench's steady state at B running); its
  floor is every weight plus the K/V of all B contexts.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from benchmarks.kernels.timing import dispatch_us, hbm_read, kernel_times, timeit
from benchmarks.rows import Rule, Target, page_row
from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.batch import model_inputs
from jhicache.bench.command import save_json


def device_hit_forward(engine: Engine, prefix: int, new: int, rng: np.random.Generator):
    """Caches a prefix, then plans a turn on it; returns a function dispatching its forward."""
    vocab = engine.model_config.vocab_size
    tokens = rng.integers(0, vocab, prefix).tolist()
    engine.generate([tokens + rng.integers(0, vocab, new).tolist()],
                    SamplingParams(max_new_tokens=1))
    engine.add_request(tokens + rng.integers(0, vocab, new).tolist(),
                       SamplingParams(max_new_tokens=1))
    batch = engine.scheduler.schedule()
    assert batch is not None
    inputs = model_inputs(batch, engine.grid, engine.load_flags)
    return lambda: engine.runner.run(inputs.tokens, inputs.meta, inputs.last_index)


def decode_forward(engine: Engine, batch_size: int, context: int, rng: np.random.Generator):
    """Prefills `batch_size` requests of `context` tokens, then plans their decode step; returns
    a function dispatching its forward, and the tokens whose K/V the step reads (every
    request's sequence, its new token included)."""
    vocab = engine.model_config.vocab_size
    for _ in range(batch_size):
        engine.add_request(rng.integers(0, vocab, context).tolist(),
                           SamplingParams(max_new_tokens=64))
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_generated < 1 for r in scheduler.running):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.num_tokens == batch_size, "not one decode step of all"
    inputs = model_inputs(batch, engine.grid, engine.load_flags)
    read = sum(chunk.request.num_tokens for chunk in batch.chunks)
    return lambda: engine.runner.run(inputs.tokens, inputs.meta, inputs.last_index), read


def forward_times_ms(run, n: int = 10) -> dict[str, float]:
    each = timeit(run, reps=n, warm=3)  # the first call compiles
    start = time.perf_counter()
    jax.block_until_ready([run() for _ in range(n)])
    return {"back_to_back_ms": (time.perf_counter() - start) / n * 1e3,
            "one_at_a_time_median_ms": each * 1e3, "dispatch_us": dispatch_us(run, reps=n)}


def forward_bytes(engine: Engine, prefix: int, new: int) -> dict[str, int]:
    programs, cfg = engine.runner.programs, engine.model_config
    weights = sum(x.nbytes for leaves in programs.layer_leaves for x in leaves)
    weights += sum(x.nbytes for x in programs.head_leaves)  # a tied head holds the embedding
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    itemsize = engine.device_pool.k[0].dtype.itemsize
    return {"weights": weights, "kv": (prefix + new) * kv_token * itemsize}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--fresh", type=int, default=0, metavar="N")
    parser.add_argument("--decode-batch", type=int, default=0, metavar="B")
    parser.add_argument("--out")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    res: dict = {"preset": args.preset, "prefix": args.prefix, "new": args.new,
                 "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "xla_flags": os.environ.get("XLA_FLAGS", "")}
    hbm_read(res)
    hbm_read(res)  # a second pass keeps each variant's best
    tokens = (args.decode_batch or 1) * (args.prefix + 64 + 64) + args.prefix + args.fresh
    engine = Engine.from_preset(args.preset, EngineConfig(
        cache_mode="device", device_kv_tokens=max(65536, 2 * tokens), page_size=64,
        dtype="bfloat16", max_running_requests=max(args.decode_batch, 64)))
    if args.decode_batch:
        run, kv_tokens = decode_forward(engine, args.decode_batch, args.prefix, rng)
        res["decode_batch"] = args.decode_batch
        res["bytes"] = forward_bytes(engine, kv_tokens, 0)
        what = f"decode step of {args.decode_batch} x {args.prefix}"
    else:
        run = device_hit_forward(engine, args.prefix, args.new, rng)
        res["bytes"] = forward_bytes(engine, args.prefix, args.new)
        what = f"device hit {args.prefix}+{args.new}"
    res["forward"] = forward_times_ms(run)
    floor_ms = sum(res["bytes"].values()) / (res["hbm_read_gbps"] * 1e9) * 1e3
    res["floor_ms"] = floor_ms
    res["forward_over_floor"] = res["forward"]["back_to_back_ms"] / floor_ms
    res["trace"] = kernel_times(run)
    print(f"{args.preset} {what}: forward "
          f"{res['forward']['back_to_back_ms']:.2f} ms back to back "
          f"({res['forward']['one_at_a_time_median_ms']:.2f} one at a time, dispatch "
          f"{res['forward']['dispatch_us']:.0f} us), floor "
          f"{floor_ms:.2f} ms at {res['hbm_read_gbps']:.0f} GB/s: "
          f"{res['forward_over_floor']:.2f}x", flush=True)
    for row in res["trace"]["by_name"][:12]:
        print(f"  {row['calls']:4d} x {row['name']}: {row['us']:.0f} us", flush=True)
    if args.fresh:
        vocab = engine.model_config.vocab_size
        res["fresh_ttft_ms"] = [engine.generate(
            [rng.integers(0, vocab, args.fresh).tolist()],
            SamplingParams(max_new_tokens=1))[0].ttft_s * 1e3 for _ in range(4)][1:]
        print(f"fresh {args.fresh}-token prompt TTFT: {res['fresh_ttft_ms']} ms (after a first "
              "that compiled)", flush=True)
    # 0.5B, and any decode step: its dispatch rivals its reads
    bound = 2 if "0.5b" in args.preset.lower() or args.decode_batch else 1.3
    name = "decode_floor" if args.decode_batch else "forward_floor"
    res["page_rows"] = {name: page_row(
        "forward_floor", [res], {}, Target(f"<= {bound}", (Rule("ratio", "ratio", at_most=bound),),
                                           samples="runs"))}
    save_json(res, args.out)


if __name__ == "__main__":
    main()
