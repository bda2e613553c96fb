"""Test settings: CPU by default; `-m gpu` (see `make gpu-test`) selects the GPU-marked tests."""

from __future__ import annotations

import os

import pytest

if os.environ.get("JHICACHE_GPU_TESTS") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips GPU-marked tests when JAX has no GPU, so `-m gpu` on a CPU box reports skips, not
    errors."""
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
