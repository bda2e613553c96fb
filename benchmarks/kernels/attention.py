"""The attention target parts: sweep, per-layer time against peers, judging against the ceiling."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
from jhicache.pallas_kernels.backend import use_interpreter

from benchmarks.kernels.cases import (
    JAX_PAGED,
    AttnCase,
    KernelConfig,
    apart,
    inputs,
    kernel,
    page_table,
    resolve,
    target_cases,
)
from benchmarks.kernels.reference import reference_check
from benchmarks.kernels.shapes import PAGE, random_array
from benchmarks.kernels.timing import (
    GB,
    hbm_read,
    kernel_times,
    layer_read,
    matmul_ceiling,
    on_gpu,
    per_layer_seconds,
    safe,
    timeit,
)

# Each target case times its kernel in one dispatch: one jitted program runs it over L layers, and
# the host clock around the whole program, over L, is the per-layer time. Dispatch and sync (tens
# of microseconds) then count once per L layers, not once per 10-100 us kernel as when a single
# call is timed.
TIMING_NOTE = ("per-layer time from one program running the kernel over L layers: distinct K/V "
               "buffers per layer (so L2 serves no repeats), each layer's query the previous "
               "layer's output; median of reps after warm-up, blocked on around the whole "
               "program, divided by L. It includes the ops around the kernel (extend's split-K "
               "merge kernel, decode's XLA merge), which the model pays too")
SUMMARY_KEYS = ("per_layer_ms", "bytes", "fraction_of_hbm_read", "fraction_of_matmul",
                "ours_over_peer", "target", "met")


def _over_layers(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A program running `kernel` once per layer; each layer's query is the previous layer's
    output, as in the model, so XLA can neither drop nor merge a layer's call."""
    def program(q: jax.Array, ks: tuple, vs: tuple, news: tuple, *meta: jax.Array) -> jax.Array:
        for k, v, new in zip(ks, vs, news, strict=True):
            q = kernel(q, k, v, new, *meta)
        return q
    return program


def _best(times: dict[KernelConfig, float | str]) -> tuple[KernelConfig | None, float | None]:
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok, key=lambda c: ok[c], default=None)
    return best, None if best is None else ok[best]


def sweep(case: AttnCase, measure: Callable[[KernelConfig], float | str]
          ) -> dict[KernelConfig, float | str]:
    """Every config tried -> its measure (seconds, or an error string). Coordinate search: start,
    then each stage's product around the best so far; configs equal once resolved run once."""
    times: dict[KernelConfig, float | str] = {}
    by_resolved: dict[KernelConfig, float | str] = {}

    def run(cfg: KernelConfig) -> None:
        key = resolve(case, cfg)
        if key not in by_resolved:
            by_resolved[key] = measure(key)
        times[cfg] = by_resolved[key]

    run(case.start)
    for stage in case.stages:
        around = _best(times)[0] or case.start
        names = [name for name, _ in stage]
        for values in itertools.product(*(vals for _, vals in stage)):
            fields: dict[str, Any] = dict(zip(names, values, strict=True))  # ints, or None
            run(dataclasses.replace(around, **fields))
    return times


def _jax_paged_splits(case: AttnCase) -> int:
    """JAX's paged decode kernel's k_splits: its default 16, or the largest power of two below it
    that divides the pages per request (it needs a divisor)."""
    return math.gcd(16, case.pages_per_request)


def peer_label(case: AttnCase) -> str:
    """The peer's call as the result JSON names it."""
    if case.peer == JAX_PAGED:
        return ("jax.experimental.pallas.ops.gpu.paged_attention(block_h=16, "
                f"pages_per_compute_block=8, k_splits={_jax_paged_splits(case)})")
    return f"jax.nn.dot_product_attention(is_causal=True, implementation={case.peer!r})"


def peer_seconds(case: AttnCase, reps: int = 7, warm: int = 2) -> float:
    """Per-layer time of the case's peer, timed as the kernel is (one program over the layers,
    distinct K/V per layer): decode's is JAX's Pallas paged decode kernel on the same page table
    (its pools laid out [kv_heads, pages, PAGE, dim]), prefill's jax.nn.dot_product_attention
    (causal, implementation=case.peer) on dense K/V."""
    q = random_array(9, (case.batch * case.query_len, case.heads, case.dim))
    if case.peer == JAX_PAGED:
        table = page_table(case)
        shape: tuple[int, ...] = (case.kv_heads, table.size, PAGE, case.dim)
        attn = functools.partial(jax_paged.paged_attention, k_splits=_jax_paged_splits(case),
                                 interpret=use_interpreter())
        meta: tuple[jax.Array, ...] = (table, jnp.full((case.batch,), case.seq_len, jnp.int32))
    else:
        q = q.reshape(case.batch, case.query_len, case.heads, case.dim)
        shape = (case.batch, case.seq_len, case.kv_heads, case.dim)
        attn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                 scale=case.dim**-0.5, implementation=case.peer)
        meta = ()
    ks = tuple(random_array(500 + 2 * i, shape) for i in range(case.layers))
    vs = tuple(random_array(501 + 2 * i, shape) for i in range(case.layers))
    return per_layer_seconds(_over_layers(lambda q, k, v, _new, *meta: attn(q, k, v, *meta)),
                             (q, ks, vs, (None,) * case.layers, *meta), case.layers, reps, warm)


def attention_case(res: dict, case: AttnCase, reps: int = 7, warm: int = 2) -> dict:
    """Sweeps the case's kernel configs (ranked by the wall clock, on a GPU by the kernels' device
    time), checks the best against the reference, times the peer
    (prefill: its target's measure; decode: for comparison) and stores the row under
    res["attention_targets"][case.name]; `judge` adds the fraction of the HBM read ceiling and
    whether the target is met."""
    data = inputs(case)
    args = (data.q, data.ks, data.vs, data.news, *data.meta)
    programs: dict[KernelConfig, Callable[..., jax.Array]] = {}
    walls: dict[KernelConfig, float | str] = {}

    def measure(cfg: KernelConfig) -> float | str:
        """The config's wall time per layer; on a GPU its kernels' device time per layer ranks
        it instead (launch gaps on the wall clock vary more between calls than the kernels)."""
        programs[cfg] = program = jax.jit(_over_layers(kernel(case, cfg)))
        walls[cfg] = wall = safe(lambda: timeit(lambda: program(*args), reps, warm) / case.layers)
        if not isinstance(wall, float) or not on_gpu():
            return wall
        device = safe(lambda: _device_time(case, program, args)["per_layer_us"])
        if isinstance(device, float) and device <= 0:  # a trace without the GPU's kernels
            return "ERROR the trace held no GPU kernel"
        return device * 1e-6 if isinstance(device, float) else device

    ranks = sweep(case, measure)
    times = {cfg: walls[resolve(case, cfg)] for cfg in ranks}
    public = "pk.paged_decode_attention" if case.kind == "decode" else "pk.paged_attention"
    row = {"kernel": public, "heads": case.heads, "kv_heads": case.kv_heads, "dim": case.dim,
           "layers": case.layers, "batch": case.batch, "seq_len": case.seq_len,
           "query_len": case.query_len, "bytes": case.kv_bytes,
           "bytes_note": "K+V of every request's seq_len tokens, bf16, per layer",
           "flops": case.flops, "flops_note": "QK and PV of every query head, per layer",
           "timing": TIMING_NOTE,
           "sweep_per_layer_ms": {c.label(): t * 1e3 if isinstance(t, float) else t
                                  for c, t in times.items()},
           "ranked_by": "device clock" if on_gpu() else "wall clock"}
    if on_gpu():  # what ranked the configs: each one's kernels per layer on the device's clock
        row["sweep_device_us"] = {c.label(): t * 1e6 if isinstance(t, float) else t
                                  for c, t in ranks.items()}
    if case.kind != "decode":
        row["auto_splits"] = resolve(case, case.start).splits
        row["new_tokens_apart"] = apart(case)  # their causal part on cuDNN, as the model runs it
    row["target"] = ({"metric": "ours_over_peer", "at_most": case.target} if case.kind == "prefill"
                     else {"metric": "fraction_of_hbm_read", "at_least": case.target})
    res.setdefault("attention_targets", {})[case.name] = row
    best, _rank = _best(ranks)
    seconds = None if best is None else times[best]
    if best is None or not isinstance(seconds, float):  # a ranked config's wall time is a float
        raise RuntimeError(f"{case.name}: every config failed, first: {next(iter(ranks.values()))}")
    row.update(best=best.label(), best_config=dataclasses.asdict(resolve(case, best)),
               per_layer_ms=seconds * 1e3, gbps=case.kv_bytes / seconds / GB)
    if on_gpu():  # the best config's kernels on the device's own clock
        row["device_time"] = safe(lambda: _device_time(case, programs[resolve(case, best)],
                                                       args))
    if case.kind != "prefill":  # what a plain read of the layer's bytes reaches, on both clocks
        row["layer_read"] = safe(lambda: layer_read(case.kv_bytes, case.layers, reps, warm))
    row["reference_check"] = safe(lambda: reference_check(case, data, resolve(case, best)))
    if case.peer is not None:
        row["peer"] = peer_label(case)
        peer = safe(lambda: peer_seconds(case, reps, warm))
        row["peer_per_layer_ms"] = peer * 1e3 if isinstance(peer, float) else peer
        if isinstance(peer, float):
            row["ours_over_peer"] = seconds / peer
    return row


def _device_time(case: AttnCase, program: Callable[..., jax.Array], args: tuple) -> dict:
    """One traced call of the case's compiled `program`: its kernels' GPU time over the layers
    (the per-layer wall time also holds launches and any gap between kernels)."""
    jax.block_until_ready(program(*args))  # compiled before the trace
    trace = kernel_times(lambda: program(*args))
    return {"per_layer_us": trace["sum_us"] / case.layers,
            "kernels_per_layer": trace["kernels"] / case.layers,
            "by_name": [{**r, "us_per_layer": r["us"] / case.layers}
                        for r in trace["by_name"][:6]]}


def _met(row: dict) -> bool | None:
    """The row's target metric within its bound and its reference check passed; None: no metric
    (no ceiling in this run, or the peer or every config failed)."""
    target, value = row["target"], row.get(row["target"]["metric"])
    if value is None:
        return None
    check = row.get("reference_check")
    correct = isinstance(check, dict) and check["within_tolerance"]
    fast = value >= target["at_least"] if "at_least" in target else value <= target["at_most"]
    return bool(fast and correct)


def _device_fractions(row: dict, ceiling: object) -> None:
    """Fractions of the ceiling on the device's clock (the kernels' own time), beside the wall
    clock's: the row's best config, and the plain read of a layer's bytes on both clocks."""
    if not isinstance(ceiling, float):
        return
    device = row.get("device_time")
    if isinstance(device, dict) and device["per_layer_us"] > 0:
        row["device_fraction_of_hbm_read"] = row["bytes"] / device["per_layer_us"] / 1e3 / ceiling
    read = row.get("layer_read")
    if isinstance(read, dict):
        for clock in ("wall", "device"):
            if read.get(f"{clock}_us"):
                read[f"{clock}_fraction"] = read["bytes"] / read[f"{clock}_us"] / 1e3 / ceiling


def _compute_fractions(row: dict, tflops: object, hbm: object) -> None:
    """Against this run's matmul ceiling: the fraction of it the row's FLOPs reach (wall clock;
    device clock where traced), and the layer's floors: its FLOPs at that ceiling, its bytes at
    the HBM read ceiling and, for a fraction-of-HBM target, the fraction of the matmul ceiling
    the target's time asks for (above 1: the target is past what the GPU can compute)."""
    if not isinstance(tflops, float) or "flops" not in row:
        return
    rate = tflops * 1e12  # FLOP/s
    row["fraction_of_matmul"] = row["flops"] / (row["per_layer_ms"] * 1e-3) / rate
    device = row.get("device_time")
    if isinstance(device, dict) and device["per_layer_us"] > 0:
        row["device_fraction_of_matmul"] = row["flops"] / (device["per_layer_us"] * 1e-6) / rate
    floor = {"matmul_us": row["flops"] / rate * 1e6}
    if isinstance(hbm, float):
        floor["hbm_read_us"] = row["bytes"] / hbm / 1e3
        if row["target"].get("at_least", 0) > 0:
            target_us = floor["hbm_read_us"] / row["target"]["at_least"]
            floor["target_needs_fraction_of_matmul"] = floor["matmul_us"] / target_us
    row["floor"] = floor


def judge(res: dict, names: list[str]) -> None:
    """For the named rows of this run: fraction of this run's hbm_read_gbps (and of its
    matmul_tflops, where measured) and `met` (the target met and the reference check passed;
    None: not judged, for want of the ceiling or the peer); then res["attention_summary"] over
    every row on record."""
    rows = res.get("attention_targets", {})
    ceiling = res.get("hbm_read_gbps")
    for name in names:
        row = rows[name]
        if "gbps" in row:
            row["fraction_of_hbm_read"] = (row["gbps"] / ceiling if isinstance(ceiling, float)
                                           else None)
            _device_fractions(row, ceiling)
            _compute_fractions(row, res.get("matmul_tflops"), ceiling)
        row["met"] = _met(row)
        # the summary fields first, for whoever reads the JSON
        rows[name] = {**{k: row[k] for k in SUMMARY_KEYS if k in row}, **row}
    res["attention_summary"] = {name: {k: row[k] for k in SUMMARY_KEYS if k in row}
                                for name, row in rows.items()}


def run_targets(res: dict, only: set[str], targets: list[str]) -> None:
    """hbm_read and matmul (those selected), the target parts' cases, both ceilings again after
    them (so a cold GPU cannot understate a ceiling and overstate the fractions), then
    `judge`."""
    def record(err: object, what: str) -> None:
        if isinstance(err, str):
            res.setdefault("errors", []).append(f"{what}: {err}")

    def ceilings(when: str) -> None:
        if "hbm_read" in only:
            record(safe(lambda: hbm_read(res)), f"hbm_read{when}")
        if "matmul" in only:
            record(safe(lambda: matmul_ceiling(res)), f"matmul{when}")

    ceilings("")
    names = []
    for part in targets:
        for case in target_cases()[part]:
            record(safe(functools.partial(attention_case, res, case)), f"{part} {case.name}")
            if case.name in res.get("attention_targets", {}):
                names.append(case.name)
    if targets:
        ceilings(" (after the targets)")
        judge(res, names)

