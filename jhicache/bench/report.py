"""Tables and plots of `python -m jhicache.bench` results."""

from __future__ import annotations

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
    penalties = [f"{name} penalty {spec[f'{name}_penalty']}"
                 for name, off in (("presence", 0), ("frequency", 0), ("repetition", 1))
                 if spec.get(f"{name}_penalty", off) != off]
    if penalties:
        lines.append("  every request with " + ", ".join(penalties))
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
