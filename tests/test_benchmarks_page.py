"""BENCHMARKS.md is what scripts/benchmarks_page.py renders from its manifest and the page rows
the benches wrote into their result files (benchmarks/rows.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import fleet, host_hit, restart, rows, scoring, serve_overhead, storage_hit
from tests.scripts import load_script

bp = load_script("scripts/benchmarks_page.py")


def test_page_is_what_the_generator_writes():
    page, manifest_rows = bp.load_manifest()
    assert bp.PAGE.read_text() == bp.render(page, manifest_rows), (
        "BENCHMARKS.md is out of date: run python scripts/benchmarks_page.py")
    assert bp.check()
    assert bp.main(["--check"]) == 0


def _trial(ttft_ms: float, device_ms: float) -> dict:
    return {"host_hit_ttft_s": ttft_ms / 1e3, "device_hit_ttft_s": device_ms / 1e3,
            "host_hit_ratio": ttft_ms / device_ms, "pcie_s": 0.009, "pcie_gbps": 50.0}


def test_host_hit_takes_the_median_ratio_trial_and_the_range_over_all():
    trials = [_trial(13.0, 10.0), _trial(11.0, 10.0), _trial(12.0, 10.0)]  # ratios 1.3, 1.1, 1.2
    data = {"host_hit": {"trials": trials}}
    fig = rows.host_hit([data], {})
    assert fig.result == "12.0 ms (11.0-13.0), 1.20 (1.10-1.30)"
    assert fig.ceiling == "PCIe copy 9.00 ms (50.0 GB/s); prefix on device 10.0 ms (10.0)"
    # the bench's own pick, where it records one, wins
    data["host_hit"]["median_trial"] = 0
    assert rows.host_hit([data], {}).result.startswith("13.0 ms (11.0-13.0), 1.30")
    rule = rows.Rule(metric="ratio", name="ratio", at_most=1.15)
    assert rows.verdict([rule], fig.checks, "trials") == "partly (in 1 of 3 trials)"
    assert rows.verdict([rows.Rule("ratio", "ratio", at_most=2)], fig.checks, "trials") == "yes"
    assert rows.verdict([rows.Rule("ratio", "ratio", at_most=1)], fig.checks, "trials") == "no"


def test_a_bench_writes_its_row_beside_its_result():
    data = {"host_hit": {"trials": [_trial(13.0, 10.0), _trial(11.0, 10.0)]}}
    target = rows.Target("1.2", (rows.Rule("ratio", "ratio", at_most=1.2),))
    written = rows.add_row(data, "host_hit", target)
    assert written["host_hit"] == data["host_hit"] and "page_rows" not in data
    assert written["page_rows"]["host_hit"] == {
        "kind": "host_hit", "result": "11.0 ms (11.0-13.0), 1.10 (1.10-1.30)",
        "ceiling": "PCIe copy 9.00 ms (50.0 GB/s); prefix on device 10.0 ms (10.0)",
        "target": "1.2", "met": "partly (in 1 of 2 trials)"}
    verdict = rows.Target("-", met="- (a comparison)")
    assert rows.add_row(data, "host_hit", verdict)["page_rows"]["host_hit"]["met"] == (
        "- (a comparison)")


def _manifest(tmp_path: Path, file: str, date: str = "2026-12-03") -> Path:
    path = tmp_path / "page.toml"
    path.write_text(f"""
[page]
intro = "# B"
table_intro = "t"
how = "h"
limits = "l"
groups = {{ A = "A" }}

[[row]]
group = "A"
label = "a host hit"
file = "{file}"
row = "host_hit"
command = "`bench`"
date = "{date}"
commit = "abc1234"
""")
    return path


def test_a_row_naming_a_missing_file_raises_a_clear_error(tmp_path):
    page, manifest_rows = bp.load_manifest(_manifest(tmp_path, "nope.json"))
    with pytest.raises(bp.ManifestError, match=r"'a host hit': result file .*nope.json does not"):
        bp.render(page, manifest_rows, tmp_path)


def test_a_result_file_dated_otherwise_than_its_row_raises(tmp_path):
    data = {"date": "2026-12-01", "host_hit": {"trials": [_trial(11.0, 10.0)]}}
    target = rows.Target("1.1", (rows.Rule("ratio", "ratio", at_most=1.1),))
    (tmp_path / "hit.json").write_text(json.dumps(rows.add_row(data, "host_hit", target)))
    page, manifest_rows = bp.load_manifest(_manifest(tmp_path, "hit.json"))
    with pytest.raises(bp.ManifestError, match="records the date 2026-12-01, the manifest"):
        bp.render(page, manifest_rows, tmp_path)
    page, manifest_rows = bp.load_manifest(_manifest(tmp_path, "hit.json", date="2026-12-01"))
    assert ("| a host hit | `bench` | 2026-12-01 | abc1234 | 11.0 ms (11.0), 1.10 (1.10) | "
            "PCIe copy 9.00 ms (50.0 GB/s); prefix on device 10.0 ms (10.0) | 1.1 | yes |") in (
        bp.render(page, manifest_rows, tmp_path))


def test_a_result_file_without_the_named_row_raises(tmp_path):
    (tmp_path / "hit.json").write_text(json.dumps({"date": "2026-12-03", "host_hit": {}}))
    page, manifest_rows = bp.load_manifest(_manifest(tmp_path, "hit.json"))
    with pytest.raises(bp.ManifestError, match="hit.json has no page row 'host_hit'"):
        bp.render(page, manifest_rows, tmp_path)


def test_citations_expand_braces_and_globs():
    assert bp.cited_patterns(["`results/a_{7b,0.5b}_h200.json` and `..._x.json`, `p_*`"]) == {
        "a_7b_h200.json", "a_0.5b_h200.json", "*_x.json", "p_*"}


def test_scoring_checks_the_end_to_end_ratio_where_the_run_has_it():
    def run(e2e: bool) -> dict:
        trials = [{"scored_over_prefill": r, "compiles": 0} for r in (1.05, 1.08)]
        result = {"trials": trials, "scored_ttft_s": 0.216, "prefill_ttft_s": 0.2,
                  "scored_over_prefill": 1.08}
        if e2e:
            for t, r in zip(trials, (1.09, 1.12)):
                t["scored_over_prefill_e2e"] = r
            result |= {"scored_e2e_s": 0.224, "prefill_e2e_s": 0.2,
                       "scored_over_prefill_e2e": 1.12}
        return {"scoring": result}

    before = rows.scoring([run(False)], {})
    assert before.checks == {"ratio": [1.05, 1.08]} and "end to end" not in before.result
    after = rows.scoring([run(True)], {})
    assert after.checks == {"ratio": [1.05, 1.08], "e2e_ratio": [1.09, 1.12]}
    assert "end to end 224.0 against 200.0 ms: 1.120x (1.090-1.120)" in after.result
    served = run(True)
    served["scoring"]["http"] = {"trials": [{"scored_over_prefill": r, "compiles": c}
                                            for r, c in ((1.11, 0), (1.07, 1))],
                                 "scored_e2e_s": 0.2321, "prefill_e2e_s": 0.21,
                                 "scored_over_prefill": 1.07}
    http = rows.scoring([served], {})
    assert http.checks["http_ratio"] == [1.11, 1.07]
    assert "through the server 232.1 against 210.0 ms: 1.070x (1.070-1.110)" in http.result
    assert http.result.endswith("2 pairs in process and 2 through the server, 1 compile")


# The single-run benches, by the kind of row they write: the module and its result's key.
BENCHES = {"host_hit": (host_hit, "host_hit"), "storage_hit": (storage_hit, "storage_hit"),
           "scoring": (scoring, "scoring"), "restart": (restart, "restart"),
           "serve_paths": (serve_overhead, "serve_overhead"), "fleet": (fleet, "fleet")}


def test_each_bench_writes_the_row_the_page_shows_for_its_own_run():
    """Every committed row of a single-run bench is what that bench writes for that run today:
    the page's targets are the benches' own."""
    checked = 0
    for path in sorted(bp.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        for name, row in (data.get("page_rows", {}) if isinstance(data, dict) else {}).items():
            if row["kind"] not in BENCHES or "files" in row:
                continue
            module, key = BENCHES[row["kind"]]
            args = argparse.Namespace(preset=data["preset"], weights=None,
                                      storage_hit_prefix=data[key].get("prefix_tokens"),
                                      storage_backend=data[key].get("storage_backend", "file"))
            kind, target = module.page_row(args, data[key])
            assert rows.page_row(kind, [data], {}, target) == row, (path.name, name)
            checked += 1
    assert checked == 19


def test_the_command_line_writes_a_comparison_row_as_the_page_shows_it(tmp_path):
    """`python -m benchmarks.rows` writes a row that reads other runs (here a baseline) into the
    row's result file: the page's row of the 7B multi-turn run against its baseline, again."""
    run = "multiturn_qwen2-7b_h200_timing_shapes_alone.json"
    base = "multiturn_qwen2-7b_h200_ab582b2.json"
    for name in (run, base):
        (tmp_path / name).write_text((bp.RESULTS / name).read_text())
    assert rows.main([str(tmp_path / run), "again", "multiturn", "--with", str(tmp_path / base),
                      "--target", ">= 95% of {baseline_tok_s} (ab582b2)",
                      "--rule", "over_baseline:at_least:0.95"]) == 0
    written = json.loads((tmp_path / run).read_text())["page_rows"]
    assert written["again"] == written["multiturn"]
    assert rows.parse_rule("ratio:at_most:1.1:TTFT") == rows.Rule("ratio", "TTFT", at_most=1.1)
    with pytest.raises(argparse.ArgumentTypeError):
        rows.parse_rule("ratio:below:1")


def test_an_attention_row_shows_the_device_clock_and_a_layer_read_where_the_run_has_them():
    case = {"sweep_per_layer_ms": {"bq128_bk64_splitsauto_w4_s2": 0.026}, "per_layer_ms": 0.026,
            "best": "bq128_bk64_splitsauto_w4_s2", "fraction_of_hbm_read": 0.059,
            "bytes": 4_227_072}
    data = {"hbm_read_gbps": 2731.0, "attention_targets": {"x": case}}
    fig = rows.attention([data], {"case": "x"})
    assert (fig.result, fig.ceiling) == ("26.0 us; 0.059", "HBM read 2731 GB/s")
    case.update(device_time={"per_layer_us": 16.4}, device_fraction_of_hbm_read=0.094,
                layer_read={"wall_fraction": 0.098, "device_fraction": 0.49})
    fig = rows.attention([data], {"case": "x"})
    assert fig.result == "26.0 us; 0.059; device clock 16.4 us, 0.094"
    assert fig.ceiling == ("HBM read 2731 GB/s; a layer's bytes read alone 0.10 "
                           "(device clock 0.49)")
    assert fig.checks == {"fraction": [0.059]}  # the target is judged on the wall clock
    data["matmul_tflops"] = 700.0  # a run with the matmul ceiling: what the target asks of it
    case.update(device_fraction_of_matmul=0.16,
                floor={"matmul_us": 2.69, "hbm_read_us": 1.55,
                       "target_needs_fraction_of_matmul": 0.69})
    fig = rows.attention([data], {"case": "x"})
    assert fig.result == "26.0 us; 0.059; device clock 16.4 us, 0.094 (0.16 of matmul)"
    assert fig.ceiling.endswith("; matmul 700 TFLOP/s: the layer's FLOPs 2.7 us, the target "
                                "asks for 0.69 of it")
