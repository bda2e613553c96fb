"""Tables and plots of `python -m jhicache.bench` results."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

_BYTE_UNITS = ("B", "kB", "MB", "GB", "TB")


def format_bytes(nbytes: float) -> str:
    """`nbytes` in the largest decimal unit that keeps it at least 1, to three significant
    digits, so that a small amount never reads as "0 MB"."""
    value, index = float(nbytes), 0
    while abs(value) >= 999.5 and index < len(_BYTE_UNITS) - 1:  # 999.5 would round to "1000"
        value, index = value / 1000, index + 1
    if index == 0:
        return f"{value:.0f} B"
    decimals = 2 if abs(value) < 9.995 else 1 if abs(value) < 99.95 else 0
    return f"{value:.{decimals}f} {_BYTE_UNITS[index]}"


def format_rate(gbps: float) -> str:
    """A rate given in GB/s, in format_bytes's units per second."""
    return f"{format_bytes(gbps * 1e9)}/s"


def model_table(result: dict) -> str:
    return (f"model: batch {result['batch']} x {result['prompt_len']} prompt tokens, "
            f"{result['new_tokens']} new\n"
            f"  prefill {result['prefill_tokens_per_s']:,.0f} tok/s   "
            f"decode {result['decode_tokens_per_s']:,.0f} tok/s")


def multiturn_table(result: dict) -> str:
    modes = result["modes"]
    spec = result["spec"]
    working_set = (spec["num_clients"] * spec["num_rounds"]
                   * (spec["request_length"] + spec["output_length"]))
    lines = [f"multiturn: {spec['num_clients']} clients x {spec['num_rounds']} rounds, "
             f"+{spec['request_length']} tokens/turn, {spec['output_length']} out; "
             f"device pool {_smallest_pool(modes)} tokens, working set {working_set}"]
    if "request_rate" in spec:  # results from before the clients went through AsyncEngine lack it
        lines.append(f"  sent at {spec['request_rate']} req/s, at most {spec['max_parallel']} in "
                     f"flight, {spec['ready_queue_policy']} ready queue, "
                     f"round barrier {spec['round_barrier']}")
    if spec.get("temperature"):
        top_p = spec.get("top_p")
        lines.append(f"  answers sampled at temperature {spec['temperature']}"
                     + (f", top-p {top_p}" if top_p is not None else "")
                     + ", a seed per turn")
    lines += _round_rows(modes, spec["num_rounds"])
    for name, m in modes.items():
        lines += _mode_lines(name, m)
    return "\n".join(lines)


def _smallest_pool(modes: dict) -> int | str:
    """The smallest device pool of the modes ("?" where a server did not say)."""
    pools = [m["device_kv_tokens"] for m in modes.values() if m["device_kv_tokens"] is not None]
    return min(pools) if pools else "?"


def _round_rows(modes: dict, num_rounds: int) -> list[str]:
    """Per round and mode: mean and p99 TTFT (s, client side), device and host hit rates."""
    header = "round " + "".join(f"| {m:^40} " for m in modes)
    names = f"| {'ttft s':>9} {'p99 s':>9} {'dev hit':>9} {'host hit':>9} "
    lines = [header, "      " + names * len(modes)]
    for r in range(num_rounds):
        cells = "".join(_round_cells(m["rounds"][r]) for m in modes.values())
        lines.append(f"{r + 1:5d} {cells}")  # rounds count from 1, as in the plot
    return lines


def _round_cells(r: dict) -> str:
    p99 = r.get("ttft_p99_s")
    p99_text = f"{p99:9.4f}" if p99 is not None else f"{'-':>9}"
    return (f"| {r['mean_ttft_s']:9.4f} {p99_text} {r['device_hit_rate']:9.3f} "
            f"{r['host_hit_rate']:9.3f} ")


def _mode_lines(name: str, m: dict) -> list[str]:
    s = m["stats"]
    head = f"{name:>12}: {m['throughput_tokens_per_s']:,.0f} tok/s, {m['elapsed_s']:.2f} s; "
    if s is None:  # a remote server's: its counters are in its /metrics
        lines = [head + "engine counters: see the server's /metrics"]
    else:
        lines = [head + f"loads {s['load_back_ops']} ({format_bytes(s['load_back_bytes'])}), "
                 f"write-backs {s['write_back_ops']} ({format_bytes(s['write_back_bytes'])}), "
                 f"evicted {s['evicted_device_tokens']} device / {s['evicted_host_tokens']} "
                 f"host tokens"]
    if "ttft" in m:
        gap = m.get("max_token_gap_s")
        lines.append(f"{'':>14}{latency_text(m['ttft'], m['itl'])}"
                     + ("" if gap is None else f"; longest token gap {gap * 1e3:.1f} ms"))
    compiles = m.get("compiles_during_run")
    if compiles is not None:  # each one's seconds count as latency
        programs = compiles.get("programs") or []
        lines.append(f"{'':>14}compiles during the run: {compiles['count']}"
                     + (f" ({compiles['seconds']:.2f} s): {', '.join(programs)}"
                        if programs else ""))
    return lines


def latency_text(ttft: dict, itl: dict) -> str:
    """TTFT mean/p50/p90/p99 and ITL p50/p99, in ms."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f}"

    spread = "/".join(ms(ttft[k]) for k in ("mean_s", "p50_s", "p90_s", "p99_s"))
    return (f"TTFT mean/p50/p90/p99 {spread} ms; "
            f"ITL p50/p99 {ms(itl['p50_s'])}/{ms(itl['p99_s'])} ms")


def serve_overhead_table(result: dict) -> str:
    """Per mode: TTFT, end-to-end latency, ITL and throughput in process, over HTTP with the
    engine in a thread, and over HTTP with an engine process, and each HTTP path's difference
    from in process (what the server adds per request)."""
    spec = result["spec"]
    lines = [f"serve-overhead: {spec['num_clients']} clients x {spec['num_rounds']} rounds, "
             f"+{spec['request_length']} tokens/turn, {spec['output_length']} out; "
             f"{result['how']}"]
    for mode, m in result["modes"].items():
        lines += [f"{mode}: tokens {'identical' if m['same_tokens'] else 'DIFFER'} in process "
                  f"and over HTTP (both ways)",
                  f"  {'':<18}{'in process':>11}{'HTTP':>10}{'HTTP+proc':>10}"
                  f"{'HTTP - in process':>18}{'HTTP+proc - in':>16}"]
        lines += [_overhead_row(label, m, keys) for label, keys in _OVERHEAD_ROWS]
        tok_s = [m[path]["throughput_tokens_per_s"] for path in _PATHS]
        ratios = [f"x {m[k]['throughput_ratio']:.3f}" for k in ("overhead", "overhead_process")]
        lines.append(f"  {'throughput tok/s':<18}{tok_s[0]:>11,.0f}{tok_s[1]:>10,.0f}"
                     f"{tok_s[2]:>10,.0f}{ratios[0]:>18}{ratios[1]:>16}")
        lines.append("  XLA compiles during the measured run (their seconds count as latency): "
                     + ", ".join(_compiles(path, m[path]) for path in _PATHS))
        lines.append("  device hit TTFT p50 as the clients / the server / the engine saw it: "
                     + "; ".join(_probe_split(path, m[path]["device_hit"]) for path in _PATHS))
        cpu = [m[path].get("clients_cpu_per_request_s") for path in _PATHS[1:]]
        if None not in cpu:
            lines.append("  the HTTP clients' own CPU time per request (their process, part of "
                         f"the latency it measures): HTTP {cpu[0] * 1e3:.2f} ms, HTTP+proc "
                         f"{cpu[1] * 1e3:.2f} ms")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="    ") for line in lines)


def _probe_split(path: str, hit: dict) -> str:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f}"

    return (f"{_PATH_NAMES[path].split(' (')[0]} {ms(hit['ttft']['p50_s'])} / "
            f"{ms(hit.get('server_ttft_p50_s'))} / {ms(hit.get('engine_ttft_p50_s'))} ms")


def _compiles(path: str, summary: dict) -> str:
    c = summary["compiles_during_run"]
    seconds = "" if c["seconds"] is None else f" ({c['seconds']:.2f} s)"
    return f"{_PATH_NAMES[path]} {c['count']}{seconds}"


_PATHS = ("in_process", "http", "http_process")
_PATH_NAMES = {"in_process": "in process", "http": "HTTP",
               "http_process": "HTTP + engine process (counted in the child)"}


# (label, the keys of a figure in a path's summary) of serve_overhead_table's rows, in ms
_OVERHEAD_ROWS = (("TTFT mean ms", ("ttft", "mean_s")), ("TTFT p50 ms", ("ttft", "p50_s")),
                  ("TTFT p99 ms", ("ttft", "p99_s")), ("e2e mean ms", ("e2e", "mean_s")),
                  ("e2e p50 ms", ("e2e", "p50_s")), ("ITL p50 ms", ("itl", "p50_s")),
                  ("device hit TTFT p50", ("device_hit", "ttft", "p50_s")))


def _overhead_row(label: str, m: dict, keys: tuple[str, ...]) -> str:
    here, http, proc = (functools.reduce(dict.__getitem__, keys, m[path]) for path in _PATHS)
    if here is None or http is None or proc is None:
        return f"  {label:<18}{'-':>11}{'-':>10}{'-':>10}{'-':>18}{'-':>16}"
    return (f"  {label:<18}{here * 1e3:>11.2f}{http * 1e3:>10.2f}{proc * 1e3:>10.2f}"
            f"{(http - here) * 1e3:>+18.2f}{(proc - here) * 1e3:>+16.2f}")


def host_hit_table(result: dict) -> str:
    return (f"host hit: {result['prefix_tokens']}-token prefix + "
            f"{result['turn_tokens']}-token turn\n"
            f"  TTFT no cache {result['no_cache_ttft_s'] * 1e3:.1f} ms | prefix on device "
            f"{result['device_hit_ttft_s'] * 1e3:.1f} ms | prefix on host "
            f"{result['host_hit_ttft_s'] * 1e3:.1f} ms\n"
            f"  load alone {result['load_alone_s'] * 1e3:.2f} ms "
            f"({format_rate(result['load_gbps'])}), "
            f"hidden under compute {result['load_hidden_fraction']:.0%}; "
            f"PCIe copy of the same bytes {result['pcie_s'] * 1e3:.2f} ms "
            f"({format_rate(result['pcie_gbps'])})\n"
            f"  host hit / max(PCIe, device hit) = {result['host_hit_ratio']:.2f}\n"
            f"  write-back {format_rate(result['write_back_gbps'])} end to end, its copies "
            f"{format_rate(result['write_back_copy_gbps'])} "
            f"(PCIe to host {format_rate(result['pcie_to_host_gbps'])}); device hit beside a "
            f"write-back {result['device_hit_beside_write_back_ttft_s'] * 1e3:.1f} ms"
            + _gate_text(result) + _trials_text(result)
            + _timeline_text(result.get("host_hit_timeline")))


def storage_hit_table(result: dict) -> str:
    trials = result["trials"]
    ttfts = [t["storage_hit_ttft_s"] * 1e3 for t in trials]
    return (f"storage hit: {result['prefix_tokens']}-token prefix + "
            f"{result['turn_tokens']}-token turn, the prefix only in the storage tier (page "
            f"cache dropped: {result['files_dropped_from_page_cache']} files)\n"
            f"  TTFT recompute {result['recompute_ttft_s'] * 1e3:.1f} ms | prefix in storage "
            f"{result['storage_hit_ttft_s'] * 1e3:.1f} ms "
            f"(x {result['storage_hit_over_recompute']:.2f} of recompute) | prefix on device "
            f"{result['device_hit_ttft_s'] * 1e3:.1f} ms\n"
            f"  fetch policy {result['fetch_policy']}: {result['storage_hit_tokens']} of the "
            f"prefix's tokens taken from storage, the rest computed; "
            f"{sum(t['storage_hit_compiles'] for t in trials)} compiles in the storage hits\n"
            f"  read {result['engine_storage_read_bytes'] / 1e9:.2f} GB in "
            f"{result['engine_storage_fetch_read_s'] * 1e3:.1f} ms by "
            f"{result.get('storage_io_threads', '?')} reader threads: "
            f"{format_rate(result['fetch_read_bps'] / 1e9)}; the disk alone: sequential "
            f"{format_rate(result['disk_sequential_read_bps'] / 1e9)}, "
            f"{result['disk_probe_files']} files at once "
            f"{format_rate(result['disk_parallel_read_bps'] / 1e9)}"
            f" (page cache {format_rate(result['page_cache_read_bps'] / 1e9)}); fetch / disk "
            f"{result['fetch_read_over_disk']:.2f}\n"
            f"  the median of {len(trials)} trials by storage-hit TTFT (trial "
            f"{result['median_trial'] + 1}): {min(ttfts):.1f}-{max(ttfts):.1f} ms")


_SERVERS = {"thread": "the engine in a thread of the server's process",
            "process": "the engine in an engine process, as the server's command runs it"}


def scoring_table(result: dict) -> str:
    pairs, http = len(result["trials"]), result.get("http")
    text = (f"scoring a {result['prompt_tokens']}-token prompt (its tokens' log probabilities, "
            f"one alternative each), nothing cached, against its plain prefill (the median of "
            f"{pairs} pairs): TTFT {_against(result, 'ttft_s', 'scored_over_prefill')}; "
            f"end to end (the generate call, records included) "
            f"{_against(result, 'e2e_s', 'scored_over_prefill_e2e')}; compiles in the measured "
            f"pairs {sum(t['compiles'] for t in result['trials'])}")
    if http is not None:
        server = _SERVERS[result.get("server", "thread")]
        text += (f"\n  through the server (/v1/completions, echo and logprobs 1 against neither, "
                 f"one new token, timed by a client in a process of its own; {server}"
                 f"): {_against(http, 'e2e_s', 'scored_over_prefill')}; compiles "
                 f"{sum(t['compiles'] for t in http['trials'])}")
    return text


def _against(run: dict, time: str, ratio: str) -> str:
    """A scoring run's "scored against plain ms, x ratio (range over its pairs)" by `time`."""
    ratios = [t[ratio] for t in run["trials"]]
    return (f"{run['scored_' + time] * 1e3:.1f} against {run['prefill_' + time] * 1e3:.1f} ms, "
            f"x {run[ratio]:.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


def restart_table(result: dict) -> str:
    def hits(part: dict) -> str:
        return (f"{part['hit_rate']:.3f} (device {part['device_hit_rate']:.3f}, host "
                f"{part['host_hit_rate']:.3f}, storage {part['storage_hit_rate']:.3f}) over "
                f"{part['prompt_tokens']} prompt tokens, {part['requests']} requests")

    return (f"restart on the storage directory before round {result['restart_round']} of "
            f"{result['spec']['num_rounds']} ({result['storage_pages_at_restart']} pages "
            f"stored then)\n"
            f"  hit rate of the later rounds, never restarted: {hits(result['straight'])}\n"
            f"  the same rounds after the restart: {hits(result['restarted'])}\n"
            f"  restarted / never restarted: {result['hit_rate_ratio']:.3f}; answers the same: "
            f"{result['same_answers']}; compiles while serving {result['compiles']}")


def _gate_text(result: dict) -> str:
    """The load's copies by CUDA events, and whether the device-side wait held."""
    if "engine_load_back_s" not in result:
        return ""
    return (f"\n  its load's copies {result['engine_load_back_s'] * 1e3:.2f} ms (device clock); "
            f"forwards that waited on the device {result['engine_load_gated_steps']}, "
            f"gate timeouts {result['gate_timeouts']}")


def _trials_text(result: dict) -> str:
    """Which trial the figures are, and the spread of the ratio over all of them."""
    trials = result.get("trials") or []
    if len(trials) < 2:
        return ""
    low, high = result["host_hit_ratio_range"]
    ttfts = [t["host_hit_ttft_s"] * 1e3 for t in trials]
    return (f"\n  the median of {len(trials)} trials by that ratio (trial "
            f"{result['median_trial'] + 1}); ratios {low:.2f}-{high:.2f}, host hit "
            f"{min(ttfts):.1f}-{max(ttfts):.1f} ms")


def _timeline_text(t: dict | None) -> str:
    """The host hit on the host clock, in ms from its add_request call, and the load's copies
    on the device clock."""
    if not t:
        return ""
    steps = ", ".join(f"{at:.2f}" for at in t["steps_returned_ms"])
    pauses = t.get("gc_pauses", [])
    return (f"\n  host hit, ms from add_request: step() returned at {steps}, first token "
            f"{t['first_token_ms']:.2f}; {len(pauses)} garbage collections, "
            f"{sum(p['ms'] for p in pauses):.2f} ms")


# (marker, dashes, marker size) per mode in the order run: lines that coincide (hierarchical and
# unbounded while the device pool still holds everything) stay visible as rings around dots.
_LINE_STYLES = (("o", "-", 10), ("s", "--", 8), ("^", "-.", 6), ("D", ":", 4))


def plot_title(result: dict) -> str:
    """The figure's title: model, device, workload, and on a CPU what its timings are worth."""
    model = Path(result["preset"]).name  # a checkpoint directory reads as its folder name
    spec = result["spec"]
    pool = min(m["device_kv_tokens"] for m in result["modes"].values())
    title = (f"{model} on {result['device']}: {spec['num_clients']} clients x "
             f"{spec['num_rounds']} rounds, device pool {pool} tokens")
    if result.get("backend") != "gpu":
        title += "\n(CPU run: timings only check that the bench runs)"
    return title


def save_plot(result: dict, path: str) -> bool:
    """Writes make_figure's PNG to `path`; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = make_figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_figure(result: dict):
    """Mean TTFT per round (a line per mode, over a p50-p99 band where the result has them)
    beside hit rate per round split by tier (a bar per
    mode: device hits solid, host hits hatched on top), under plot_title's title."""
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(12, 5))
    colors = {name: plt.get_cmap("tab10")(i) for i, name in enumerate(result["modes"])}
    _plot_ttft(ax_ttft, result["modes"], colors)
    _plot_hits(ax_hit, result["modes"], colors)
    fig.suptitle(plot_title(result))
    fig.tight_layout()
    return fig


def _plot_ttft(ax, modes: dict, colors: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    styles = _cycle(_LINE_STYLES, len(modes))
    banded = False
    for (name, mode), (marker, dashes, size) in zip(modes.items(), styles):
        rounds = range(1, len(mode["rounds"]) + 1)
        ttfts = [r["mean_ttft_s"] * 1e3 for r in mode["rounds"]]
        ax.plot(rounds, ttfts, color=colors[name], marker=marker,
                linestyle=dashes, markersize=size, alpha=0.8, label=name)
        if all(r.get("ttft_p99_s") is not None for r in mode["rounds"]):
            low = [r["ttft_p50_s"] * 1e3 for r in mode["rounds"]]
            high = [r["ttft_p99_s"] * 1e3 for r in mode["rounds"]]
            ax.fill_between(rounds, low, high, color=colors[name], alpha=0.15, linewidth=0)
            banded = True
    title = "TTFT per round" + (" (line: mean; band: p50 to p99)" if banded else "")
    ax.set(xlabel="round", ylabel="TTFT (ms)", title=title)
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(title="cache mode", fontsize="small")


def _plot_hits(ax, modes: dict, colors: dict) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    width = 0.8 / len(modes)
    for i, (name, mode) in enumerate(modes.items()):
        x = [r + 1 + (i - (len(modes) - 1) / 2) * width for r in range(len(mode["rounds"]))]
        device = [r["device_hit_rate"] for r in mode["rounds"]]
        host = [r["host_hit_rate"] for r in mode["rounds"]]
        ax.bar(x, device, width, color=colors[name], edgecolor="white", linewidth=0.5)
        ax.bar(x, host, width, bottom=device, color=colors[name], alpha=0.35, hatch="///",
               edgecolor=colors[name], linewidth=0.5)
    handles = [Patch(color=colors[name], label=name) for name in modes]
    handles += [Patch(facecolor="grey", label="device hits"),
                Patch(facecolor="grey", alpha=0.35, hatch="///", edgecolor="grey",
                      label="host hits")]
    ax.set(xlabel="round", ylabel="share of prompt tokens", title="Cache hits per round, by tier",
           ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=handles, fontsize="small", loc="upper left", ncol=2)


def _cycle(items: tuple, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]
