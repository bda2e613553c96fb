"""`python -m jhicache.serve --preset tiny` as a user starts it: a subprocess that answers in
seconds on the CPU, serves token-id prompts, refuses text (no tokenizer), logs each request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# The serve extra (`pip install -e '.[test,serve]'`, as `make test` does); the GPU machine's
# preinstalled packages may lack it: skip these tests there rather than fail collection.
for _module in ("fastapi", "uvicorn", "httpx", "tokenizers"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

from jhicache.serve.thread import free_socket

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 90.0  # the bare start takes seconds; a loaded 2-core CI box gets slack


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(line_start))
                 .rsplit(" ", 1)[1])


def _serve(tmp_path: Path, cache: Path, check, extra: tuple[str, ...] = (),
           stop: signal.Signals = signal.SIGINT, expect: int = 0, stops: int = 1) -> str:
    """Starts the server (with `extra` flags), waits for /health 200 (noting each status met on
    the way), runs `check(url, statuses)`, stops it with `stop` (Ctrl-C; `stops` times, 0.3 s
    apart); returns its log."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # the server binds it again (SO_REUSEADDR); the window is short
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    # a small grid: 64 and 128 prefill tokens for 1 or 4 requests, decodes of 4
    cmd = [sys.executable, "-m", "jhicache.serve", "--preset", "tiny", "--port", str(port),
           "--page-size", "16", "--device-kv-tokens", "512", "--dtype", "float32",
           "--chunked-prefill-tokens", "128", "--max-running-requests", "4",
           "--fail-on-compile", "--compilation-cache", str(cache), *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url, statuses = f"http://127.0.0.1:{port}", []
    try:
        started = time.monotonic()
        while not statuses or statuses[-1][0] != 200:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() - started < STARTUP_S, "server did not come up"
            try:
                health = httpx.get(url + "/health", timeout=1.0)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if not statuses or statuses[-1][0] != health.status_code:
                statuses.append((health.status_code, health.text.strip()))
                if health.status_code == 503:  # warming up: generation is refused too
                    early = httpx.post(url + "/v1/completions", timeout=60,
                                       json={"prompt": [1, 2], "max_tokens": 2})
                    ready = httpx.get(url + "/health", timeout=1.0).status_code == 200
                    assert early.status_code == (200 if ready else 503), early.text
            time.sleep(0.05)
        check(url, statuses)
    finally:
        for i in range(stops if expect == 0 else 0):
            time.sleep(0.3 if i else 0.0)
            proc.send_signal(stop)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it should have ended: end it, and fail below
            proc.kill()
            out, _ = proc.communicate()
    if expect:
        assert proc.returncode == expect, out
        return out
    # uvicorn shuts down, then raises the signal it caught again: SIGTERM's status is its own
    assert proc.returncode in ((0, -signal.SIGTERM) if stop is signal.SIGTERM else (0,)), out
    assert "shutdown complete" in out.lower() or "Finished server process" in out, out
    return out


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compilation cache the servers of this module's tests share: a later start reads back."""
    return tmp_path_factory.mktemp("xla-cache")


@pytest.mark.slow
def test_serve_preset_from_the_command_line(tmp_path: Path, programs: Path):
    """It listens at once, warms up (503) and then serves (200) without compiling; a restart
    reads its programs back from the compilation cache."""
    cache = programs

    def check(url: str, statuses: list[tuple[int, str]]) -> None:
        assert statuses[0] == (503, "warming up") and statuses[-1][0] == 200
        got = httpx.post(url + "/v1/completions", timeout=60,
                         json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).json()
        assert len(got["choices"][0]["token_ids"]) == 4
        assert got["usage"]["prompt_tokens"] == 3
        text = httpx.post(url + "/generate", json={"text": "hi"}, timeout=60)
        assert text.status_code == 400
        assert "token-id prompts only" in text.json()["error"]["message"]
        info = httpx.get(url + "/get_model_info", timeout=10).json()
        assert info["model_path"] == "preset:tiny" and info["tokenizer_path"] is None
        assert info["max_total_tokens"] == 512 and info["page_size"] == 16
        server = httpx.get(url + "/server_info", timeout=10).json()
        assert server["page_size"] == 16 and server["chunked_prefill_size"] == 128
        assert server["grid"]["shapes"] == 5 and server["startup"]["warmup"]["shapes"] == 5
        # a server's warm-up ends by freezing the heap (in the engine's process)
        assert server["startup"]["warmup"]["frozen_objects"] > 0
        long = httpx.post(url + "/v1/completions", timeout=60,
                          json={"prompt": [1] * 500, "max_tokens": 13})
        assert long.status_code == 400 and "context limit" in long.json()["error"]["message"]
        assert _metric(url, 'jhicache:compiles_total{phase="serving"}') == 0
        assert _metric(url, 'jhicache:compiles_total{phase="warmup"}') > 0

    out = _serve(tmp_path, cache, check)
    assert "prompt_tokens=3 cached_tokens=0 ttft=" in out  # the request's info line
    assert re.search(r"the server's process: [1-9]\d* objects frozen", out), out
    assert cache.is_dir() and any(cache.iterdir())  # the programs it compiled, for the next start
    restart = _serve(tmp_path, cache, lambda url, statuses: None)
    read_back = re.search(r"warm-up: 5 shapes, (\d+) programs \((\d+) read back", restart)
    assert read_back and int(read_back.group(2)) == int(read_back.group(1)) > 0, restart


def test_sigterm_with_a_stream_open_ends_it_within_the_shutdown_timeout(tmp_path: Path,
                                                                          programs: Path):
    """The stream in flight ends (cut, or done) rather than holding the shutdown, and the
    server and its engine process exit cleanly."""
    ended: list[str] = []
    streaming = threading.Event()

    def stream(url: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": [1, 2, 3], "max_tokens": 509,
                                    "stream": True}) as r:
                for _ in r.iter_lines():
                    streaming.set()
            ended.append("closed")
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)
        finally:
            streaming.set()

    reader = threading.Thread(target=stream, daemon=True)

    def check(url: str, statuses: list[tuple[int, str]]) -> None:
        reader._args = (url,)  # type: ignore[attr-defined]
        reader.start()
        assert streaming.wait(60)

    _serve(tmp_path, programs, check, ("--shutdown-timeout", "1"), signal.SIGTERM)
    reader.join(60)
    assert ended, "the stream never ended"


def test_a_second_ctrl_c_during_the_drain_exits_promptly_and_cleanly(tmp_path: Path,
                                                                     programs: Path):
    """Ctrl-C starts a drain that would wait up to a minute for the open streams (more than
    the engine runs at once, each to the context's end); a second Ctrl-C ends it at once: the
    streams are cut, the server exits 0 (no C++ abort, status 134) and its engine process is
    gone."""
    reasons: list[str | None] = []  # each stream's last finish_reason (None: cut)
    streaming = threading.Event()
    engine_pid: list[int] = []

    def stream(url: str) -> None:
        last = None
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=120,
                              json={"prompt": [1, 2, 3], "max_tokens": 509, "stream": True,
                                    "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    streaming.set()
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])["choices"][0].get("finish_reason") or last
        except httpx.HTTPError:
            pass
        finally:
            reasons.append(last)
            streaming.set()

    def check(url: str, statuses: list[tuple[int, str]]) -> None:
        engine_pid.append(httpx.get(url + "/server_info", timeout=10).json()["engine_pid"])
        for _ in range(40):
            threading.Thread(target=stream, args=(url,), daemon=True).start()
        assert streaming.wait(60)

    # _serve fails unless the server exits 0 within a minute of the signals
    out = _serve(tmp_path, programs, check, ("--shutdown-timeout", "60"), stops=2)
    assert "terminate called" not in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(reasons) < 40:
        time.sleep(0.1)
    assert len(reasons) == 40 and reasons.count("length") < 40, "the drain waited for all"
    while time.monotonic() < deadline and Path(f"/proc/{engine_pid[0]}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{engine_pid[0]}").exists(), "the engine process outlived the server"


def test_a_dead_engine_process_turns_health_503_and_ends_the_server_non_zero(tmp_path: Path,
                                                                            programs: Path):
    """Killing the engine process: /health says why, and the server exits with status 1 so
    that a supervisor restarts it."""
    def check(url: str, statuses: list[tuple[int, str]]) -> None:
        pid = httpx.get(url + "/server_info", timeout=10).json()["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                health = httpx.get(url + "/health", timeout=1.0)
            except httpx.TransportError:
                break  # the server has already gone
            if health.status_code == 503:
                assert "engine stopped" in health.text and "exited" in health.text
                break
            time.sleep(0.1)

    _serve(tmp_path, programs, check, expect=1)
