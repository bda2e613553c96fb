"""The fleet bench (`python -m benchmarks.fleet`): two `jhicache.serve` processes sharing one
Mooncake store, sglang-router in front; multi-turn conversations that move to the other server
every turn, against the same two servers each with its own file tier (nothing shared) and
against one server; hit rate by tier, TTFT p50/p99, and the store's own put/get rate in the
same run (the ceiling of a server's reads). The master comes from `benchmarks.mooncake_local`;
its `Processes` start servers and a router (tests/test_fleet.py's too)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import cli, mooncake_local
from benchmarks.cli import sized
from benchmarks.host_hit import args_token_bytes
from benchmarks.rows import Rule, Target
from jhicache.bench import clients, multiturn, remote
from jhicache.bench.backends import Chunk
from jhicache.bench.command import model_vocab
from jhicache.bench.workload import MultiTurnSpec, user_turns
from jhicache.sampling import SamplingParams

HOW = ("shared: two servers on one Mooncake store (a mooncake_master here), each turn of a "
       "conversation sent to the other server than its last turn (directly: the router would "
       "keep a conversation on one); router: the same servers emptied (device, host, store), "
       "the same turns through sglang-router --policy cache_aware; separate: two new servers "
       "each with its own file tier, turns moving as in shared; single: one server with a "
       "file tier, every turn. Every server warmed up before its leg; hit rates and TTFT over "
       "the turns after the first round (the first has nothing to hit); ceiling: a client of "
       "the bench's own, no segment of its own (its objects in the servers' segments, read "
       "over TCP as one server reads another's), batch_put_from / batch_get_into of page-sized "
       "objects from one registered buffer, after the shared leg")
START_S = 1200.0  # a server's start: weights, pools, warm-up (from an empty compilation cache)
STOP_S = 60.0  # a process's clean stop, after SIGTERM
ROOT = Path(__file__).resolve().parent.parent
TIERS = ("device", "host", "storage")
TURN_ID = re.compile(r"^c(\d+)-r(\d+)$")  # the clients' name for a turn (clients._turn)


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/health", timeout=1.0) as answer:
            return bool(answer.status == 200)
    return False


def _call(url: str, path: str, method: str = "GET") -> str:
    """The body of a request that must answer 200 (urllib raises on any other)."""
    request = urllib.request.Request(url + path, method=method)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return str(answer.read().decode())


class Processes:
    """The child processes of one leg (a master, servers, a router), each writing its output to
    a file of `logs`; ended in the reverse order of their start."""

    def __init__(self, logs: Path, start_s: float = START_S) -> None:
        self.logs, self.start_s = logs, start_s
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.by_url: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, _ in reversed(self.procs):
            self._end(proc)

    def end(self, url: str) -> int:
        """Stops the server at `url` as a supervisor does (SIGTERM); its exit status."""
        return self._end(self.by_url[url])

    def _end(self, proc: subprocess.Popen[bytes]) -> int:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:  # (a server still warming up, say)
                pass
        # the whole group: a server's engine process too, should the server not have ended it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    def spawn(self, name: str, cmd: Sequence[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.logs / f"{len(self.procs)}-{name}.log"
        # the children import this checkout's jhicache, installed or not
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": path}, cwd=ROOT,
                                    start_new_session=True)  # a group of its own, to end
        self.procs.append((proc, log))
        return proc, log

    def wait(self, proc: subprocess.Popen[bytes], log: Path, ready: Any) -> None:
        """Until `ready()`; RuntimeError (with its log) if the process ends first, or the
        start takes longer than `start_s`."""
        deadline = time.monotonic() + self.start_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log.name} did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)

    def servers(self, flags: Sequence[Sequence[str]]) -> list[str]:
        """`python -m jhicache.serve` with each of `flags`; their URLs once every one answers
        /health (warmed up). The first starts alone, the rest together once it is up: they
        read its programs back from the compilation cache rather than compile them again."""
        urls = self._servers(flags[:1])
        return urls + self._servers(flags[1:])

    def _servers(self, flags: Sequence[Sequence[str]]) -> list[str]:
        started = []
        for extra in flags:
            port = mooncake_local.free_port()
            url = f"http://127.0.0.1:{port}"
            proc, log = self.spawn("server", [sys.executable, "-m", "jhicache.serve",
                                              "--port", str(port), *extra])
            started.append((url, proc, log))
            self.by_url[url] = proc
        for url, proc, log in started:
            self.wait(proc, log, lambda u=url: _healthy(u))
        return [url for url, _, _ in started]

    def router(self, workers: Sequence[str]) -> str:
        """sglang-router's cache-aware policy in front of `workers`."""
        port = mooncake_local.free_port()
        url = f"http://127.0.0.1:{port}"
        proc, log = self.spawn("router", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "cache_aware", "--worker-urls", *workers,
            "--prometheus-port", str(mooncake_local.free_port()), "--log-level", "warn"])
        self.wait(proc, log, lambda: _healthy(url))
        return url


class MovingBackend:
    """Each conversation's turns go round the servers: turn r of client c to server
    (c + r) mod n, so every turn after the first lands on another server than the last."""

    def __init__(self, backends: Sequence[remote.HttpBackend]) -> None:
        self.backends = list(backends)

    def together(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def stream(self, prompt: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        turn = TURN_ID.match(request_id)
        if turn is None:
            raise ValueError(f"{request_id!r}: not a bench turn's name (c<client>-r<round>)")
        server = (int(turn.group(1)) + int(turn.group(2))) % len(self.backends)
        async for chunk in self.backends[server].stream(prompt, params, request_id):
            yield chunk


async def _drive(urls: Sequence[str], spec: MultiTurnSpec,
                 args: argparse.Namespace) -> clients.ClientsRun:
    """The workload, each turn to its server among `urls` (one URL: every turn there)."""
    async with contextlib.AsyncExitStack() as stack:
        backends = [await stack.enter_async_context(remote.http_backend(url, spec.num_clients))
                    for url in urls]
        return await clients.run_clients(
            MovingBackend(backends), user_turns(spec),
            multiturn.turn_params(spec, multiturn.turn_sampling(args)),
            multiturn.clients_config(args, args.seed))


def server_flags(args: argparse.Namespace, spec: MultiTurnSpec,
                 storage: Sequence[str]) -> list[str]:
    """A server's command line: the bench's engine options, a storage tier (`storage`'s
    flags), pages written through to the host (and so to storage) unless --write-policy says
    otherwise."""
    source = ["--model", args.weights] if args.weights else ["--preset", args.preset,
                                                              "--seed", str(args.seed)]
    page = args.page_size
    longest = -(-spec.final_context_tokens // page) * page
    device = -(-multiturn.device_tokens_for(args, spec) // page) * page
    write = args.write_policy if "--write-policy" in args.given else "write_through"
    flags = [*source, "--page-size", str(page), "--dtype", args.dtype,
             "--device-kv-tokens", str(device), "--max-context-len", str(longest),
             "--max-running-requests", str(args.max_running_requests),
             "--chunked-prefill-tokens", str(args.chunked_prefill_tokens),
             "--write-policy", write, "--fetch-threshold", str(args.fetch_threshold),
             "--log-level", "warning", *storage]
    if args.fetch_policy:
        flags += ["--fetch-policy", args.fetch_policy]
    return flags


def _mooncake(master: mooncake_local.Master) -> list[str]:
    return ["--storage-backend", "mooncake", "--storage-backend-config",
            json.dumps(master.config)]


def page_bytes(args: argparse.Namespace) -> int:
    """One page's K and V over every layer, as the servers' pools hold it."""
    return args.page_size * args_token_bytes(args)


def store_ceiling(master: mooncake_local.Master, page: int, pages: int, trials: int) -> dict:
    """The store's own put/get rate for `pages` objects of `page` bytes (`store_rates`: a
    client of its own, no segment of its own: its objects in the servers' segments, read over
    TCP as one server reads another's), the best of `trials`."""
    rates = [mooncake_local.store_rates(master, page, pages) for _ in range(trials)]
    return {"page_bytes": page, "pages": pages, "trials": trials,
            "put_gb_per_s": max(r["store_put_bps"] for r in rates) / 1e9,
            "get_gb_per_s": max(r["store_get_bps"] for r in rates) / 1e9}


def hits(turns: Sequence[clients.Turn]) -> dict:
    """Hit rate by tier and in all, and TTFT, over these turns."""
    prompt = sum(t.prompt_len for t in turns)
    rates = {f"{tier}_hit_rate": sum(getattr(t, f"{tier}_hit_tokens") for t in turns) / prompt
             for tier in TIERS}
    ttft = clients.percentiles([t.ttft_s for t in turns], (50, 99))
    return {"requests": len(turns), "prompt_tokens": prompt, **rates,
            "hit_rate": sum(rates.values()), "ttft_p50_s": ttft["p50_s"],
            "ttft_p99_s": ttft["p99_s"]}


# the servers' own counters (their /metrics) a leg reports, summed over its servers
COUNTERS = {"read_bytes": "jhicache:storage_read_bytes_total",
            "read_s": "jhicache:storage_read_seconds_total",
            "backup_pages": "jhicache:storage_backup_pages_total",
            "fetches_full": 'jhicache:storage_fetches_total{outcome="full"}',
            "fetches_partial": 'jhicache:storage_fetches_total{outcome="partial"}',
            "fetches_revoked": 'jhicache:storage_fetches_total{outcome="revoked"}',
            "serving_compiles": 'jhicache:compiles_total{phase="serving"}'}


def server_counters(urls: Sequence[str]) -> dict[str, float]:
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        lines = _call(url, "/metrics").splitlines()
        for key, name in COUNTERS.items():
            totals[key] += next((float(line.rsplit(" ", 1)[1]) for line in lines
                                 if line.startswith(name + " ")), 0.0)
    return totals


def _leg(urls: Sequence[str], workers: Sequence[str], spec: MultiTurnSpec,
         args: argparse.Namespace) -> dict:
    """One run of the workload through `urls`; its figures over the rounds after the first,
    with the counters of `workers` (the servers) over the run, and the rate of their storage
    reads."""
    before = server_counters(workers)
    run = asyncio.run(_drive(urls, spec, args))
    counters = {key: value - before[key] for key, value in server_counters(workers).items()}
    later = [t for t in run.turns if t.round > 0]
    read_s = counters["read_s"]
    return {**hits(later), "elapsed_s": run.elapsed_s, **counters,
            "read_gb_per_s": counters["read_bytes"] / read_s / 1e9 if read_s else None,
            "answers": {f"{t.client}-{t.round}": list(t.token_ids) for t in run.turns}}


def _empty(urls: Sequence[str]) -> None:
    for url in urls:
        _call(url, "/flush_cache", "POST")
        _call(url, "/clear_hicache_storage_backend", "POST")


LEGS = ("shared", "router", "separate", "single")


def bench_fleet(args: argparse.Namespace, vocab: int, save: Any) -> dict:
    spec = dataclasses.replace(multiturn.multiturn_spec(args, vocab), vocab_size=vocab)
    args._device_tokens = multiturn.device_tokens_for(args, spec)
    result: dict[str, Any] = {"spec": dataclasses.asdict(spec), "how": HOW, "legs": {}}
    root = Path(tempfile.mkdtemp(prefix="jhicache-fleet-", dir=args.storage_dir))
    print(f"fleet: logs and file tiers in {root} (removed after a run that ends well)",
          file=sys.stderr, flush=True)
    legs = args.legs
    if "shared" in legs or "router" in legs:
        _store_legs(args, spec, root, result, save)
    if "separate" in legs:
        with Processes(root) as procs:
            servers = procs.servers([server_flags(args, spec, ["--storage-dir", str(root / n)])
                                     for n in ("files-a", "files-b")])
            result["legs"]["separate"] = _leg(servers, servers, spec, args)
            save(result)
    if "single" in legs:
        with Processes(root) as procs:
            servers = procs.servers([server_flags(args, spec, ["--storage-dir",
                                                               str(root / "files-one")])])
            result["legs"]["single"] = _leg(servers, servers, spec, args)
    shutil.rmtree(root, ignore_errors=True)
    answers = [leg.pop("answers") for leg in result["legs"].values()]
    result["same_answers"] = all(a == answers[0] for a in answers)
    single = result["legs"].get("single", {}).get("hit_rate")
    shared = result["legs"].get("shared", {}).get("hit_rate")
    result["moved_hit_rate_ratio"] = shared / single if single and shared is not None else None
    return result


def _store_legs(args: argparse.Namespace, spec: MultiTurnSpec, root: Path, result: dict,
                save: Any) -> None:
    """The legs on one Mooncake store (a master started here): shared, then the store's own
    put/get rate, then the same servers emptied behind the router."""
    master = mooncake_local.Master(root / "mooncake_master.log", args.segment_mib << 20)
    master.start()
    try:
        with Processes(root) as procs:
            servers = procs.servers([server_flags(args, spec, _mooncake(master))] * 2)
            if "shared" in args.legs:
                result["legs"]["shared"] = _leg(servers, servers, spec, args)
                save(result)
            result["ceiling"] = store_ceiling(master, page_bytes(args), args.ceiling_pages, 3)
            if "router" in args.legs:
                router = procs.router(servers)
                _empty(servers)
                result["legs"]["router"] = _leg([router], servers, spec, args)
                save(result)
    finally:
        master.stop()


def fleet_table(result: dict) -> str:
    """One line a leg, then the ceiling."""
    head = (f"{'leg':<9}{'device':>8}{'host':>8}{'storage':>9}{'all':>7}{'TTFT p50':>11}"
            f"{'p99':>9}{'read MB/s':>11}{'fetches':>9}{'compiles':>10}")
    lines = [head]
    for name, leg in result["legs"].items():
        gbs = leg["read_gb_per_s"]
        lines.append(f"{name:<9}{leg['device_hit_rate']:>8.2f}{leg['host_hit_rate']:>8.2f}"
                     f"{leg['storage_hit_rate']:>9.2f}{leg['hit_rate']:>7.2f}"
                     f"{leg['ttft_p50_s'] * 1e3:>9.1f}ms{leg['ttft_p99_s'] * 1e3:>7.1f}ms"
                     f"{'-' if gbs is None else f'{gbs * 1e3:.1f}':>11}"
                     f"{leg['fetches_full'] + leg['fetches_partial']:>9.0f}"
                     f"{leg['serving_compiles']:>10.0f}")
    ceiling = result.get("ceiling")
    if ceiling is not None:
        lines.append(f"store ceiling ({ceiling['pages']} objects of {ceiling['page_bytes']} B): "
                     f"put {ceiling['put_gb_per_s'] * 1e3:.1f} MB/s, get "
                     f"{ceiling['get_gb_per_s'] * 1e3:.1f} MB/s")
    ratio = result["moved_hit_rate_ratio"]
    lines.append(f"moved conversations' hit rate / one server's: "
                 f"{'-' if ratio is None else f'{ratio:.2f}'}; same answers in every leg: "
                 f"{result['same_answers']}")
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--fetch-threshold", **sized(count, 256, 16),
                   help="the servers' --fetch-threshold: prefixes shorter than this are not "
                        "read from storage")
    p.add_argument("--segment-mib", **sized(count, 16384, 256),
                   help="MiB of memory each server contributes to the store (its objects live "
                        "there)")
    p.add_argument("--ceiling-pages", **sized(count, 256, 1024),
                   help="page-sized objects the store's own put/get rate is measured with")
    p.add_argument("--legs", type=_legs, default=LEGS, metavar="LEG,...",
                   help=f"the legs to run, of {', '.join(LEGS)} (default: all; router needs "
                        "sglang-router; the moved conversations' ratio needs shared and single)")


def _legs(text: str) -> tuple[str, ...]:
    legs = tuple(leg.strip() for leg in text.split(",") if leg.strip())
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown or not legs:
        raise argparse.ArgumentTypeError(f"unknown legs {unknown}: choose from {', '.join(LEGS)}")
    return legs


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target] | None:
    """The moved conversations' target, where the run has the shared and single legs."""
    if result["moved_hit_rate_ratio"] is None:
        return None
    return "fleet", Target(">= 0.9 of one server's", (Rule("moved_ratio", "moved", at_least=0.9),))


def main(argv: list[str] | None = None) -> int:
    # SIGTERM ends the bench as Ctrl-C does, through the Processes' exits: no process it
    # started is left running
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return cli.main("fleet", "fleet", __doc__ or "", argv, add_options,
                    lambda args, save: bench_fleet(args, model_vocab(args), save),
                    fleet_table, page_row, own_device_memory=False)


if __name__ == "__main__":
    sys.exit(main())

