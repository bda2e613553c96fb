"""A Mooncake Store on this machine, for the benches and tests: a `mooncake_master` (the wheel
ships it) on free ports with its HTTP metadata server, a store service that contributes the
memory pages live in (Mooncake keeps an object in the segment of the client that mounted it),
and the store's own put/get rate for page-sized objects: the ceiling a storage hit is held to."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

START_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _binary(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed beside python nor on PATH")
    return found


def _wait(proc: subprocess.Popen[bytes], ports: tuple[int, ...], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not all(accepts(p) for p in ports):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


class Master:
    """One master process; `config` is what a client's storage backend config needs (a client
    that contributes `segment_bytes` of memory to the store)."""

    def __init__(self, log: Path, segment_bytes: int = 64 << 20) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.log, self.segment_bytes = log, segment_bytes
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> dict[str, Any]:
        return {"master_server_address": f"127.0.0.1:{self.rpc_port}",
                "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                "local_hostname": "127.0.0.1", "protocol": "tcp",
                "global_segment_size": self.segment_bytes, "local_buffer_size": 16 << 20}

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [_binary("mooncake_master"), f"--rpc_port={self.rpc_port}",
                 "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http_port}", f"--metrics_port={free_port()}"],
                stdout=out, stderr=subprocess.STDOUT)
        _wait(self.proc, (self.rpc_port, self.http_port), self.log)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


class StoreService:
    """Mooncake's store service (`mooncake.mooncake_store_service`), holding `segment_bytes`
    of the store's memory for as long as it runs."""

    def __init__(self, master: Master, segment_bytes: int, directory: Path) -> None:
        self.config_file, self.log = directory / "store_service.json", directory / "store.log"
        self.config_file.write_text(json.dumps({**master.config,
                                                "global_segment_size": segment_bytes}))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mooncake.mooncake_store_service", "--config",
                 str(self.config_file), "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT)
        _wait(self.proc, (self.port,), self.log)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


@contextlib.contextmanager
def local_store(root: Path, segment_bytes: int) -> Iterator[tuple[dict[str, Any], Master]]:
    """A master and a store service holding `segment_bytes` (logs under `root`), and a client
    config that contributes no memory: the pages an engine writes live in the service's, as a
    fleet's do, and outlive the engine."""
    root.mkdir(parents=True, exist_ok=True)
    master = Master(root / "master.log", segment_bytes=0)
    service: StoreService | None = None
    try:
        master.start()
        service = StoreService(master, segment_bytes, root)
        service.start()
        yield master.config, master
    finally:
        if service is not None:
            service.stop()
        master.stop()


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def store_rates(master: Master, page_bytes: int, pages: int) -> dict[str, float]:
    """The store's own rates for `pages` objects of `page_bytes` each, from and into a
    registered buffer of a client that contributes no memory (bytes per second)."""
    from mooncake.store import MooncakeDistributedStore

    config = master.config
    store = MooncakeDistributedStore()
    if store.setup({"local_hostname": "127.0.0.1", "metadata_server": config["metadata_server"],
                    "global_segment_size": 0, "local_buffer_size": 16 << 20, "protocol": "tcp",
                    "master_server_addr": config["master_server_address"]}) != 0:
        raise RuntimeError("the probe's Mooncake client did not start")
    data = np.random.default_rng(0).integers(0, 256, pages * page_bytes, np.uint8)
    into = np.zeros_like(data)
    for buffer in (data, into):
        store.register_buffer(buffer.ctypes.data, buffer.nbytes)
    keys = [f"rate-probe/{i}" for i in range(pages)]
    sizes = [page_bytes] * pages
    try:
        start = time.perf_counter()
        put = store.batch_put_from(keys, [data.ctypes.data + i * page_bytes
                                          for i in range(pages)], sizes)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        got = store.batch_get_into(keys, [into.ctypes.data + i * page_bytes
                                          for i in range(pages)], sizes)
        get_s = time.perf_counter() - start
        if any(r != 0 for r in put) or any(r != page_bytes for r in got):
            raise RuntimeError(f"the store's rate probe failed: put {set(put)}, get {set(got)}")
        if not np.array_equal(data, into):
            raise RuntimeError("the store's rate probe read other bytes than it wrote")
        store.batch_remove(keys, True)
    finally:
        for buffer in (data, into):
            store.unregister_buffer(buffer.ctypes.data)
        store.close()
    total = pages * page_bytes
    return {"store_put_bps": total / put_s, "store_get_bps": total / get_s}
