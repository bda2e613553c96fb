"""A bench's page row: its figures (result, ceiling) read from its results by the row's kind,
its target, and whether it is met, as BENCHMARKS.md shows them. A bench writes its rows into its
result file under "page_rows" (`add_row`); scripts/benchmarks_page.py only renders them. A row
that compares runs (a baseline, a variant) is written by the command line:

    PYTHONPATH=. python -m benchmarks.rows FILE ROW KIND [--with OTHER.json ...]
        [--args JSON] [--target TEXT] [--rule METRIC:at_most|at_least:BOUND[:NAME] ...]
        [--met TEXT] [--samples WORD]

reads FILE (the row's run) and the --with files (in benchmarks/results/ unless a path), and
writes the row into FILE under "page_rows"[ROW], naming the other files it read."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Figures:
    """What an extractor reads from a row's result files."""

    result: str
    ceiling: str = "-"
    checks: dict[str, list[float]] = field(default_factory=dict)  # metric -> one value per trial
    fields: dict[str, str] = field(default_factory=dict)  # placeholders for the target and met


@dataclass(frozen=True)
class Rule:
    """A numeric target on one metric: every value must be at most / at least the bound."""

    metric: str
    name: str
    at_most: float | None = None
    at_least: float | None = None

    def passes(self, value: float) -> bool:
        if self.at_most is not None and value > self.at_most:
            return False
        return self.at_least is None or value >= self.at_least


# -- formatting ---------------------------------------------------------------------------------


def num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def span(values: Sequence[float], digits: int) -> str:
    """ "lo-hi" of the values, or one figure where both round alike."""
    lo, hi = num(min(values), digits), num(max(values), digits)
    return lo if lo == hi else f"{lo}-{hi}"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def ktok(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k"


def ms(seconds: float, digits: int = 1) -> str:
    return num(seconds * 1e3, digits)


# -- extractors: (the row's result files, parsed; the row's args) -> Figures --------------------


def server_start(files: list[Json], args: Json) -> Figures:
    start = files[0]
    info = start["server_info"]["startup"]
    warm = info["warmup"]
    hits = warm["cache_hits"]
    programs = f"{warm['compiles']} programs"
    if hits:
        programs += f", {hits} read back from the cache"
    text = (f"{start['health_200_s']:.1f} s (weights {info['weights_s']:.1f} s, pools "
            f"{info['pools_s']:.1f} s, warm-up {warm['seconds']:.1f} s; {programs}; "
            f"{plural(warm['alone_tasks'], 'shape')} one at a time)")
    return Figures(text, checks={"health_s": [start["health_200_s"]]})


def serving_compiles(files: list[Json], args: Json) -> Figures:
    """Compiles while serving, summed over the server's counter and the bench's count."""
    total = 0.0
    for data in files:
        if "compiles" in data:
            total += data["compiles"]["serving"]
        bench = data.get("bench", data)
        for mode in bench.get("modes", {}).values():
            total += mode["compiles_during_run"]["count"]
    text = (f"{total:.0f} (server's `jhicache:compiles_total{{phase=\"serving\"}}`, bench's count;"
            f" {len(files)} result files)")
    return Figures(text, checks={"compiles": [total]})


def _bench(data: Json) -> Json:
    return data.get("bench", data)


def multiturn_http(files: list[Json], args: Json) -> Figures:
    mode = _bench(files[0])["modes"]["server"]
    ttft = mode["ttft"]
    text = (f"{ms(ttft['p50_s'], 0)} / {ms(ttft['p99_s'], 0)} ms, "
            f"{ms(mode['max_token_gap_s'], 0)} ms")
    return Figures(text, checks={"ttft_p99_s": [ttft["p99_s"]],
                                 "max_gap_s": [mode["max_token_gap_s"]]})


def _tok_itl(mode: Json) -> str:
    itl = ms(mode["itl"]["p50_s"], 2)
    return f"{ktok(mode['throughput_tokens_per_s'])} tok/s, ITL p50 {itl} ms"


def multiturn(files: list[Json], args: Json) -> Figures:
    """One mode's throughput and ITL; with a second file, that file's run as the baseline."""
    name = args.get("mode", "hierarchical")
    mode = files[0]["modes"][name]
    text = f"{_tok_itl(mode)}, {plural(mode['compiles_during_run']['count'], 'compile')}"
    if "warmup" in mode:
        warm = mode["warmup"]
        text += f" (after a {warm['ahead_s'] + warm['steps_s']:.1f} s warm-up)"
    fig_fields: dict[str, str] = {}
    checks: dict[str, list[float]] = {}
    if len(files) > 1:
        base = files[1]["modes"][name]
        fig_fields["baseline_tok_s"] = ktok(base["throughput_tokens_per_s"])
        fig_fields["baseline_itl_ms"] = ms(base["itl"]["p50_s"], 2)
        ratio = mode["throughput_tokens_per_s"] / base["throughput_tokens_per_s"]
        fig_fields["change"] = f"{(ratio - 1) * 100:+.1f}%"
        checks["over_baseline"] = [ratio]
        if args.get("show_baseline"):
            text += (f"; {args['show_baseline']}: {fig_fields['baseline_tok_s']} tok/s, "
                     f"{fig_fields['baseline_itl_ms']} ms ({fig_fields['change']})")
    return Figures(text, checks=checks, fields=fig_fields)


def multiturn_cost(files: list[Json], args: Json) -> Figures:
    """A variant's multi-turn runs (the first `args["variants"]` files) against runs without it
    in the same call (the rest): each run's throughput and ITL p50, and the throughput ratio of
    every variant run to every run without (checked)."""
    name, count = args.get("mode", "hierarchical"), args["variants"]
    runs = [f["modes"][name] for f in files]
    variant, base = runs[:count], runs[count:]
    ratios = [v["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
              for v in variant for b in base]

    def listed(group: list[Json]) -> str:
        return "; ".join(_tok_itl(m) for m in group)

    compiles = sum(m["compiles_during_run"]["count"] for m in runs)
    text = (f"{args['label']}: {listed(variant)}. Without: {listed(base)}. Throughput ratio "
            f"{span(ratios, 3)} ({plural(len(ratios), 'pair')}); "
            f"{plural(compiles, 'compile')} in the runs")
    return Figures(text, checks={"ratio": ratios})


def store_cost(files: list[Json], args: Json) -> Figures:
    """The store-cost bench's runs: those with the store against those without a storage
    tier, as `multiturn_cost` reads a variant's (its runs are those files' modes)."""
    result = files[0]["store_cost"]
    runs = result["runs"]
    as_files = [{"modes": {"hierarchical": run}} for run in runs["store"] + runs["no_storage"]]
    return multiturn_cost(as_files, {"variants": len(runs["store"]),
                                     "label": f"the store {result['store']}"})


def fleet(files: list[Json], args: Json) -> Figures:
    """The fleet bench's legs: each leg's hit rate (by tier), TTFT p50 / p99 and compiles; the
    moved conversations' hit rate over one server's; the store's own put/get as the ceiling."""
    result = files[0]["fleet"]
    parts = []
    for name, leg in result["legs"].items():
        tiers = ", ".join(f"{t} {leg[t + '_hit_rate']:.2f}" for t in ("device", "host", "storage"))
        parts.append(f"{name}: hit rate {leg['hit_rate']:.2f} ({tiers}), TTFT p50 / p99 "
                     f"{ms(leg['ttft_p50_s'])} / {ms(leg['ttft_p99_s'])} ms, "
                     f"{plural(int(leg['serving_compiles']), 'compile')}")
    ratio = result["moved_hit_rate_ratio"]
    text = "; ".join(parts)
    checks: dict[str, list[float]] = {}
    if ratio is not None:
        text += f". Moved over one server's: {ratio:.2f}"
        checks["moved_ratio"] = [ratio]
    text += f"; the same answers in every leg: {'yes' if result['same_answers'] else 'no'}"
    ceiling = result.get("ceiling")
    limit = "-" if ceiling is None else (
        f"the store's put {ceiling['put_gb_per_s']:.2f} GB/s, get {ceiling['get_gb_per_s']:.2f} "
        f"GB/s ({ceiling['pages']} objects of {ceiling['page_bytes'] / 1e6:.2f} MB)")
    return Figures(text, limit, checks=checks)


def multiturn_modes(files: list[Json], args: Json) -> Figures:
    """Cache off against hierarchical in one run; a second file: the same from an earlier one."""
    modes = files[0]["modes"]
    off, hier = (modes[m]["throughput_tokens_per_s"] for m in ("off", "hierarchical"))
    text = f"off {ktok(off)} tok/s, hierarchical {ktok(hier)} tok/s, {hier / off:.2f}x"
    if len(files) == 1:
        return Figures(text)
    base = files[1]["modes"]
    b_off, b_hier = (base[m]["throughput_tokens_per_s"] for m in ("off", "hierarchical"))
    fig_fields = {"before": f"{ktok(b_off)} / {ktok(b_hier)}, {b_hier / b_off:.2f}x"}
    return Figures(text, checks={"off": [off / b_off], "hierarchical": [hier / b_hier]},
                   fields=fig_fields)


def multiturn_stream(files: list[Json], args: Json) -> Figures:
    """Each [file index, mode] of args["modes"]: TTFT p50 / p99, throughput, compiles if counted."""
    parts = []
    for index, name in args["modes"]:
        mode = files[index]["modes"][name]
        ttft = mode["ttft"]
        part = (f"{name} {ms(ttft['p50_s'])} / {ms(ttft['p99_s'])} ms, "
                f"{ktok(mode['throughput_tokens_per_s'])} tok/s")
        compiles = mode.get("compiles_during_run")
        if compiles is not None:
            part += f", {plural(compiles['count'], 'compile')}"
            if compiles["count"]:
                part += f" ({compiles['seconds']:.2f} s)"
        parts.append(part)
    return Figures("; ".join(parts))


def serve_paths(files: list[Json], args: Json) -> Figures:
    """Each HTTP path against in process: the engine in a thread of the server's process, or in
    an engine process; the engine process's throughput ratio, ITL p50 and device-hit TTFT p50
    differences are checked."""
    run = files[0]["serve_overhead"]["modes"]["hierarchical"]
    parts = []
    for name, key in (("engine in a thread", "overhead"), ("engine process", "overhead_process")):
        o = run[key]
        hit = o.get("p50_device_hit_ttft_s")
        parts.append(f"{name}: TTFT p50 {o['p50_ttft_s'] * 1e3:+.1f} ms, ITL p50 "
                     f"{o['p50_itl_s'] * 1e3:+.2f} ms, throughput x {o['throughput_ratio']:.3f}"
                     + ("" if hit is None else f", device-hit TTFT p50 {hit * 1e3:+.1f} ms"))
    compiles = sum(run[p]["compiles_during_run"]["count"]
                   for p in ("in_process", "http", "http_process"))
    tokens = "the same tokens" if run["same_tokens"] else "tokens differ (batching)"
    process = run["overhead_process"]
    checks = {"process_ratio": [process["throughput_ratio"]],
              "process_itl_ms": [process["p50_itl_s"] * 1e3]}
    if process.get("p50_device_hit_ttft_s") is not None:
        checks["process_hit_ttft_ms"] = [process["p50_device_hit_ttft_s"] * 1e3]
    here = run["in_process"]
    ceiling = (f"in process {here['throughput_tokens_per_s']:,.0f} tok/s, ITL p50 "
               f"{here['itl']['p50_s'] * 1e3:.2f} ms"
               + (f", device-hit TTFT p50 {here['device_hit']['ttft']['p50_s'] * 1e3:.1f} ms"
                  if "device_hit" in here else ""))
    return Figures("; ".join(parts) + f"; {compiles} compiles; {tokens}", ceiling, checks=checks)


def _trials(data: Json) -> list[Json]:
    return list(data["host_hit"]["trials"])


def _median_trial(data: Json) -> Json:
    """The trial with the median host-hit ratio (the bench's own pick where it records one)."""
    trials = _trials(data)
    if "median_trial" in data["host_hit"]:
        return trials[data["host_hit"]["median_trial"]]
    ratios = [t["host_hit_ratio"] for t in trials]
    return trials[ratios.index(statistics.median_low(ratios))]


def host_hit(files: list[Json], args: Json) -> Figures:
    """TTFT and ratio of the median-ratio trial, with the range over every trial."""
    data = files[0]
    trials, mid = _trials(data), _median_trial(data)
    ttft = [t["host_hit_ttft_s"] * 1e3 for t in trials]
    ratios = [t["host_hit_ratio"] for t in trials]
    device = [t["device_hit_ttft_s"] * 1e3 for t in trials]
    text = (f"{ms(mid['host_hit_ttft_s'])} ms ({span(ttft, 1)}), "
            f"{mid['host_hit_ratio']:.2f} ({span(ratios, 2)})")
    ceiling = (f"PCIe copy {ms(mid['pcie_s'], 2)} ms ({mid['pcie_gbps']:.1f} GB/s); prefix on "
               f"device {ms(mid['device_hit_ttft_s'])} ms ({span(device, 1)})")
    return Figures(text, ceiling, checks={"ratio": ratios})


def host_hit_ttft(files: list[Json], args: Json) -> Figures:
    """Host-hit TTFT alone (median-ratio trial, range): for comparisons between variants."""
    data = files[0]
    ttft = [t["host_hit_ttft_s"] * 1e3 for t in _trials(data)]
    return Figures(f"{ms(_median_trial(data)['host_hit_ttft_s'])} ms ({span(ttft, 1)})")


def load_back(files: list[Json], args: Json) -> Figures:
    """Load-back alone against the same trial's PCIe copy, per file and over all of them."""
    names: list[str] = args["names"]
    ratios: list[float] = []
    parts = []
    gate_timeouts = 0
    for name, data in zip(names, files, strict=True):
        mine = [t["pcie_s"] / t["load_alone_s"] for t in _trials(data)]
        gate_timeouts += sum(t["gate_timeouts"] for t in _trials(data))
        parts.append(f"{name} {span(mine, 2)}")
        ratios += mine
    text = f"{span(ratios, 2)}x ({', '.join(parts)}); {gate_timeouts} gate timeouts"
    return Figures(text, "the PCIe copies above", checks={"ratio": ratios})


def write_back_host_hit(files: list[Json], args: Json) -> Figures:
    """A host-hit run's write-back against its PCIe copy to host: end to end, and its copies."""
    trials = _trials(files[0])
    e2e = [t["write_back_gbps"] / t["pcie_to_host_gbps"] for t in trials]
    copies = [t["write_back_copy_gbps"] / t["pcie_to_host_gbps"] for t in trials]
    pcie = [t["pcie_to_host_gbps"] for t in trials]
    mb = trials[0]["write_back_bytes"] / 1e6
    text = f"{span(e2e, 2)} end to end; copies {span(copies, 2)} ({mb:.0f} MB)"
    ceiling = f"PCIe to host {span(pcie, 1)} GB/s, one contiguous XLA copy"
    return Figures(text, ceiling, checks={"end_to_end": e2e, "copies": copies})


def write_back_head(files: list[Json], args: Json) -> Figures:
    """One head size's trials: end to end over PCIe, end to end time, copies over PCIe."""
    trials = files[0]["trials"][str(args["head_mb"])]
    e2e = [t["end_to_end_over_pcie"] for t in trials]
    wall = [t["write_back_s"] * 1e3 for t in trials]
    copies = [t["pcie_to_host_s"] / t["copies_s"] for t in trials]
    pcie = [t["pcie_to_host_s"] * 1e3 for t in trials]
    gb = trials[0]["bytes"] / 1e9
    text = (f"{span(e2e, 2)}; {span(wall, 1)} ms; {span(copies, 2)} "
            f"({gb:.2f} GB, {len(trials)} trials)")
    ceiling = f"PCIe to host {span(pcie, 1)} ms, one contiguous XLA copy"
    return Figures(text, ceiling, checks={"end_to_end": e2e, "copies": copies})


def device_hit_beside(files: list[Json], args: Json) -> Figures:
    """A device hit's TTFT beside another prefix's write-back, and alone, per file."""
    parts = []
    for name, data in zip(args["names"], files, strict=True):
        trials = _trials(data)
        beside = [t["device_hit_beside_write_back_ttft_s"] * 1e3 for t in trials]
        alone = [t["device_hit_ttft_s"] * 1e3 for t in trials]
        parts.append(f"{name} {span(beside, 1)} ms ({span(alone, 1)} ms)")
    return Figures("; ".join(parts))


def gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def storage_hit(files: list[Json], args: Json) -> Figures:
    """A turn on a prefix only in the storage tier (page cache dropped) against recompute: TTFTs
    and their ratio, the fetch's read rate against the disk's best rate measured in the same run
    (sequential, or in parallel); the bench's median trial (by TTFT), the range over all."""
    run = files[0]["storage_hit"]
    trials = run["trials"]
    mid = trials[run["median_trial"]]
    disk = run["disk_read_ceiling_bps"]  # the store's get rate for a Mooncake tier
    mooncake = run.get("storage_backend") == "mooncake"
    backend = "store's get rate" if mooncake else "disk"

    def each(key: str, scale: float = 1.0) -> list[float]:
        return [t[key] * scale for t in trials]

    hit, recompute = each("storage_hit_ttft_s", 1e3), each("recompute_ttft_s", 1e3)
    ratios, reads = each("storage_hit_over_recompute"), each("fetch_read_bps", 1e-9)
    over_disk = [t["fetch_read_bps"] / disk for t in trials]
    text = (f"{ms(mid['storage_hit_ttft_s'], 0)} ms ({span(hit, 0)}) against recompute "
            f"{ms(mid['recompute_ttft_s'], 0)} ms ({span(recompute, 0)}): "
            f"{mid['storage_hit_over_recompute']:.2f} ({span(ratios, 2)}); fetch read "
            f"{gbps(mid['fetch_read_bps'])} ({span(reads, 2)}), "
            f"{mid['fetch_read_bps'] / disk:.2f} of the {backend} ({span(over_disk, 2)}); "
            f"{plural(len(trials), 'trial')}")
    if mooncake:
        ceiling = (f"Mooncake store on this machine, page-sized objects: get "
                   f"{gbps(run['store_get_bps'])}, put {gbps(run['store_put_bps'])}")
    else:
        ceiling = (f"disk {gbps(run['disk_sequential_read_bps'])} sequential, "
                   f"{gbps(run['disk_parallel_read_bps'])} {run['disk_probe_files']} files in "
                   f"parallel ({run['disk_probe_bytes'] / 1e9:.2f} GB); page cache (not the "
                   f"disk) {gbps(run['page_cache_read_bps'])}")
    return Figures(text, ceiling, checks={"storage_hit_over_recompute": ratios,
                                          "fetch_read_over_disk": over_disk})


def scoring(files: list[Json], args: Json) -> Figures:
    """A prompt scored (its tokens' log probabilities) against the same length's plain prefill,
    nothing cached: the bench's median pair by ratio, the range over every pair, by TTFT and,
    where the run has them, end to end (the generate call) and through the server."""
    run = files[0]["scoring"]
    ratios = [t["scored_over_prefill"] for t in run["trials"]]
    compiles = sum(t["compiles"] for t in run["trials"])
    text = (f"scored {ms(run['scored_ttft_s'])} ms against prefill {ms(run['prefill_ttft_s'])} "
            f"ms: {run['scored_over_prefill']:.3f}x ({span(ratios, 3)}); ")
    checks = {"ratio": ratios}
    if "scored_over_prefill_e2e" in run:  # the generate call's time: records included
        e2e = checks["e2e_ratio"] = [t["scored_over_prefill_e2e"] for t in run["trials"]]
        text += (f"end to end {ms(run['scored_e2e_s'])} against {ms(run['prefill_e2e_s'])} ms: "
                 f"{run['scored_over_prefill_e2e']:.3f}x ({span(e2e, 3)}); ")
    pairs = plural(len(ratios), "pair")
    if "http" in run:  # through the server: /v1/completions with echo, timed by the client
        http = run["http"]
        served = checks["http_ratio"] = [t["scored_over_prefill"] for t in http["trials"]]
        compiles += sum(t["compiles"] for t in http["trials"])
        text += (f"through the server {ms(http['scored_e2e_s'])} against "
                 f"{ms(http['prefill_e2e_s'])} ms: {http['scored_over_prefill']:.3f}x "
                 f"({span(served, 3)}); ")
        pairs += f" in process and {len(served)} through the server"
    text += f"{pairs}, {plural(compiles, 'compile')}"
    return Figures(text, checks=checks)


def restart(files: list[Json], args: Json) -> Figures:
    """The rounds after a restart on the same storage (a directory; a Mooncake store, named)
    against the same rounds on an engine never restarted: hit rates, their ratio, where the
    hits came from."""
    run = files[0]["restart"]
    after, straight = run["restarted"], run["straight"]
    text = (f"hit rate {after['hit_rate']:.3f} after the restart (storage "
            f"{after['storage_hit_rate']:.3f}) against {straight['hit_rate']:.3f} never "
            f"restarted: {run['hit_rate_ratio']:.3f}; "
            f"{'the same answers' if run['same_answers'] else 'answers differ'}; "
            f"{run['storage_pages_at_restart']:,} pages in storage at the restart; compiles "
            f"{'/'.join(str(c) for c in run['compiles'])}")
    if run.get("storage_backend", "file") == "mooncake":
        text += "; on a Mooncake store"
    return Figures(text, checks={"ratio": [run["hit_rate_ratio"]]})


def step_vs_forward(files: list[Json], args: Json) -> Figures:
    """The engine's step (overlap on, and lock-step) against its forward alone."""
    case, key = args["case"], args["key"]
    data = files[0]
    over, lock = data["overlap"][case], data["lock_step"][case]
    ratio = over[key] / over["forward_alone_ms"]
    text = f"{over[key]:.2f} ms (lock-step {lock[key]:.2f} ms), {ratio:.2f}x"
    ceiling = f"forward alone {over['forward_alone_ms']:.2f} / {lock['forward_alone_ms']:.2f} ms"
    return Figures(text, ceiling, checks={"ratio": [ratio]})


_CONFIG = re.compile(r"(bq|bk|splits|w|s)(\d+|auto)")
_CONFIG_WORDS = {"bq": "block_q {}", "bk": "block_k {}", "splits": "{} splits",
                 "w": "{} warps", "s": "{} stages"}


def config_change(start: str, best: str) -> str:
    """What the best config changes from the sweep's start ("bk64_splits8_w4_s2")."""
    old = dict(_CONFIG.findall(start))
    return ", ".join(_CONFIG_WORDS[k].format(v) for k, v in _CONFIG.findall(best)
                     if old.get(k) != v)


def attention(files: list[Json], args: Json) -> Figures:
    """An attention target: the best config's per-layer time (best by the row's `ranked_by`
    clock), what it changes, against HBM read or a peer; where the run measured the matmul
    ceiling, the device clock's fraction of it and what the target asks of it."""
    data = files[0]
    case = data["attention_targets"][args["case"]]
    sweep = list(case["sweep_per_layer_ms"])
    change = config_change(sweep[0], case["best"])
    text = f"{case['per_layer_ms'] * 1e3:.1f} us" + (f" ({change})" if change else "")
    hbm = data["hbm_read_gbps"]
    if args.get("against") == "peer":
        peer = case["peer_per_layer_ms"]
        text += f"; {case['ours_over_peer']:.2f} x cuDNN"
        ceiling = f"cuDNN {peer * 1e3:.1f} us (HBM read {hbm:.0f} GB/s)"
        return Figures(text, ceiling, checks={"over_peer": [case["ours_over_peer"]]})
    frac = case["fraction_of_hbm_read"]
    digits = 2 if frac >= 0.1 else 3
    text += f"; {num(frac, digits)}"
    start_ms = case["sweep_per_layer_ms"][sweep[0]]
    if change and args.get("show_start"):
        text += f" (default {num(case['bytes'] / (start_ms * 1e6) / hbm, digits)})"
    ceiling = f"HBM read {hbm:.0f} GB/s"
    if "device_fraction_of_hbm_read" in case:  # the kernels' own time, from one traced call
        device = case["device_fraction_of_hbm_read"]
        ranks = " (ranks the sweep)" if case.get("ranked_by") == "device clock" else ""
        text += (f"; device clock{ranks} {case['device_time']['per_layer_us']:.1f} us, "
                 f"{num(device, 2 if device >= 0.1 else 3)}")
    read = case.get("layer_read")
    if isinstance(read, dict) and "wall_fraction" in read:
        ceiling += f"; a layer's bytes read alone {num(read['wall_fraction'], 2)}"
        if "device_fraction" in read:
            ceiling += f" (device clock {num(read['device_fraction'], 2)})"
    floor = case.get("floor")
    if isinstance(floor, dict) and "target_needs_fraction_of_matmul" in floor:
        ceiling += (f"; matmul {data['matmul_tflops']:.0f} TFLOP/s: the layer's FLOPs "
                    f"{floor['matmul_us']:.1f} us, the target asks for "
                    f"{num(floor['target_needs_fraction_of_matmul'], 2)} of it")
        if "device_fraction_of_matmul" in case:
            text += f" ({num(case['device_fraction_of_matmul'], 2)} of matmul)"
    return Figures(text, ceiling, checks={"fraction": [frac]})


def forward_floor(files: list[Json], args: Json) -> Figures:
    """A device-hit forward (or a decode step) against its HBM floor, one file per run, figures
    as "a / b"; with the traced kernel count and the host's dispatch time of one forward."""
    def each(fmt: Callable[[Json], str]) -> str:
        return " / ".join(fmt(d) for d in files)

    text = (f"{each(lambda d: num(d['forward']['back_to_back_ms'], 2))} ms "
            f"({each(lambda d: num(d['forward']['one_at_a_time_median_ms'], 2))}); "
            f"{each(lambda d: num(d['forward_over_floor'], 2))}; "
            f"{each(lambda d: str(d['trace']['kernels']))} kernels, dispatch "
            f"{each(lambda d: num(d['forward']['dispatch_us'], 0))} us")
    ceiling = (f"floor {each(lambda d: num(d['floor_ms'], 2))} ms "
               f"({each(lambda d: num(d['hbm_read_gbps'], 0))} GB/s)")
    return Figures(text, ceiling, checks={"ratio": [d["forward_over_floor"] for d in files]})


def fresh_vs_hf(files: list[Json], args: Json) -> Figures:
    """The engine's no-cache prefill TTFT against HF transformers' forward; ratio of the slowest."""
    ttft, peer = files[0]["fresh_ttft_ms"], files[1]["prefill_ms"]
    ratio = max(ttft) / peer
    text = f"{span(ttft, 1)} ms ({len(ttft)} requests); {ratio:.2f} (slowest)"
    return Figures(text, f"HF transformers' forward {peer:.1f} ms, same call",
                   checks={"ratio": [ratio]})


def gather(files: list[Json], args: Json) -> Figures:
    """The write-back gather (XLA) against the Pallas page-copy kernel in one launch."""
    data = files[0]
    g = data["write_back_gather"][args["preset"]]
    text = (f"{g['xla_gather_ms']:.2f} ms, {g['xla_gather_ms'] / g['pallas_one_launch_ms']:.2f} x "
            f"the peer, {g['xla_gather_gbps']:.0f} GB/s ({g['bytes_read_and_written'] / 1e6:.0f}"
            f" MB read + written)")
    ceiling = (f"peer one launch {g['pallas_one_launch_ms']:.2f} ms; HBM copy "
               f"{data['hbm_copy_gbps']:.0f} GB/s")
    return Figures(text, ceiling)


def programs_ab(files: list[Json], args: Json) -> Figures:
    """Per variant: a host-hit file and a multi-turn file (host-hit TTFT; tok/s, ITL; warm-up)."""
    parts = []
    for name, hit, turns in zip(args["names"], files[::2], files[1::2], strict=True):
        mode = turns["modes"]["hierarchical"]
        warm = mode["warmup"]
        ttft = host_hit_ttft([hit], {}).result
        parts.append(f"{name[:1].upper()}{name[1:]}: {ttft}; {_tok_itl(mode)}; "
                     f"{warm['compiles']} programs, {warm['ahead_s'] + warm['steps_s']:.1f} s")
    return Figures(". ".join(parts))


EXTRACTORS: dict[str, Callable[[list[Json], Json], Figures]] = {
    f.__name__: f for f in (
        server_start, serving_compiles, multiturn_http, multiturn, multiturn_cost,
        store_cost, fleet, multiturn_modes, multiturn_stream, serve_paths, host_hit, load_back,
        write_back_host_hit, write_back_head, device_hit_beside, storage_hit, scoring, restart,
        step_vs_forward, attention, forward_floor, fresh_vs_hf, gather, programs_ab)
}


def verdict(rules: Sequence[Rule], checks: dict[str, list[float]], samples: str) -> str:
    """yes, no, or partly: which rules held, in how many trials."""
    counts = []
    for rule in rules:
        values = checks[rule.metric]
        counts.append((rule.name, sum(rule.passes(v) for v in values), len(values)))
    if all(k == n for _, k, n in counts):
        return "yes"
    if all(k == 0 for _, k, _ in counts):
        return "no"

    def one(k: int, n: int) -> str:
        return "yes" if k == n else "no" if k == 0 else f"in {k} of {n} {samples}"

    if len(counts) == 1:
        return f"partly ({one(*counts[0][1:])})"
    return "partly (" + ", ".join(f"{name} {one(k, n)}" for name, k, n in counts) + ")"


@dataclass(frozen=True)
class Target:
    """What a row aims at: the text shown ({name} placeholders filled from the figures' fields),
    the numeric rules that decide "met", or a verdict of its own where none is a comparison."""

    text: str = "-"
    rules: tuple[Rule, ...] = ()
    met: str | None = None
    samples: str = "trials"


def page_row(kind: str, files: list[Json], args: Json, target: Target) -> Json:
    """The row's cells from `files` (the kind's inputs, the bench's own result first)."""
    fig = EXTRACTORS[kind](files, args)
    if target.met is not None:
        met = target.met.format_map(fig.fields)
    elif target.rules:
        met = verdict(target.rules, fig.checks, target.samples)
    else:
        met = "-"
    return {"kind": kind, "result": fig.result, "ceiling": fig.ceiling,
            "target": target.text.format_map(fig.fields), "met": met}


def add_row(result: Json, kind: str, target: Target, args: Json | None = None) -> Json:
    """`result` with its own row of `kind` under "page_rows" (the bench's run alone)."""
    rows = dict(result.get("page_rows", {}))
    rows[kind] = page_row(kind, [result], args or {}, target)
    return {**result, "page_rows": rows}


RESULTS = Path(__file__).resolve().parent / "results"


def parse_rule(text: str) -> Rule:
    """METRIC:at_most|at_least:BOUND[:NAME], NAME the metric's by default."""
    metric, side, bound, *name = text.split(":")
    if side not in ("at_most", "at_least"):
        raise argparse.ArgumentTypeError(f"{text!r}: the side is at_most or at_least")
    return Rule(metric, name[0] if name else metric, **{side: float(bound)})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rows",
                                description="Writes a page row into a result file.")
    p.add_argument("file", type=Path, help="the row's run (in benchmarks/results/ or a path)")
    p.add_argument("row", help="the row's key under the file's page_rows")
    p.add_argument("kind", choices=sorted(EXTRACTORS), help="what reads the figures")
    p.add_argument("--with", dest="others", type=Path, action="append", default=[],
                   help="another run the kind reads, after FILE (repeat, in its order)")
    p.add_argument("--args", type=json.loads, default={}, help="the kind's arguments (JSON)")
    p.add_argument("--target", default="-", help="the target as shown ({field}s filled in)")
    p.add_argument("--rule", type=parse_rule, action="append", default=[],
                   help="METRIC:at_most|at_least:BOUND[:NAME], decides met (repeat)")
    p.add_argument("--met", default=None, help="the verdict, where none is a comparison")
    p.add_argument("--samples", default="trials", help="what the verdict counts")
    cli = p.parse_args(argv)
    paths = [f if f.exists() else RESULTS / f for f in (cli.file, *cli.others)]
    files = [json.loads(path.read_text()) for path in paths]
    row = page_row(cli.kind, files, cli.args,
                   Target(cli.target, tuple(cli.rule), cli.met, cli.samples))
    if cli.others:
        row["files"] = [path.name for path in paths]
    files[0]["page_rows"] = {**files[0].get("page_rows", {}), cli.row: row}
    paths[0].write_text(json.dumps(files[0], indent=1))
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
