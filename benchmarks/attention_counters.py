"""Two attention calls to read hardware counters of, under NVIDIA Nsight Compute: a 64-token turn
over an 8192-token prefix (extend, Qwen2-7B heads) and four fresh 2048-token prompts (prefill),
each compiled, then run once more.

    ncu --kernel-name regex:"extend|merge" --launch-count 6 --csv --metrics \\
        gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,\\
        launch__occupancy_limit_shared_mem,launch__shared_mem_per_block_dynamic,\\
        sm__warps_active.avg.pct_of_peak_sustained_active,\\
        sm__inst_executed_pipe_tensor_op_gmma.sum,\\
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
        dram__bytes_read.sum python3 benchmarks/attention_counters.py

(PYTHONPATH=. from the repo root.) Nothing is timed here; ncu replays each kernel.
"""

from __future__ import annotations

import jax

from jhicache.bench.kernels.cases import inputs, kernel, resolve, target_cases

CASES = ("extend_qwen2-7b_64_over_8192", "prefill_qwen2-7b_4x2048")


def main() -> None:
    cases = {c.name: c for part in ("extend_long", "prefill") for c in target_cases()[part]}
    for name in CASES:
        case = cases[name]
        data = inputs(case)
        call = jax.jit(kernel(case, resolve(case, case.start)))
        for _ in range(2):  # the first compiles
            jax.block_until_ready(call(data.q, data.ks[0], data.vs[0], data.news[0], *data.meta))


if __name__ == "__main__":
    main()
