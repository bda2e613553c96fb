"""Which Pallas backend the kernels lower to: Triton on GPU, the interpreter elsewhere; and the
switch to the FFI form of the Triton call.

Why Triton, which jax 0.11 marks deprecated, and not Mosaic GPU: the kernels must also run in
interpret mode on the CPU, where CI tests them with jax 0.10, and there Mosaic GPU interprets a
plain kernel but not the Hopper instructions that would make it worth the move (its TMA copy,
`copy_gmem_to_smem`, has no interpret rule on jax 0.10.2). A Mosaic GPU kernel would need a
second, CPU-only path, and the one in CI would not be the one that runs.
"""

from __future__ import annotations

import importlib

import jax


def use_interpreter() -> bool:
    """True when no GPU backs the default device, so kernels must run with `interpret=True`."""
    return jax.default_backend() != "gpu"


def lower_to_ffi_calls() -> bool:
    """Has Pallas-Triton calls lower to jaxlib's FFI custom call (`triton_kernel_call_ffi`)
    rather than XLA's `__gpu$xla.gpu.triton`; returns whether that lowering is in force.

    Why: XLA's command-buffer pass does not capture `__gpu$xla.gpu.triton`, so every Pallas
    call splits the CUDA graph it sits in (BENCHMARKS.md's dispatch rows), while jaxlib
    registers the FFI handler as command-buffer compatible: a forward could then replay as a
    few graph launches. Whether XLA captures it, and what that saves, is for
    `benchmarks/dispatch_probe.py --ffi-calls` and the forward's floor to show on a GPU; the
    engine does not call this yet. jax 0.11 has the FFI lowering behind a module switch (off by
    default); jax 0.10 has none and keeps the XLA call. The switch is process-wide, and
    programs lowered before the call keep the lowering they had.
    """
    if use_interpreter():
        return False
    try:
        registration = importlib.import_module(
            "jax._src.pallas.triton.pallas_call_registration")
    except ImportError:
        return False
    if not hasattr(registration, "USE_NEW_CUSTOM_CALL"):
        return False
    setattr(registration, "USE_NEW_CUSTOM_CALL", True)  # noqa: B010  (absent from jax 0.10 stubs)
    return True
