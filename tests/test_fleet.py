"""A fleet: two `python -m jhicache.serve` processes on one Mooncake store (a real
`mooncake_master`), `sglang-router --policy cache_aware` in front of them. Through the router
the three generation routes answer; a conversation server A served continues on server B with
its prefix read from the store and the tokens of a server that computes it all; a server of
another namespace never reads those pages. Every server checks its page accounting at each step
(--check-invariants-every-step: a violation fails the request), and its /metrics show no
serving compile."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "tokenizers", "sglang_router"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

from jhicache.serve.thread import free_socket  # noqa: E402
from tests.mooncake_support import Master, running_master  # noqa: E402
from tests.serve_support import metric, write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 300.0  # three servers warming up on a loaded 2-core CI box
TIMEOUT_S = 120.0
MAX_TOKENS = 8
# 4 pages of prompt, then the answer: the prefix B reads is whole pages A wrote
FIRST_TURN = [(7 * i + 3) % 300 + 5 for i in range(64)]
NEXT_USER = [(11 * i + 1) % 300 + 5 for i in range(20)]


def _port() -> int:
    sock = free_socket()
    port = int(sock.getsockname()[1])
    sock.close()  # the server binds it again (SO_REUSEADDR); the window is short
    return port


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    started = time.monotonic()
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() - started < STARTUP_S, f"{url} did not come up: {log.read_text()}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Fleet:
    """The processes this module starts (servers, router), each stopped at the end."""

    def __init__(self, tmp: Path, checkpoint: Path, master: Master) -> None:
        self.tmp, self.checkpoint, self.master = tmp, checkpoint, master
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, cmd: Sequence[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{name}.log"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(cmd), env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc, log

    def servers(self, *extras: Sequence[str]) -> list[str]:
        """Servers on the store (each with `extras` flags), started together; their URLs."""
        started = []
        for i, extra in enumerate(extras):
            port = _port()
            cmd = [sys.executable, "-m", "jhicache.serve", "--model", str(self.checkpoint),
                   "--port", str(port), "--page-size", "16", "--device-kv-tokens", "512",
                   "--host-kv-tokens", "1024", "--dtype", "float32",
                   "--chunked-prefill-tokens", "128", "--max-running-requests", "4",
                   "--write-policy", "write_through", "--fetch-threshold", "16",
                   "--fetch-policy", "wait_complete", "--check-invariants-every-step",
                   "--fail-on-compile", "--compilation-cache", str(self.tmp / "xla"),
                   "--storage-backend", "mooncake",
                   "--storage-backend-config", json.dumps(self.master.config), *extra]
            proc, log = self.spawn(f"server{len(self.procs)}-{i}", cmd)
            started.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in started:
            _wait_healthy(url, proc, log)
        return [url for url, _, _ in started]

    def router(self, workers: Sequence[str]) -> str:
        port = _port()
        proc, log = self.spawn("router", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "cache_aware", "--worker-urls", *workers,
            "--prometheus-port", str(_port()), "--log-level", "warn"])
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log)
        return url

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    with running_master(tmp) as master:
        fleet = Fleet(tmp, write_checkpoint(tmp / "ckpt"), master)
        try:
            yield fleet
        finally:
            fleet.stop()


def _generate(url: str, ids: list[int]) -> dict:
    got = httpx.post(url + "/generate", timeout=TIMEOUT_S, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0,
                                              "ignore_eos": True}})
    assert got.status_code == 200, got.text
    return got.json()


@pytest.mark.slow
def test_a_fleet_behind_the_router_shares_one_store(fleet: Fleet) -> None:
    a, b = fleet.servers((), ())
    router = fleet.router([a, b])

    # the three routes, through the router, unchanged
    native = httpx.post(router + "/generate", timeout=TIMEOUT_S, json={
        "text": "the quick brown fox", "sampling_params": {"max_new_tokens": 4,
                                                           "temperature": 0}})
    assert native.status_code == 200, native.text
    assert len(native.json()["output_ids"]) <= 4 and "meta_info" in native.json()
    model = httpx.get(a + "/v1/models", timeout=10).json()["data"][0]["id"]
    completion = httpx.post(router + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": "a cache keeps", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] is not None
    chat = httpx.post(router + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": model, "messages": [{"role": "user", "content": "hello server"}],
        "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"

    # a conversation A served continues on B (sent to B directly: the router would keep it
    # on A), its prefix read from the store
    first = _generate(a, FIRST_TURN)
    assert first["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert httpx.post(a + "/flush_cache", timeout=TIMEOUT_S).status_code == 200  # backups done
    second_turn = FIRST_TURN + first["output_ids"] + NEXT_USER
    on_b = _generate(b, second_turn)
    from_store = on_b["meta_info"]["cached_tokens_details"]["storage"]
    assert from_store >= len(FIRST_TURN)  # at least the first prompt's pages
    with httpx.Client(base_url=b, timeout=10) as http:
        assert metric(http, "jhicache:cache_hit_tokens_total", tier="storage") >= from_store

    # another namespace on the same store: it computes everything, which gives the tokens of
    # no cache at all, which B's must equal
    (other,) = fleet.servers(("--storage-model-name", "another model"))
    on_other = _generate(other, second_turn)
    assert on_other["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert on_other["meta_info"]["cached_tokens"] == 0
    assert on_b["output_ids"] == on_other["output_ids"]
    with httpx.Client(base_url=other, timeout=10) as http:
        assert metric(http, "jhicache:cache_hit_tokens_total", tier="storage") == 0

    for url in (a, b, other):  # every step checked its pages; none compiled while serving
        with httpx.Client(base_url=url, timeout=10) as http:
            assert metric(http, "jhicache:compiles_total", phase="serving") == 0
            assert metric(http, "jhicache:storage_write_failures_total", 0.0, reason="io") == 0
