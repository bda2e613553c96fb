"""Test settings: CPU by default; `-m gpu` (see `make gpu-test`) selects the GPU-marked tests."""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# XLA:CPU compiles without its costly LLVM passes (about a quarter less time for the engine
# tests on a cold compilation cache) and with its older fusion emitters (the newer ones took
# twice as long to compile: 11.4 s against 5.9 s for two test engines' programs, and 32 s
# against 17 s of CPU for the kernel and model tests' interpret-mode Pallas programs, on
# 2026-12-07): the suite is mostly compiles of programs over tiny models, which then run for
# milliseconds. The checks compare results computed the same way, and the GPU tests keep the
# default. `JHICACHE_TEST_XLA_FAST_COMPILE=0` compiles as usual.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                      " --xla_cpu_use_fusion_emitters=false")


def _compile_fast() -> None:
    """Adds the flags before JAX starts its backend; subprocesses (servers, tensor parallelism)
    inherit them, and pytest-xdist's workers, which inherit them too, do not add them twice
    (the flags are part of the compilation cache's key)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FAST_COMPILE_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAGS}".strip()


if os.environ.get("JHICACHE_GPU_TESTS") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ.get("JHICACHE_TEST_XLA_FAST_COMPILE", "1") != "0":
        _compile_fast()


def pytest_configure(config: pytest.Config) -> None:
    """One JAX persistent compilation cache for every pytest-xdist worker: most of the suite's
    time is XLA compiles, and tests in different workers (or after `jax.clear_caches` below)
    build the same programs. Its key covers the program, JAX version, backend and flags.
    `JHICACHE_TEST_COMPILE_CACHE=off` turns it off."""
    directory = os.environ.get("JHICACHE_TEST_COMPILE_CACHE") or os.path.join(
        tempfile.gettempdir(), f"jhicache-test-jax-cache-{getpass.getuser()}")
    if directory == "off":
        return
    # As environment too, for the checks that run in a subprocess (tensor parallelism, servers)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `--compilation-cache` of the servers the tests start as subprocesses: the suite's
    JAX cache, so that a server reads back the programs any earlier one compiled, in either
    pytest-xdist worker and in any module (each compiled them cold in a directory of its test
    module's before); a directory of the session's own when that cache is off."""
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(directory) if directory else tmp_path_factory.mktemp("xla")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the `slow`-marked tests first, and so their modules (pytest-xdist's loadfile with
    --no-loadscope-reorder takes modules in the order of their first test): each takes tens of
    seconds on a cold compilation cache, and started last, one would keep a pytest-xdist worker
    busy after the other ran out of modules. Skips GPU-marked tests when JAX has no GPU, so
    `-m gpu` on a CPU box reports skips, not errors."""
    import jax

    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: the rest keep their order
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
