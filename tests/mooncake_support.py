"""A real `mooncake_master` (the wheel ships it) on free local ports, with its HTTP metadata
server, for the tests of the Mooncake storage backend; and the skip rule: the tests run
wherever `mooncake` imports, and must run where `JHICACHE_REQUIRE_MOONCAKE=1` (CI)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

START_S = 30.0


def mooncake_or_skip() -> None:
    """Skips the calling test when Mooncake cannot be imported, unless CI requires it."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        if os.environ.get("JHICACHE_REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"mooncake not importable: {e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _master_binary() -> str:
    beside = Path(sys.executable).with_name("mooncake_master")
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("mooncake_master is not installed beside python nor on PATH")
    return found


class Master:
    """One master process; `config` is what a client's storage backend config needs."""

    def __init__(self, log: Path) -> None:
        self.rpc_port, self.http_port = _free_port(), _free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> dict[str, Any]:
        return {"master_server_address": f"127.0.0.1:{self.rpc_port}",
                "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                "local_hostname": "127.0.0.1", "protocol": "tcp",
                "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [_master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http_port}",
                 f"--metrics_port={_free_port()}", "--default_kv_lease_ttl=50"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while not all(_accepts(p) for p in (self.rpc_port, self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def running_master(tmp_path: Path) -> Iterator[Master]:
    mooncake_or_skip()
    master = Master(tmp_path / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()
