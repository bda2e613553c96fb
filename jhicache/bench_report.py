"""Tables and plots of `python -m jhicache.bench` results."""

from __future__ import annotations

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
    return (f"model: batch {result['batch']} x {result['prompt_len']} prompt tokens, {result['new_tokens']} new\n"
            f"  prefill {result['prefill_tokens_per_s']:,.0f} tok/s   decode {result['decode_tokens_per_s']:,.0f} tok/s")


def multiturn_table(result: dict) -> str:
    modes = result["modes"]
    spec = result["spec"]
    lines = [f"multiturn: {spec['num_clients']} clients x {spec['num_rounds']} rounds, "
             f"+{spec['request_length']} tokens/turn, {spec['output_length']} out; "
             f"device pool {min(m['device_kv_tokens'] for m in modes.values())} tokens, "
             f"working set {spec['num_clients'] * spec['num_rounds'] * (spec['request_length'] + spec['output_length'])}"]
    header = "round " + "".join(f"| {m:^30} " for m in modes)
    lines += [header, "      " + "".join(f"| {'ttft s':>9} {'dev hit':>9} {'host hit':>9} " for _ in modes)]
    for r in range(spec["num_rounds"]):
        cells = "".join(
            f"| {m['rounds'][r]['mean_ttft_s']:9.4f} {m['rounds'][r]['device_hit_rate']:9.3f} "
            f"{m['rounds'][r]['host_hit_rate']:9.3f} " for m in modes.values())
        lines.append(f"{r:5d} {cells}")
    for name, m in modes.items():
        s = m["stats"]
        lines.append(f"{name:>12}: {m['throughput_tokens_per_s']:,.0f} tok/s, {m['elapsed_s']:.2f} s; "
                     f"loads {s['load_back_ops']} ({format_bytes(s['load_back_bytes'])}), "
                     f"write-backs {s['write_back_ops']} ({format_bytes(s['write_back_bytes'])}), "
                     f"evicted {s['evicted_device_tokens']} device / {s['evicted_host_tokens']} host tokens")
        if m.get("write_back_gbps"):
            lines.append(f"{'':>14}write-back >= {format_rate(m['write_back_gbps'])} (launch to seen done)")
        if s["load_back_s"] > 0:
            lines.append(f"{'':>14}load-back >= {format_rate(m['load_back_gbps'])} "
                         f"({format_bytes(s['load_back_moved_bytes'])} moved, launch to landed), "
                         f"{m['load_hidden_fraction']:.0%} of load time hidden under compute")
    return "\n".join(lines)


def host_hit_table(result: dict) -> str:
    return (f"host hit: {result['prefix_tokens']}-token prefix + {result['turn_tokens']}-token turn\n"
            f"  TTFT no cache {result['no_cache_ttft_s'] * 1e3:.1f} ms | prefix on device "
            f"{result['device_hit_ttft_s'] * 1e3:.1f} ms | prefix on host {result['host_hit_ttft_s'] * 1e3:.1f} ms\n"
            f"  load alone {result['load_alone_s'] * 1e3:.2f} ms ({format_rate(result['load_gbps'])}), "
            f"hidden under compute {result['load_hidden_fraction']:.0%} "
            f"(engine's timeline: compute waited >= {result['engine_load_exposed_s'] * 1e3:.2f} ms "
            f"of the {result['engine_load_back_s'] * 1e3:.2f} ms load)\n"
            f"  PCIe copy of the same bytes {result['pcie_s'] * 1e3:.2f} ms ({format_rate(result['pcie_gbps'])}); "
            f"host hit / max(PCIe, device hit) = {result['target_ratio']:.2f} (target <= 1.25)")


def save_plot(result: dict, path: str) -> bool:
    """PNG of mean TTFT and hit rate per round, one line per mode; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(10, 4))
    for name, mode in result["modes"].items():
        rounds = mode["rounds"]
        ax_ttft.plot([r["mean_ttft_s"] for r in rounds], marker="o", label=name)
        ax_hit.plot([r["device_hit_rate"] + r["host_hit_rate"] for r in rounds], marker="o", label=name)
    ax_ttft.set(xlabel="round", ylabel="mean TTFT (s)", title="TTFT per round")
    ax_hit.set(xlabel="round", ylabel="hit rate (device + host)", title="Cache hit rate per round", ylim=(0, 1))
    ax_ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
