"""Tables of the scenario benches' results (host-hit, storage-hit, scoring, restart,
serve-overhead), in the units of `jhicache.bench.report`."""

from __future__ import annotations

import functools
import textwrap

from jhicache.bench.report import format_rate


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


def _backend_alone(result: dict) -> str:
    """The storage backend's own rate beside the fetch's: the disk's, or the store's."""
    if result.get("storage_backend") == "mooncake":
        return (f"the Mooncake store alone: get {format_rate(result['store_get_bps'] / 1e9)}, "
                f"put {format_rate(result['store_put_bps'] / 1e9)}; fetch / get "
                f"{result['fetch_read_over_disk']:.2f}")
    return (f"the disk alone: sequential {format_rate(result['disk_sequential_read_bps'] / 1e9)}"
            f", {result['disk_probe_files']} files at once "
            f"{format_rate(result['disk_parallel_read_bps'] / 1e9)} (page cache "
            f"{format_rate(result['page_cache_read_bps'] / 1e9)}); fetch / disk "
            f"{result['fetch_read_over_disk']:.2f}")


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
            f"{format_rate(result['fetch_read_bps'] / 1e9)}; {_backend_alone(result)}\n"
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
