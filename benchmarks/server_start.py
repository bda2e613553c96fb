"""A server's start as a user meets it: from launch to /health 200, then an optional bench run
against it, then Ctrl-C.

    python benchmarks/server_start.py --out start.json [--bench "ARGS"] -- --preset qwen2-7b ...

Launches `python -m jhicache.serve` with the arguments after `--`, polls /health every 0.2 s and
records when the server first answered (503 while it warms up) and when it answered 200, and
the warm-up's log line. With `--bench`, runs `python -m jhicache.bench multiturn --url URL
ARGS --out ...` against it and keeps that JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.rows import Rule, Target, page_row


def _get(url: str, timeout: float) -> tuple[int, str]:
    """GET url: (status, body). The standard library's client, so that the script needs nothing
    the serve extra does not install."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:  # 503 while the server warms up
        return e.code, e.read().decode()


def start_target(result: dict) -> Target:
    """Launch to /health 200: at most 60 s when the warm-up read its programs back from the
    compilation cache, else 5 minutes (the aim for a cold start)."""
    warm = result["server_info"]["startup"]["warmup"]["cache_hits"] > 0
    bound, text = (60, "<= 60 s") if warm else (300, "<= 5 min (aim)")
    return Target(text, (Rule("health_s", "health_s", at_most=bound),))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--bench", default=None, help="bench multiturn arguments (quoted)")
    p.add_argument("--timeout", type=float, default=600.0)
    args, serve_args = p.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    url = f"http://127.0.0.1:{args.port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jhicache.serve", "--port", str(args.port), *serve_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    first_answer = ready = None
    while ready is None:
        if proc.poll() is not None or time.monotonic() - start > args.timeout:
            break
        try:
            status, _ = _get(url + "/health", timeout=1.0)
            first_answer = first_answer or time.monotonic() - start
            if status == 200:
                ready = time.monotonic() - start
        except OSError:  # not listening yet (URLError is an OSError)
            pass
        time.sleep(0.2)
    result: dict = {"command": shlex.join(cmd), "first_answer_s": first_answer,
                    "health_200_s": ready}
    if ready is not None:
        result["server_info"] = json.loads(_get(url + "/server_info", timeout=10)[1])
    if ready is not None and args.bench:
        bench_out = args.out + ".bench.json"
        bench = [sys.executable, "-m", "jhicache.bench", "multiturn", "--url", url,
                 *shlex.split(args.bench), "--out", bench_out]
        done = subprocess.run(bench, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
        result["bench_command"] = shlex.join(bench)
        if os.path.exists(bench_out):
            with open(bench_out) as f:
                result["bench"] = json.load(f)
        text = _get(url + "/metrics", timeout=10)[1]
        result["compiles"] = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^jhicache:compiles_total\{phase="(\w+)"\} (\S+)$', text, re.M)}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.seek(0)
    lines = log.read().splitlines()
    result["warmup_log"] = [line for line in lines if "warm-up:" in line or "engine built" in line]
    result["log_tail"] = lines[-15:]
    if ready is not None:
        result["page_rows"] = {"server_start": page_row("server_start", [result], {},
                                                        start_target(result))}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result.get(k) for k in ("first_answer_s", "health_200_s", "compiles",
                                                 "warmup_log")}, indent=1))


if __name__ == "__main__":
    main()
