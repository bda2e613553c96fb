"""Test settings: CPU by default; `-m gpu` (see `make gpu-test`) selects the GPU-marked tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


# XLA:CPU maps each compiled program's code and data as separate small memory maps. A process
# that reaches the kernel's vm.max_map_count (65530 by default) crashes inside the compiler
# (the full suite did, SIGSEGV and SIGABRT, once each forward compiled as two programs). Past
# this many maps, JAX's compiled programs are dropped after a test; below it they are kept, so
# that tests sharing shapes do not compile them again.
MAP_BUDGET = 30_000


def _map_count() -> int:
    """Memory maps of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs() -> Iterator[None]:
    yield
    if _map_count() > MAP_BUDGET:
        import jax

        jax.clear_caches()
