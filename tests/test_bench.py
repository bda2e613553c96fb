"""`python -m jhicache.bench`: the JSON it writes has the documented shape, on a tiny CPU workload."""

from __future__ import annotations

import json

import pytest

from jhicache import bench

TINY = ["--preset", "tiny", "--clients", "3", "--rounds", "2", "--request-length", "24", "--output-length", "2",
        "--page-size", "8", "--dtype", "float32"]


def test_multiturn_json_has_rounds_per_mode_and_unbounded_reference(tmp_path, capsys) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["multiturn", *TINY, "--modes", "off,hierarchical,unbounded", "--out", str(out), "--plot", str(png)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr()
    assert "timings only check that the bench runs" in printed.out.splitlines()[0]  # a CPU run
    assert png.read_bytes().startswith(b"\x89PNG") and f"plot written to {png}" in printed.out
    assert "%|" not in printed.err  # captured stderr is no terminal: no progress-bar fragments
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "hierarchical", "unbounded"}
    for mode in result["modes"].values():
        assert len(mode["rounds"]) == 2
        for r in mode["rounds"]:
            assert {"mean_ttft_s", "device_hit_rate", "host_hit_rate"} <= set(r)
            assert r["mean_ttft_s"] > 0 and 0 <= r["device_hit_rate"] + r["host_hit_rate"] <= 1
    off, unbounded = result["modes"]["off"], result["modes"]["unbounded"]
    assert all(r["device_hit_rate"] == 0 for r in off["rounds"])
    assert unbounded["rounds"][1]["device_hit_rate"] > 0  # round 2 reuses round 1's conversation
    assert unbounded["device_kv_tokens"] > off["device_kv_tokens"]


def test_host_hit_reports_target_ratio_against_pcie(tmp_path) -> None:
    out = tmp_path / "hit.json"
    args = ["host-hit", *TINY, "--host-hit-prefix", "64", "--host-hit-turn", "8", "--out", str(out)]
    assert bench.main(args) == 0
    hit = json.loads(out.read_text())["host_hit"]
    assert hit["host_hit_tokens"] == 64
    assert hit["pcie_s"] > 0 and hit["target_ratio"] == pytest.approx(
        hit["host_hit_ttft_s"] / max(hit["pcie_s"], hit["device_hit_ttft_s"]))


def test_unknown_mode_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["multiturn", "--modes", "off,warp"])
    assert "unknown mode" in capsys.readouterr().err


def test_multiturn_saves_finished_modes_when_a_later_one_fails(tmp_path, monkeypatch) -> None:
    def only_off(args, spec, mode, progress):  # stands in for a run cut short after its first mode
        if mode != "off":
            raise KeyboardInterrupt
        return {"rounds": [], "mode": mode}

    monkeypatch.setattr(bench, "run_multiturn_mode", only_off)
    out = tmp_path / "partial.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["multiturn", *TINY, "--modes", "off,device", "--out", str(out)])
    assert json.loads(out.read_text())["modes"] == {"off": {"rounds": [], "mode": "off"}}
