"""`python -m benchmarks.kernels`: the write-back
gather part, the HBM read ceiling and the attention-target parts' code paths, at tiny CPU sizes
(the kernels in interpret mode)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks.kernels import attention, cli, memory_ops, reference, timing
from benchmarks.kernels.cases import (
    JAX_PAGED,
    TARGET_PARTS,
    AttnCase,
    KernelConfig,
    inputs,
    resolve,
    target_cases,
)
from benchmarks.kernels.shapes import PAGE

ROOT = Path(__file__).resolve().parent.parent


def test_python_dash_m_runs_the_package_and_lists_its_parts() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert set(cli.PARTS) <= listed
    assert cli.PARTS == ("ceilings", "hbm_read", "matmul", "transfers", "kv_write", "rope_write",
                         "gathers", *TARGET_PARTS)


def test_gathers_time_the_engines_staging_of_the_pages() -> None:
    res: dict = {}
    memory_ops.gathers(res, "tiny", layers=2, kv_heads=2, dim=8, pages=6, pool_pages=32)
    row = res["write_back_gather"]["tiny"]
    assert row["staging_is_the_pages"] is True
    assert row["bytes_read_and_written"] == 2 * 2 * 2 * 6 * PAGE * 2 * 8 * 2
    assert row["xla_gather_ms"] > 0 and row["xla_gather_gbps"] > 0


def test_rope_write_times_the_kernel_and_the_xla_path_per_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_ops, "ROPE_TURNS", ((4, 130), (64, 0)))
    res: dict = {}
    memory_ops.rope_write(res, "tiny", layers=2, kv_heads=2, dim=8, heads=4)
    rows = res["rope_write"]["tiny"]
    assert set(rows) == {"4_after_130", "64_after_0"}
    for row in rows.values():
        assert all(row[f"{path}_us_per_layer"] > 0
                   for path in ("pallas", "xla_rope_write_kv", "xla")), row


# ---------------------------------------------------------------- attention targets
TINY = dict(heads=4, kv_heads=2, dim=16, layers=2)
EXTEND = AttnCase("extend_tiny", "extend", **TINY, batch=2, seq_len=136, query_len=8,
                  target=0.0, start=KernelConfig(block_q=16, block_k=32),
                  stages=((("splits", (None, 2)),),))  # auto is 1 here: both kernels run
DECODE = AttnCase("decode_tiny", "decode", **TINY, batch=3, seq_len=100, query_len=1,
                  target=0.0, start=KernelConfig(block_k=32, splits=2),
                  stages=((("splits", (2, 4)),),), peer=JAX_PAGED)
PREFILL = AttnCase("prefill_tiny", "prefill", **TINY, batch=2, seq_len=24, query_len=24,
                   target=1e9, start=KernelConfig(block_q=16, block_k=16), stages=(),
                   peer="xla")  # cuDNN on the GPU


def test_hbm_read_reports_its_best_pass_and_keeps_each_pass_best_over_measurements() -> None:
    res: dict = {}
    timing.hbm_read(res, mib=1, buffers=2, reps=1, warm=1)
    row = res["hbm_read"]
    first = dict(row["variants_gbps"])
    assert set(first) == {name for name, _ in timing.READS}
    assert all(isinstance(v, float) and v > 0 for v in first.values()), first
    assert res["hbm_read_gbps"] == max(first.values())
    timing.hbm_read(res, mib=1, buffers=2, reps=1, warm=1)
    assert row["passes"] == 2
    assert all(row["variants_gbps"][k] >= v for k, v in first.items())
    assert res["hbm_read_gbps"] == max(row["variants_gbps"].values())


def test_sweep_searches_around_the_best_and_runs_each_resolved_config_once() -> None:
    case = dataclasses.replace(EXTEND, stages=((("splits", (None, 1, 2, 4)),),
                                               (("num_warps", (4, 8)),)))
    seen: list[KernelConfig] = []

    def measure(cfg: KernelConfig) -> float | str:
        seen.append(cfg)
        return "ERROR boom" if cfg.splits == 4 else 1.0 / cfg.splits + cfg.num_warps

    times = attention.sweep(case, measure)
    # auto resolves to splits 1 (timed once); the warps stage adds only w8
    assert len(seen) == len(set(seen)) == 4
    assert all(c.splits is not None for c in seen)
    assert times[case.start] == times[dataclasses.replace(case.start, splits=1)]
    assert times[dataclasses.replace(case.start, splits=4)] == "ERROR boom"
    # the warps stage ran around the best split count (2), not around the start
    assert times[dataclasses.replace(case.start, splits=2, num_warps=8)] == 8.5
    assert attention._best(times) == (dataclasses.replace(case.start, splits=2), 4.5)


def test_target_cases_time_every_config_pass_the_reference_check_and_are_judged() -> None:
    res: dict = {"hbm_read_gbps": 1.0}
    for case in (EXTEND, DECODE, PREFILL):
        attention.attention_case(res, case, reps=1, warm=1)
    attention.judge(res, [EXTEND.name, DECODE.name, PREFILL.name])
    rows = res["attention_targets"]
    assert rows[EXTEND.name]["auto_splits"] == 1
    assert list(rows[EXTEND.name]["sweep_per_layer_ms"]) == ["bq16_bk32_splitsauto_w4_s2",
                                                              "bq16_bk32_splits2_w4_s2"]
    for case in (EXTEND, DECODE, PREFILL):
        row = rows[case.name]
        # a failing config is recorded as an "ERROR ..." string: none may fail here
        assert all(isinstance(t, float) and t > 0 for t in row["sweep_per_layer_ms"].values()), row
        check = row["reference_check"]
        assert isinstance(check, dict), check
        assert check["within_tolerance"] and check["max_abs_err"] < reference.TOL, check
        assert row["bytes"] == 2 * case.batch * case.seq_len * 2 * 16 * 2
        assert row["fraction_of_hbm_read"] == row["gbps"]  # the ceiling is 1 GB/s
        assert row["met"] is True  # targets 0 (fraction) and 1e9 (ratio): the check decides
        summary = res["attention_summary"][case.name]
        assert {"per_layer_ms", "bytes", "fraction_of_hbm_read", "target", "met"} <= set(summary)
        assert list(row)[:len(summary)] == list(summary)  # the summary fields lead each row
    for case in (DECODE, PREFILL):  # decode's peer is JAX's Pallas paged kernel, for comparison
        assert isinstance(rows[case.name]["peer_per_layer_ms"], float), rows[case.name]
        assert rows[case.name]["ours_over_peer"] > 0
    assert rows[DECODE.name]["peer"].startswith("jax.experimental.pallas.ops.gpu.paged_attention")
    assert rows[DECODE.name]["target"]["metric"] == "fraction_of_hbm_read"
    assert "peer" not in rows[EXTEND.name]
    for case in (EXTEND, DECODE):  # a plain read of one layer's bytes, on the attention's clock
        read = rows[case.name]["layer_read"]
        assert read["layers"] == case.layers and 0 <= case.kv_bytes - read["bytes"] < 2048
        # bytes per microsecond / 1e3 is GB/s, here against a 1 GB/s ceiling
        assert read["wall_fraction"] == pytest.approx(read["bytes"] / (read["wall_us"] * 1e3))
        assert ("device_us" in read) == (jax.default_backend() == "gpu")
    assert "layer_read" not in rows[PREFILL.name]
    assert all(rows[c.name]["ranked_by"] == "wall clock" for c in (EXTEND, DECODE, PREFILL))


def test_judge_adds_the_device_clocks_fractions_where_the_run_traced_them() -> None:
    row = {"bytes": 8000, "gbps": 2.0, "target": {"metric": "fraction_of_hbm_read",
                                                 "at_least": 0.5},
           "device_time": {"per_layer_us": 2.0},
           "layer_read": {"bytes": 4000, "wall_us": 4.0, "device_us": 1.0}}
    res = {"attention_targets": {"x": row}}
    attention.judge(res, ["x"])
    row = res["attention_targets"]["x"]
    assert row["fraction_of_hbm_read"] is None  # no ceiling in this run: nothing judged
    res["hbm_read_gbps"] = 4.0
    attention.judge(res, ["x"])
    row = res["attention_targets"]["x"]
    assert row["fraction_of_hbm_read"] == 0.5
    # 8000 B in 2 us is 4 GB/s: all of a 4 GB/s ceiling; 4000 B in 4 us, a quarter of it
    assert row["device_fraction_of_hbm_read"] == pytest.approx(1.0)
    assert row["layer_read"]["wall_fraction"] == pytest.approx(0.25)
    assert row["layer_read"]["device_fraction"] == pytest.approx(1.0)


def test_device_time_traces_one_call_of_the_best_configs_program() -> None:
    """The traced call runs and sums the GPU's kernels per layer; the CPU's trace has no GPU
    kernels, so nothing is counted there (`attention_case` asks for it only on a GPU)."""
    data = inputs(EXTEND)
    program = jax.jit(attention._over_layers(attention.kernel(EXTEND, EXTEND.start)))
    got = attention._device_time(EXTEND, program, (data.q, data.ks, data.vs, data.news,
                                                   *data.meta))
    if jax.default_backend() == "gpu":
        assert got["per_layer_us"] > 0 and got["kernels_per_layer"] >= 1 and got["by_name"]
    else:
        assert got == {"per_layer_us": 0.0, "kernels_per_layer": 0.0, "by_name": []}


def test_on_a_gpu_the_device_clock_ranks_the_configs_and_the_row_keeps_the_wall_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each config's kernels on the device's clock rank it (here each traced config reads
    faster than the one before, whatever its wall time); the row's time is the best's wall
    time, and every config's device time is kept beside the wall times."""
    traced: list[int] = []

    def device_time(case: AttnCase, program: object, args: tuple) -> dict:
        traced.append(len(traced))
        return {"per_layer_us": 100.0 - len(traced), "kernels_per_layer": 1.0, "by_name": []}

    walls: list[int] = []

    def wall(step: object, reps: int, warm: int) -> float:  # each config slower than the last
        walls.append(len(walls))
        return float(len(walls))

    monkeypatch.setattr(attention, "on_gpu", lambda: True)
    monkeypatch.setattr(attention, "_device_time", device_time)
    monkeypatch.setattr(attention, "timeit", wall)
    monkeypatch.setattr(attention, "layer_read", lambda *a: {"bytes": 1, "wall_us": 1.0})
    case = dataclasses.replace(EXTEND, stages=((("splits", (None, 2)),),
                                               (("num_warps", (4, 8)),)))
    res: dict = {"hbm_read_gbps": 1.0}
    row = attention.attention_case(res, case, reps=1, warm=1)
    device = row["sweep_device_us"]
    assert row["ranked_by"] == "device clock" and set(device) == set(row["sweep_per_layer_ms"])
    assert len(traced) == 3 + 1  # three resolved configs, then the best's breakdown
    assert row["best"] == min(device, key=device.get) != case.start.label()
    # the best's wall time, though the start's wall clock read faster
    assert row["per_layer_ms"] == row["sweep_per_layer_ms"][row["best"]] == 3 / case.layers * 1e3
    assert row["sweep_per_layer_ms"][case.start.label()] < row["per_layer_ms"]
    assert row["device_time"]["per_layer_us"] == 96.0


def test_on_a_gpu_a_trace_without_kernels_ranks_no_config(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A trace that holds no GPU kernel (device time 0) is an error, not the fastest config:
    with every config's so, the case fails and names the error."""
    monkeypatch.setattr(attention, "on_gpu", lambda: True)
    monkeypatch.setattr(attention, "_device_time", lambda *a: {"per_layer_us": 0.0})
    res: dict = {"hbm_read_gbps": 1.0}
    with pytest.raises(RuntimeError, match="every config failed, first: ERROR the trace held"):
        attention.attention_case(res, EXTEND, reps=1, warm=1)
    sweep = res["attention_targets"][EXTEND.name]["sweep_device_us"]
    assert all(v == "ERROR the trace held no GPU kernel" for v in sweep.values())


def test_the_reference_check_catches_a_wrong_output(monkeypatch: pytest.MonkeyPatch) -> None:
    data = inputs(DECODE)
    assert reference.reference_check(DECODE, data, DECODE.start)["within_tolerance"]
    right = reference.kernel
    monkeypatch.setattr(reference, "kernel",
                        lambda case, cfg: lambda q, *rest: right(case, cfg)(q * 2, *rest))
    assert not reference.reference_check(DECODE, data, DECODE.start)["within_tolerance"]


@pytest.mark.parametrize("case", [EXTEND, DECODE, PREFILL], ids=lambda c: c.kind)
def test_the_reference_check_in_small_chunks_still_passes(case: AttnCase,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 rows (tokens of a request; decode: requests): each chunk's positions and key
    bound must be the chunk's own, or the causal mask would differ from the kernel's."""
    per_row = 3 * case.pages_per_request * PAGE * case.heads * case.dim * 4
    monkeypatch.setattr(reference, "REF_BYTES", 2 * per_row + 1)
    check = reference.reference_check(case, inputs(case), resolve(case, case.start))
    assert check["rows_per_reference_call"] == (1 if case is DECODE else 2)  # 3 requests: 1
    assert check["within_tolerance"], check


def test_main_runs_the_target_parts_between_two_pairs_of_ceilings(tmp_path,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    read, matmul = timing.hbm_read, timing.matmul_ceiling
    monkeypatch.setattr(attention, "hbm_read",
                        lambda res: read(res, mib=1, buffers=2, reps=1, warm=1))
    monkeypatch.setattr(attention, "matmul_ceiling",
                        lambda res: matmul(res, n=64, count=2, reps=1, warm=1))
    monkeypatch.setattr(attention, "target_cases", lambda: {"extend_long": (EXTEND,),
                                                            "decode_long": (DECODE,),
                                                            "prefill": (PREFILL,)})
    out = tmp_path / "k.json"
    res = cli.main(["--only", "extend_long,prefill", "--out", str(out)])
    assert "errors" not in res, res["errors"]
    assert res["hbm_read"]["passes"] == res["matmul_passes"] == 2
    assert set(res["attention_summary"]) == {EXTEND.name, PREFILL.name}
    floor = res["attention_targets"][EXTEND.name]["floor"]  # both ceilings reached the judge
    assert set(floor) == {"matmul_us", "hbm_read_us"}  # a target of 0 asks for no time
    assert all(row["met"] is not None for row in res["attention_summary"].values())
    assert out.read_text().startswith("{")
    rows = res["page_rows"]  # the run's own page rows, judged against each case's target
    assert set(rows) == {f"attention_{EXTEND.name}", f"attention_{PREFILL.name}"}
    assert rows[f"attention_{EXTEND.name}"]["target"] == f">= {EXTEND.target:.2f}"
    assert rows[f"attention_{PREFILL.name}"]["ceiling"].startswith("cuDNN ")
    assert all(row["met"] in ("yes", "no") for row in rows.values())
    for unknown in ("extend_lng", "extend", "decode"):  # the per-call parts were deleted
        with pytest.raises(SystemExit):
            cli.main(["--only", unknown])


def test_a_case_whose_every_config_fails_raises_and_is_not_met() -> None:
    res: dict = {"hbm_read_gbps": 1.0}
    case = dataclasses.replace(DECODE, start=KernelConfig(block_k=32, splits=0), stages=())
    with pytest.raises(RuntimeError, match="every config failed"):
        attention.attention_case(res, case, reps=1, warm=1)
    attention.judge(res, [case.name])
    row = res["attention_targets"][case.name]
    assert row["sweep_per_layer_ms"]["bk32_splits0_w4_s2"].startswith("ERROR")
    assert row["met"] is None


def test_matmul_ceiling_reports_flops_per_second_and_keeps_its_best() -> None:
    res: dict = {}
    timing.matmul_ceiling(res, n=64, count=2, reps=1, warm=1)
    first = res["matmul_tflops"]
    assert isinstance(first, float) and first > 0 and res["matmul_passes"] == 1
    timing.matmul_ceiling(res, n=64, count=2, reps=1, warm=1)
    assert res["matmul_passes"] == 2 and res["matmul_tflops"] >= first
    assert "[64, 64]" in res["matmul_note"]


def test_a_case_counts_the_flops_of_every_key_each_new_token_sees() -> None:
    # extend: 8 new tokens over 128 cached; each sees the prefix and the new tokens up to itself
    pairs = 8 * 128 + (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8)
    assert EXTEND.flops == 4 * EXTEND.batch * EXTEND.heads * EXTEND.dim * pairs
    assert DECODE.flops == 4 * DECODE.batch * DECODE.heads * DECODE.dim * DECODE.seq_len
    assert PREFILL.flops == 4 * PREFILL.batch * PREFILL.heads * PREFILL.dim * (24 * 25 // 2)
    ext = target_cases()["extend_long"][0]  # 7B: about 450 FLOPs a byte of K and V
    assert 440 < ext.flops / ext.kv_bytes < 450


def test_judge_sets_the_rows_floors_against_both_ceilings() -> None:
    row = {"bytes": 8000, "gbps": 2.0, "per_layer_ms": 4e-3, "flops": 40_000_000,
           "target": {"metric": "fraction_of_hbm_read", "at_least": 0.5},
           "device_time": {"per_layer_us": 2.0}}
    res = {"attention_targets": {"x": row}, "hbm_read_gbps": 4.0, "matmul_tflops": 10.0}
    attention.judge(res, ["x"])
    row = res["attention_targets"]["x"]
    # 40 MFLOP at 10 TFLOP/s take 4 us: all of the ceiling in 4 us of wall clock, half of it
    # would be 8 us; the device's 2 us is twice the ceiling (a wrong ceiling would show so)
    assert row["fraction_of_matmul"] == pytest.approx(1.0)
    assert row["device_fraction_of_matmul"] == pytest.approx(2.0)
    # the bytes at 4 GB/s take 2 us; a target of half the rate gives 4 us: all of the 4 us
    # the FLOPs need at the matmul ceiling
    assert row["floor"] == pytest.approx({"matmul_us": 4.0, "hbm_read_us": 2.0,
                                          "target_needs_fraction_of_matmul": 1.0})
    assert res["attention_summary"]["x"]["fraction_of_matmul"] == pytest.approx(1.0)
    del res["matmul_tflops"], row["floor"], row["fraction_of_matmul"]
    attention.judge(res, ["x"])  # no matmul ceiling in this run: no compute fractions
    assert "floor" not in res["attention_targets"]["x"]


def test_the_target_parts_cases_derive_from_the_model_shapes() -> None:
    cases = target_cases()
    assert set(cases) == set(TARGET_PARTS) <= set(cli.PARTS)
    ext = cases["extend_long"][0]
    assert (ext.layers, ext.seq_len, ext.query_len) == (28, 8256, 64)
    assert ext.kv_bytes == 8256 * 4 * 128 * 2 * 2
    assert [c.layers for c in cases["extend_long"]] == [28, 24]
    assert {(c.batch, c.seq_len) for c in cases["decode_long"]} == {(32, 4096), (8, 32768)}
    assert all(c.peer == "cudnn" for c in cases["prefill"])
    assert all(c.peer == JAX_PAGED for c in cases["decode_long"])
    for bad in (dict(query_len=2), dict(peer="cudnn")):
        with pytest.raises(ValueError):
            dataclasses.replace(DECODE, **bad)
    with pytest.raises(ValueError):
        dataclasses.replace(PREFILL, peer=JAX_PAGED)
    with pytest.raises(ValueError):
        dataclasses.replace(EXTEND, peer="cudnn")


def test_dispatch_us_makes_a_warm_up_call_and_then_reps_timed_ones() -> None:
    import jax.numpy as jnp

    calls: list[int] = []

    def step() -> object:
        calls.append(len(calls))
        return jnp.ones(4) * len(calls)

    us = timing.dispatch_us(step, reps=5)
    assert len(calls) == 6 and 0 < us < 1e6
