"""A writer of the storage tier killed mid-write (SIGKILL, no clean stop) leaves nothing another
server would read as valid: every page found under a key holds exactly the bytes written under
it, on each backend (`file`; `mooncake`, its memory in a store service's process, so that the
writer's pages outlive it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.mooncake_local import local_store
from jhicache.cache import HostPool
from tests.cache import page_writer as pw
from tests.mooncake_support import mooncake_or_skip

ROOT = Path(__file__).resolve().parents[2]
STORED_BEFORE_KILL = 12  # pages the writer reports stored before it is killed
WRITER_S = 120.0  # the writer is killed after this long whatever it has stored


@contextlib.contextmanager
def backend(name: str, tmp_path: Path) -> Iterator[str]:
    """Where the writer and the reader store: a directory, or a Mooncake config whose memory a
    store service holds (the writer gives none)."""
    if name == "file":
        yield str(tmp_path / "pages")
        return
    mooncake_or_skip()
    with local_store(tmp_path, 256 << 20) as (config, _):
        yield json.dumps(config)


def kill_mid_write(name: str, where: str, log: Path) -> int:
    """Starts the writer (its stderr, Mooncake's log among it, to `log`), kills it once it has
    stored STORED_BEFORE_KILL pages; the last page it reported stored."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.cache.page_writer", name, where],
                                stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT)
    assert proc.stdout is not None
    last = -1
    stall = threading.Timer(WRITER_S, proc.kill)  # a stalled writer ends its output
    stall.start()
    try:
        for line in proc.stdout:
            last = int(line)
            if last + 1 >= STORED_BEFORE_KILL:
                break
    finally:
        stall.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert last + 1 >= STORED_BEFORE_KILL, log.read_text()[-2000:]
    return last


@pytest.mark.parametrize("name", ["file", "mooncake"])
def test_a_writer_killed_mid_write_leaves_only_whole_pages(name: str, tmp_path: Path) -> None:
    with backend(name, tmp_path) as where:
        last = kill_mid_write(name, where, tmp_path / "writer.log")
        pool = HostPool(pw.LAYOUT)
        reader = pw.open_storage(name, where, pool)
        try:
            for i in range(last + 8):  # the pages reported stored, and those it may have begun
                if reader.get([pw.key(i)], [0]) == 1:
                    np.testing.assert_array_equal(pw.read(pool, 0), pw.page_bytes(i))
                else:
                    assert i > last, f"page {i}, reported stored, is missing"
        finally:
            reader.close()
            pool.close()
