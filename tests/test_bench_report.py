"""jhicache.bench.report: byte amounts in readable units, and the multiturn PNG's content."""

from __future__ import annotations

import re

import pytest

from jhicache.bench import report


def multiturn_result(modes: dict[str, list[tuple[float, float]]], **stats) -> dict:
    """A multiturn result of bench.run's shape; `modes` maps a mode to its rounds' (device hit
    rate, host hit rate)."""
    base = {"load_back_ops": 5, "load_back_bytes": 204_800,
            "write_back_ops": 1, "write_back_bytes": 4096,
            "evicted_device_tokens": 0, "evicted_host_tokens": 0}

    def mode(rates: list[tuple[float, float]]) -> dict:
        rounds = [{"mean_ttft_s": 0.01 * (i + 1), "device_hit_rate": dev, "host_hit_rate": host,
                   "prompt_tokens": 10, "output_tokens": 2} for i, (dev, host) in enumerate(rates)]
        return {"rounds": rounds, "stats": {**base, **stats}, "throughput_tokens_per_s": 1.0,
                "elapsed_s": 1.0, "device_kv_tokens": 64}

    rounds = len(next(iter(modes.values())))
    spec = {"num_clients": 2, "num_rounds": rounds, "request_length": 8, "output_length": 2}
    return {"preset": "tiny", "device": "cpu", "backend": "cpu", "spec": spec,
            "modes": {name: mode(rates) for name, rates in modes.items()}}


ONE_ROUND = {"hierarchical": [(0.5, 0.25)]}


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (999, "999 B"), (1000, "1.00 kB"),
                                          (1234, "1.23 kB"), (99_949, "99.9 kB"),
                                          (204_800, "205 kB"), (999_600, "1.00 MB"),
                                          (5.2e9, "5.20 GB")])
def test_format_bytes_picks_a_unit_that_keeps_three_digits(nbytes: float, text: str) -> None:
    assert report.format_bytes(nbytes) == text


def test_small_amounts_never_read_zero() -> None:
    assert report.format_rate(2e-4) == "200 kB/s"
    summary = report.multiturn_table(multiturn_result(ONE_ROUND, load_back_bytes=163_840))
    assert not re.search(r"(?<![\d.])0 MB", summary) and "(164 kB)" in summary


def test_the_table_says_when_answers_were_sampled() -> None:
    result = multiturn_result(ONE_ROUND)
    assert "sampled" not in report.multiturn_table(result)
    result["spec"].update(temperature=0.8, top_p=0.9)
    assert "answers sampled at temperature 0.8, top-p 0.9" in report.multiturn_table(result)


def test_title_names_the_model_and_device_and_flags_a_cpu_run() -> None:
    result = multiturn_result(ONE_ROUND)
    assert report.plot_title(result).startswith("tiny on cpu: 2 clients x 1 rounds")
    assert "CPU run" in report.plot_title(result)
    on_gpu = {**result, "preset": "/ckpt/Qwen2-7B/", "device": "NVIDIA H200", "backend": "gpu"}
    title = report.plot_title(on_gpu)
    assert title.startswith("Qwen2-7B on NVIDIA H200") and "CPU" not in title


def test_figure_draws_each_tier_a_legend_per_panel_and_whole_rounds() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rates = {"device": [(0.0, 0.0), (0.4, 0.0), (0.1, 0.0)],
             "hierarchical": [(0.0, 0.0), (0.4, 0.0), (0.1, 0.5)]}
    fig = report.make_figure(multiturn_result(rates))
    try:
        ax_ttft, ax_hit = fig.axes
        assert all(ax.get_legend() is not None for ax in fig.axes)
        labels = [t.get_text() for t in ax_hit.get_legend().get_texts()]
        assert {"device", "hierarchical", "device hits", "host hits"} <= set(labels)
        fig.canvas.draw()
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks)
        # Bars: per mode, device hits then host hits stacked on them, one each per round.
        bars = [(round(b.get_y(), 6), round(b.get_height(), 6)) for b in ax_hit.patches]
        assert bars[-3:] == [(0.0, 0.0), (0.4, 0.0), (0.1, 0.5)]  # hierarchical's host hits
        assert len(bars) == 2 * 2 * 3
        styles = {(line.get_marker(), line.get_linestyle()) for line in ax_ttft.get_lines()}
        assert len(styles) == 2  # overlapping modes still look different
        assert "tiny on cpu" in fig.get_suptitle()
    finally:
        plt.close(fig)


def with_latencies(result: dict) -> dict:
    """`result` with the client-side TTFT percentiles and ITL that AsyncEngine runs report."""
    for mode in result["modes"].values():
        for r in mode["rounds"]:
            r.update(ttft_p50_s=r["mean_ttft_s"] * 0.9, ttft_p90_s=r["mean_ttft_s"] * 1.5,
                     ttft_p99_s=r["mean_ttft_s"] * 2)
        mode.update(ttft={"mean_s": 0.01, "p50_s": 0.009, "p90_s": 0.015, "p99_s": 0.02},
                    itl={"p50_s": 0.001, "p99_s": 0.004})
    result["spec"].update(request_rate=16.0, max_parallel=8, ready_queue_policy="random",
                          round_barrier="off")
    return result


def test_table_gives_ttft_percentiles_and_itl_and_how_requests_were_sent() -> None:
    table = report.multiturn_table(with_latencies(multiturn_result({"device": [(0.0, 0.0)] * 2})))
    assert "TTFT mean/p50/p90/p99 10.00/9.00/15.00/20.00 ms; ITL p50/p99 1.00/4.00 ms" in table
    assert "16.0 req/s, at most 8 in flight, random ready queue, round barrier off" in table
    row = next(line for line in table.splitlines() if line.startswith("    2 |"))
    assert row.split()[2:4] == ["0.0200", "0.0400"]  # round 2's mean and p99 TTFT


def test_figure_shades_p50_to_p99_when_the_result_has_them() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    for result, bands in ((multiturn_result(ONE_ROUND), 0),
                          (with_latencies(multiturn_result(ONE_ROUND)), 1)):
        fig = report.make_figure(result)
        try:
            assert len(fig.axes[0].collections) == bands
        finally:
            plt.close(fig)
