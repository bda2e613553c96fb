"""benchmarks/dispatch_probe.py's reading of where a compiled program's custom calls run: inside
XLA's command buffers or launched on their own."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.scripts import load_script

probe = load_script("benchmarks/dispatch_probe.py")

# The shape of XLA's optimized HLO once its command-buffer pass has outlined a run of kernels
# (names as the GPU backend prints them; one call inside the buffer, one outside it).
_HLO = """HloModule jit_run, entry_computation_layout={(bf16[16,64]{1,0})->bf16[16,64]{1,0}}

%fused_tanh (param_0: bf16[16,64]) -> bf16[16,64] {
  %param_0 = bf16[16,64]{1,0} parameter(0)
  ROOT %tanh = bf16[16,64]{1,0} tanh(%param_0)
}

%command_buffer.2 (p: bf16[16,64]) -> bf16[16,64] {
  %p = bf16[16,64]{1,0} parameter(0)
  %f = bf16[16,64]{1,0} fusion(%p), kind=kLoop, calls=%fused_tanh
  ROOT %cc = bf16[16,64]{1,0} custom-call(%f), custom_call_target="triton_kernel_call"
}

ENTRY %main.9 (x: bf16[16,64]) -> bf16[16,64] {
  %x = bf16[16,64]{1,0} parameter(0)
  %call = bf16[16,64]{1,0} call(%x), to_apply=%command_buffer.2
  ROOT %t = bf16[16,64]{1,0} custom-call(%call), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_calls_are_counted_by_where_they_run() -> None:
    assert probe.custom_call_placement(_HLO) == {
        "triton_kernel_call": {"in_command_buffer": 1, "outside": 0},
        "__gpu$xla.gpu.triton": {"in_command_buffer": 0, "outside": 1},
    }


def test_a_compiled_programs_own_text_is_read() -> None:
    """XLA's own text for a program with a custom call (the CPU backend's LAPACK call for a
    Cholesky factorisation), where no command buffers exist: counted, and outside."""
    a = jnp.eye(8, dtype=jnp.float32) * 2.0
    hlo = jax.jit(jnp.linalg.cholesky).lower(a).compile().as_text()
    placement = probe.custom_call_placement(hlo)
    assert placement, hlo[:2000]
    assert all(c["in_command_buffer"] == 0 and c["outside"] >= 1 for c in placement.values())
