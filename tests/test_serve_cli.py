"""`python -m jhicache.serve --preset tiny` as a user starts it: a subprocess that answers in
seconds on the CPU, serves token-id prompts, refuses text (no tokenizer), logs each request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_serve_preset_from_the_command_line(tmp_path: Path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # the server binds it again (SO_REUSEADDR); the window is short
    # The tiny model's compiles are quick: cache them all (JAX caches only slow ones by default)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    cache = tmp_path / "xla-cache"
    cmd = [sys.executable, "-m", "jhicache.serve", "--preset", "tiny", "--port", str(port),
           "--page-size", "16", "--device-kv-tokens", "512", "--dtype", "float32",
           "--compilation-cache", str(cache)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() - started < STARTUP_S, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        got = httpx.post(url + "/v1/completions", timeout=60,
                         json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).json()
        assert len(got["choices"][0]["token_ids"]) == 4
        assert got["usage"]["prompt_tokens"] == 3
        text = httpx.post(url + "/generate", json={"text": "hi"}, timeout=60)
        assert text.status_code == 400
        assert "token-id prompts only" in text.json()["error"]["message"]
        info = httpx.get(url + "/get_model_info", timeout=10).json()
        assert info["model_path"] == "preset:tiny" and info["tokenizer_path"] is None
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "prompt_tokens=3 cached_tokens=0 ttft=" in out  # the request's info line
    assert cache.is_dir() and any(cache.iterdir())  # the programs it compiled, for the next start
