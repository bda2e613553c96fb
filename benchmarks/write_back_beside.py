"""How much a write-back slows a device hit that runs beside it, against an XLA copy of the
same bytes to pinned host.

    PYTHONPATH=. python3 benchmarks/write_back_beside.py [--preset qwen2-7b]
        [--prefix 32768] [--trials 3] [--piece-mb 64] [--out result.json]

Per trial, after the `host-hit` bench's setup: a device hit on a cached prefix alone; then the
same prefix's device hit right after another prefix of the same length was evicted (its
write-back queued: gather, then copies on the host tier's low-priority stream); then a device
hit right after a `jax.device_put` of as many bytes to `pinned_host` was dispatched (XLA's own
device->host stream, where the forward's sampled token is copied too). Each TTFT is the
engine's, end to end; the copy's span is host clock from its dispatch to its readiness.

`--piece-mb` sets how many bytes of a write-back's copies each poll of the transfer controller
queues (`TransferTuning.write_piece_bytes`; the engine's value by default): with a piece as
large as the write-back, all its copies are queued while the forward runs, and the case shows
whether the forward's own device->host copy of its token waits behind them on the copy engine.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.bench import host_hit, workload
from jhicache.bench.cli import parse_args
from jhicache.bench.command import save_json
from jhicache.cache import TransferTuning


def trial(engine, rng: np.random.Generator, prefix_len: int, turn_len: int,
          big: jax.Array, host: jax.sharding.Sharding) -> dict:
    vocab = engine.model_config.vocab_size
    prefix, other = workload.random_prompts(rng, vocab, 2, prefix_len)
    turns = workload.random_prompts(rng, vocab, 6, turn_len)
    host_hit.ttft_of(engine, prefix + turns[0])
    alone_s, _ = host_hit.ttft_of(engine, prefix + turns[1])
    beside_s = host_hit.device_hit_beside_write_back(engine, prefix, other, turns[2:5])
    start = time.perf_counter()
    copied = jax.device_put(big, host)
    xla_s, _ = host_hit.ttft_of(engine, prefix + turns[5])
    copied.block_until_ready()
    copy_s = time.perf_counter() - start
    host_hit.push_to_host(engine)
    return {"device_hit_alone_ttft_s": alone_s, "beside_write_back_ttft_s": beside_s,
            "beside_xla_copy_ttft_s": xla_s, "xla_copy_s": copy_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--piece-mb", type=int,
                        default=TransferTuning().write_piece_bytes >> 20)
    parser.add_argument("--out")
    cli = parser.parse_args()
    args = parse_args(["host-hit", "--preset", cli.preset, "--host-hit-prefix",
                       str(cli.prefix)])
    engine = host_hit.host_hit_engine(args, write_piece_bytes=cli.piece_mb << 20)
    nbytes = cli.prefix // args.page_size * engine.device_pool.layout.page_bytes
    device = jax.devices()[0]
    big = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), device)
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    rng = np.random.default_rng(args.seed + 2)
    trial(engine, rng, cli.prefix, args.host_hit_turn, big, host)  # compiles every shape
    trials = []
    for _ in range(cli.trials):
        trials.append(trial(engine, rng, cli.prefix, args.host_hit_turn, big, host))
        print({k: f"{v * 1e3:.1f} ms" for k, v in trials[-1].items()}, flush=True)
    save_json({"preset": cli.preset, "prefix_tokens": cli.prefix, "bytes": nbytes,
               "piece_mb": cli.piece_mb, "trials": trials}, cli.out)


if __name__ == "__main__":
    main()
