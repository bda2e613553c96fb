"""Which Pallas backend the kernels lower to: Triton on GPU, the interpreter elsewhere."""

from __future__ import annotations

import jax


def use_interpreter() -> bool:
    """True when no GPU backs the default device, so kernels must run with `interpret=True`."""
    return jax.default_backend() != "gpu"
