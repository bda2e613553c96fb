"""The command line: parts to run (--only), earlier results to merge (--merge), the JSON out."""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import jax

from benchmarks.kernels import attention
from benchmarks.kernels.attention import run_targets
from benchmarks.kernels.cases import TARGET_PARTS
from benchmarks.kernels.memory_ops import gathers, kv_write, rope_write, transfers
from benchmarks.kernels.shapes import PAGE, SHAPES
from benchmarks.kernels.timing import ceilings, safe
from benchmarks.rows import Rule, Target, page_row

DESCRIPTION = """\
Kernel benchmark on the GPU: pallas_kernels ops at Qwen2 shapes, ceilings, attention targets.

Page 64, bf16. Parts (--only, comma-separated; default: all):
  ceilings     PCIe both ways (device_put of pinned host arrays); HBM copy (x + 1 on 1 GiB)
  hbm_read     HBM read ceiling: read-only reductions over 4 distinct 1 GiB arrays, one program
  matmul       matmul ceiling: 4 distinct bf16 8192^3 matmuls in one program (TFLOP/s)
  transfers    the host tier's write-back and load-back of scattered pages
  kv_write     write_kv vs XLA's scatter
  rope_write   rope_write vs XLA's rotations + write_kv, and vs its reference in XLA
  gathers      the write-back's staging gather
  extend_long  target: 64 new tokens over 8192 cached, 7B and 0.5B heads, >= 0.40 of hbm_read
  decode_long  target: 32 x 4096 and 8 x 32768, 7B heads, >= 0.50 of hbm_read (and the time of
               JAX's Pallas paged decode kernel beside it, for comparison)
  prefill      target: 4 x 2048 and 1 x 8192 fresh tokens, 7B heads, <= 1.05 x cuDNN's time
The target parts time per layer from one program over the model's layers (attention.TIMING_NOTE),
sweep the kernel's tuning arguments, check the fastest config against the float32 reference, and
run hbm_read and matmul before and after them (their best counts). Results: attention_targets
(every config) and attention_summary (per case: per_layer_ms, bytes, fraction_of_hbm_read,
fraction_of_matmul, target, met); each row's `floor` holds its FLOPs' time at the matmul ceiling,
its bytes' at the read ceiling, and the fraction of the matmul ceiling its target asks for.
"""

PARTS = ("ceilings", "hbm_read", "matmul", "transfers", "kv_write", "rope_write", "gathers",
         *TARGET_PARTS)


def main(argv: list[str] | None = None) -> dict:
    """Runs the parts named by --only (all by default) and prints (and with --out writes) the
    results as JSON; returns them."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels",
                                     description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--merge", default=None,
                        help="earlier result JSON whose parts not re-run are kept")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(PARTS):
        parser.error(f"unknown parts {sorted(only - set(PARTS))}; choose from {PARTS}")
    targets = [p for p in TARGET_PARTS if p in only]
    if targets:  # their fractions are of the ceilings measured in the same run
        only |= {"hbm_read", "matmul"}
    res = json.load(open(args.merge)) if args.merge else {}
    for part, keys in (("hbm_read", ("hbm_read", "hbm_read_gbps", "hbm_read_note")),
                       ("matmul", ("matmul_tflops", "matmul_passes", "matmul_note"))):
        if part in only:  # a merged ceiling is another run's
            for key in keys:
                res.pop(key, None)
    if args.merge:  # the kernels' numbers before this round stay on record beside the new ones
        res.setdefault("previous_round",
                       {k: res[k] for k in ("date", "hbm_copy_gbps", "kv_write") if k in res})
    res.update({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "page_size": PAGE, "dtype": "bfloat16"})
    if args.merge:
        res["parts_rerun"] = {"parts": sorted(only), "date": res["date"],
                              "note": "other fields come from the earlier run in --merge"}
    for key, run in (("ceilings", ceilings), ("transfers", transfers)):
        err = safe(functools.partial(run, res)) if key in only else None
        if isinstance(err, str):
            res.setdefault("errors", []).append(err)
    for name, shape in SHAPES.items():
        for key, memory_op in (("kv_write", kv_write), ("rope_write", rope_write),
                               ("gathers", gathers)):
            if key in only:
                err = safe(functools.partial(memory_op, res, name, **shape))
                if isinstance(err, str):
                    res.setdefault("errors", []).append(f"{name} {key}: {err}")
    run_targets(res, only, targets)
    res["page_rows"] = {**res.get("page_rows", {}), **page_rows(res)}
    res["kv_write_gbps"] = max((v for s in res.get("kv_write", {}).values()
                                for v in s["gbps"].values()
                                if isinstance(v, float)), default=None)
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return res


def page_rows(res: dict) -> dict[str, dict]:
    """The page rows of this run (`benchmarks.rows`): each attention case timed, against its
    target (a fraction of the HBM read ceiling at least, or a ratio to the peer at most), and
    each preset's write-back gather (no target)."""
    found: dict[str, dict] = {}
    timed = res.get("attention_targets", {}) if "hbm_read_gbps" in res else {}
    for case in (c for cases in attention.target_cases().values() for c in cases):
        if "per_layer_ms" not in timed.get(case.name, {}):
            continue  # not run, or failed
        if case.kind == "prefill":
            args: dict = {"case": case.name, "against": "peer"}
            target = Target(f"<= {case.target:.2f}",
                            (Rule("over_peer", "over_peer", at_most=case.target),))
        else:
            args = {"case": case.name, "show_start": case.kind == "decode"}
            target = Target(f">= {case.target:.2f}",
                            (Rule("fraction", "fraction", at_least=case.target),))
        found[f"attention_{case.name}"] = page_row("attention", [res], args, target)
    gathers = res.get("write_back_gather", {}) if "hbm_copy_gbps" in res else {}
    for preset in (p for p, g in gathers.items() if "pallas_one_launch_ms" in g):
        found[f"gather_{preset}"] = page_row("gather", [res], {"preset": preset}, Target())
    return found


