"""A real `mooncake_master` (`benchmarks.mooncake_local.Master`) for the tests of the Mooncake
storage backend, and the skip rule: the tests run wherever `mooncake` imports, and must run
where `JHICACHE_REQUIRE_MOONCAKE=1` (CI)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.mooncake_local import Master


def mooncake_or_skip() -> None:
    """Skips the calling test when Mooncake cannot be imported, unless CI requires it."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        if os.environ.get("JHICACHE_REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"mooncake not importable: {e}")


@contextlib.contextmanager
def running_master(tmp_path: Path) -> Iterator[Master]:
    mooncake_or_skip()
    master = Master(tmp_path / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()
