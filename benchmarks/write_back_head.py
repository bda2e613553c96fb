"""A write-back's end to end against the same run's PCIe copy to host, by how many bytes its
gather stages first (`TransferTuning.gather_head_bytes`).

    PYTHONPATH=. python3 benchmarks/write_back_head.py [--preset qwen2-7b] [--prefix 32768]
        [--head-mb 100000,256,128] [--trials 2] [--out result.json]

The head sizes in turn, twice round (order effects show), each on a fresh engine whose
`EngineConfig.transfer_tuning` sets it, after a warm-up trial that compiles its gathers. Per
trial: a prefix computed, then pushed to host (`host_hit.push_to_host`: eviction, gathers,
copies, the wait), timed end to end on the host clock, its copies' span by their device-side
marks, and the PCIe ceiling (one contiguous XLA copy of as many bytes to pinned host,
`host_hit.pcie_copy_seconds`); then a device hit on the prefix beside a write-back of another
prefix as long (`host_hit.device_hit_beside_write_back`) and alone. A head above the
write-back's size gathers it whole, as before pieces.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np

from benchmarks import cli as bench_cli
from benchmarks import host_hit
from benchmarks.rows import Rule, Target, page_row
from jhicache.bench import workload
from jhicache.bench.command import save_json
from jhicache.config import TransferTuning


def trial(engine, rng: np.random.Generator, prefix_len: int, turn_len: int) -> dict:
    vocab = engine.model_config.vocab_size
    prefix, other = workload.random_prompts(rng, vocab, 2, prefix_len)
    turns = workload.random_prompts(rng, vocab, 5, turn_len)
    host_hit.ttft_of(engine, prefix + turns[0])
    before = engine.stats()
    seconds = host_hit.push_to_host(engine)
    after = engine.stats()
    nbytes = after.write_back_bytes - before.write_back_bytes
    beside_s = host_hit.device_hit_beside_write_back(engine, prefix, other, turns[1:4])
    alone_s, _ = host_hit.ttft_of(engine, prefix + turns[4])
    host_hit.push_to_host(engine)
    pcie_s = host_hit.pcie_copy_seconds(nbytes, to_host=True)
    return {"write_back_s": seconds, "copies_s": after.write_back_s - before.write_back_s,
            "bytes": nbytes, "pcie_to_host_s": pcie_s,
            "end_to_end_over_pcie": pcie_s / seconds, "device_hit_beside_ttft_s": beside_s,
            "device_hit_alone_ttft_s": alone_s}


def summary(rows: list[dict]) -> str:
    """One line of a head size's trials: the ratio, then each time in ms."""
    each = lambda key, scale: " ".join(f"{r[key] * scale:.2f}" for r in rows)  # noqa: E731
    times = [("end to end", "write_back_s"), ("copies", "copies_s"),
             ("device hit beside", "device_hit_beside_ttft_s"),
             ("alone", "device_hit_alone_ttft_s")]
    return (f"end to end / PCIe {each('end_to_end_over_pcie', 1)} | ms: "
            + ", ".join(f"{label} {each(key, 1e3)}" for label, key in times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2-7b")
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--head-mb", default=f"100000,{TransferTuning().gather_head_bytes >> 20}")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out")
    cli = parser.parse_args()
    args = bench_cli.parse("host-hit", "", ["--preset", cli.preset, "--host-hit-prefix",
                                            str(cli.prefix)], host_hit.add_options)
    rng = np.random.default_rng(args.seed + 3)
    heads = [int(mb) for mb in cli.head_mb.split(",")]
    out: dict[str, list[dict]] = {str(mb): [] for mb in heads}
    for mb in heads * 2:
        engine = host_hit.host_hit_engine(args, gather_head_bytes=mb << 20)
        trial(engine, rng, cli.prefix, args.host_hit_turn)  # compiles its gathers
        rows = [trial(engine, rng, cli.prefix, args.host_hit_turn)
                for _ in range(cli.trials)]
        out[str(mb)] += rows
        print(f"head {mb} MB: {summary(rows)}", flush=True)
        engine.close()
        del engine
        gc.collect()  # its device pool goes before the next engine's is made
    result = {"preset": cli.preset, "prefix": cli.prefix, "trials": out}
    target = Target("0.95", (Rule("end_to_end", "end to end", at_least=0.95),
                             Rule("copies", "copies", at_least=0.95)))
    result["page_rows"] = {f"write_back_head_{mb}": page_row("write_back_head", [result],
                                                             {"head_mb": mb}, target)
                           for mb in heads}
    save_json(result, cli.out)


if __name__ == "__main__":
    main()
