"""Which Pallas backend the kernels lower to: Triton on GPU, the interpreter elsewhere.

Why Triton, which jax 0.11 marks deprecated, and not Mosaic GPU: the kernels must also run in
interpret mode on the CPU, where CI tests them with jax 0.10, and there Mosaic GPU interprets a
plain kernel but not the Hopper instructions that would make it worth the move (its TMA copy,
`copy_gmem_to_smem`, has no interpret rule on jax 0.10.2). A Mosaic GPU kernel would need a
second, CPU-only path, and the one in CI would not be the one that runs.
"""

from __future__ import annotations

import jax


def use_interpreter() -> bool:
    """True when no GPU backs the default device, so kernels must run with `interpret=True`."""
    return jax.default_backend() != "gpu"
