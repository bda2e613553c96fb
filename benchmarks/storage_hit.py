"""The storage-hit bench: TTFT of a prefix found only in the storage tier, against recomputing
it and against a device hit, with the backend's own read rate measured in the same run (the
disk's for `file`; for `mooncake`, a store on this machine whose memory a store service holds,
the store's get rate for page-sized objects)."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import cli, mooncake_local, tables
from benchmarks.cli import sized
from benchmarks.host_hit import args_token_bytes, bytes_per_token, stats_delta, ttft_of
from benchmarks.rows import Rule, Target
from jhicache.arg_types import positive_int
from jhicache.bench.clients import median_index
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, make_engine
from jhicache.bench.workload import random_prompts
from jhicache.config import FetchPolicy
from jhicache.engine import Engine

_READ_BLOCK = 16 << 20  # bytes per read() of the disk probe
_PROBE_FILES = 8  # the parallel probe's files, each read by a thread of its own


def drop_page_cache(directory: Path) -> int:
    """Writes every file under `directory` to disk and drops it from the page cache (fsync,
    then POSIX_FADV_DONTNEED: no root needed); returns the files dropped."""
    dropped = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            dropped += 1
    return dropped


def disk_read_rates(directory: Path, nbytes: int) -> dict:
    """The disk's read rate, page cache dropped first: one file read sequentially in 16 MiB
    blocks, and `_PROBE_FILES` files read at once by as many threads (bytes per second)."""
    probe = directory / "disk-probe"
    probe.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 256, _READ_BLOCK, np.uint8).tobytes()
    paths = [probe / f"probe-{i}" for i in range(_PROBE_FILES)]
    per_file = max(nbytes // _PROBE_FILES, _READ_BLOCK)
    try:
        for path in paths:
            with open(path, "wb") as f:
                for _ in range(0, per_file, _READ_BLOCK):
                    f.write(block)
        drop_page_cache(probe)
        start = time.perf_counter()
        read = _read_all(paths[0])
        sequential = read / (time.perf_counter() - start)
        drop_page_cache(probe)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(_PROBE_FILES) as pool:
            read = sum(pool.map(_read_all, paths))
        parallel = read / (time.perf_counter() - start)
        start = time.perf_counter()
        read = _read_all(paths[0])  # again, now from the page cache
        cached = read / (time.perf_counter() - start)
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
        probe.rmdir()
    return {"disk_sequential_read_bps": sequential, "disk_parallel_read_bps": parallel,
            "page_cache_read_bps": cached, "disk_probe_bytes": per_file * _PROBE_FILES,
            "disk_probe_files": _PROBE_FILES}


def _read_all(path: Path) -> int:
    buffer = bytearray(_READ_BLOCK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total


def storage_engine(args: argparse.Namespace, root: Path,
                   store: dict[str, Any] | None = None) -> Engine:
    """Hierarchical, every page written through to host and storage (a directory under `root`,
    or with `store` a Mooncake Store's client config), every storage hit read in full before
    its request runs (or as `--fetch-policy` says); a device pool of four times the prompt and
    two pages."""
    tokens = 4 * (args.storage_hit_prefix + args.storage_hit_turn + 2 * args.page_size)
    through = argparse.Namespace(**{**vars(args), "write_policy": "write_through"})
    threads = {} if args.storage_io_threads is None else {
        "storage_io_threads": args.storage_io_threads}
    return make_engine(through, cache_mode="hierarchical", device_kv_tokens=tokens,
                       load_back_threshold=1, **_backend(root, store),
                       fetch_policy=args.fetch_policy or FetchPolicy.WAIT_COMPLETE.value,
                       fetch_threshold=args.page_size, **threads)


def _backend(root: Path, store: dict[str, Any] | None) -> dict[str, Any]:
    if store is None:
        return {"storage_dir": str(root)}
    return {"storage_backend": "mooncake", "storage_backend_config": json.dumps(store)}


def storage_hit_trial(engine: Engine, rng: np.random.Generator, args: argparse.Namespace,
                      root: Path) -> dict:
    vocab = engine.model_config.vocab_size
    [prefix] = random_prompts(rng, vocab, 1, args.storage_hit_prefix)
    turns = random_prompts(rng, vocab, 3, args.storage_hit_turn)
    recompute_s, _ = ttft_of(engine, prefix + turns[0])  # nothing cached; written through
    start = time.perf_counter()
    engine.flush_cache()  # waits for the backups; device and host tiers empty
    backup_wait_s = time.perf_counter() - start
    dropped = drop_page_cache(root) if root.exists() else 0
    before = engine.stats().as_dict()
    with CompileCounter() as compiles:
        storage_s, out = ttft_of(engine, prefix + turns[1])  # the prefix only on disk
    device_s, _ = ttft_of(engine, prefix + turns[2])  # the prefix now on device
    engine.flush_cache()  # waits for the backups: a split fetch's reads past the meeting point
    measured = stats_delta(engine, before, ("storage_read_bytes", "storage_fetch_read_s",
                                            "storage_fetched_pages", "storage_corrupt_pages",
                                            "storage_truncated_pages", "load_back_s"))
    fetched_bytes = out.storage_hit_tokens * bytes_per_token(engine)
    return {"recompute_ttft_s": recompute_s, "storage_hit_ttft_s": storage_s,
            "device_hit_ttft_s": device_s, "storage_hit_tokens": out.storage_hit_tokens,
            "host_hit_tokens": out.host_hit_tokens, "device_hit_tokens": out.device_hit_tokens,
            "fetched_bytes": fetched_bytes, "files_dropped_from_page_cache": dropped,
            "backup_wait_s": backup_wait_s, **measured,
            "storage_hit_compiles": compiles.count,
            "fetch_read_bps": (measured["engine_storage_read_bytes"]
                               / measured["engine_storage_fetch_read_s"]
                               if measured["engine_storage_fetch_read_s"] else 0.0),
            "storage_hit_over_recompute": storage_s / recompute_s}


def bench_storage_hit(args: argparse.Namespace) -> dict:
    """`--storage-hit-trials` trials after the engine's warm-up and a warm-up trial, each with
    its own prompts; the disk's read rates measured beside them; the trial with the median
    storage-hit TTFT, every trial under "trials"."""
    with tempfile.TemporaryDirectory(dir=args.storage_dir) as directory, \
            contextlib.ExitStack() as stack:
        root = Path(directory)
        store = (None if args.storage_backend == "file"
                 else stack.enter_context(_local_store(args, root)))
        rates: dict[str, float] = {}
        if store is not None:  # the store's own rates first, while it holds nothing else
            page_bytes = args.page_size * args_token_bytes(args)
            pages = args.storage_hit_prefix // args.page_size
            rates = mooncake_local.store_rates(store[1], page_bytes, pages)
        engine = storage_engine(args, root / "storage", None if store is None else store[0])
        # every program compiled, as a server's start does: where a split fetch's compute meets
        # its reads varies from trial to trial, and so do the chunk shapes it runs
        with as_served(engine):
            rng = np.random.default_rng(args.seed + 2)
            storage_hit_trial(engine, rng, args, root / "storage")  # the tier's first use
            trials = [storage_hit_trial(engine, rng, args, root / "storage")
                      for _ in range(args.storage_hit_trials)]
        engine.close(timeout_s=0)
        prefix_bytes = args.storage_hit_prefix * bytes_per_token(engine)
        if store is None:
            rates = disk_read_rates(root, prefix_bytes)
            ceiling = max(rates["disk_sequential_read_bps"], rates["disk_parallel_read_bps"])
        else:
            ceiling = rates["store_get_bps"]
    ttfts = [t["storage_hit_ttft_s"] for t in trials]
    median = median_index(ttfts)
    result = {**trials[median], **rates, "trials": trials, "median_trial": median,
              "storage_backend": args.storage_backend,
              "prefix_tokens": args.storage_hit_prefix, "turn_tokens": args.storage_hit_turn,
              "fetch_policy": FetchPolicy(engine.config.fetch_policy).value,
              "storage_io_threads": engine.config.storage_io_threads,
              "disk_read_ceiling_bps": ceiling}  # (the store's get rate for mooncake)
    result["fetch_read_over_disk"] = result["fetch_read_bps"] / ceiling
    return result


def _local_store(args: argparse.Namespace,
                 root: Path) -> contextlib.AbstractContextManager[tuple[dict[str, Any],
                                                                       mooncake_local.Master]]:
    """A store on this machine holding every prefix the run writes (each trial's, the warm-up
    trial's and the engine warm-up's), so that no put meets a full store."""
    tokens = (args.storage_hit_trials + 3) * (args.storage_hit_prefix + 4 * args.page_size)
    return mooncake_local.local_store(root, tokens * args_token_bytes(args) + (256 << 20))


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--storage-hit-prefix", **sized(count, 8192, 256),
                   help="the prefix tokens found only in the storage tier")
    p.add_argument("--storage-hit-turn", **sized(count, 64, 16), help="new turn tokens")
    p.add_argument("--storage-hit-trials", **sized(count, 7, 1),
                   help="measured trials (after a warm-up one); the figures printed are the "
                        "median trial's by storage-hit TTFT")
    p.add_argument("--storage-backend", choices=("file", "mooncake"), default="file",
                   help="the storage tier: a directory, or a Mooncake Store started on this "
                        "machine (a master and a store service; the store's get rate is then "
                        "the ceiling)")
    p.add_argument("--storage-io-threads", type=positive_int, metavar="N", default=None,
                   help="the storage tier's reader threads, so its reads in flight (unset: the "
                        "engine's own)")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target]:
    """A long prefix (32768 tokens or more) aims at a third of recompute's TTFT and 0.8x of the
    disk's read rate; a shorter one, whose recompute is quick, only at beating recompute."""
    if getattr(args, "storage_backend", "file") == "mooncake":
        return "storage_hit", Target(
            "faster than recompute; read >= 0.8x the store's get rate",
            (Rule("storage_hit_over_recompute", "TTFT", at_most=1.0),
             Rule("fetch_read_over_disk", "read", at_least=0.8)))
    if args.storage_hit_prefix < 32768:
        return "storage_hit", Target("faster than recompute (ratio recorded)", (
            Rule("storage_hit_over_recompute", "TTFT", at_most=1.0),))
    return "storage_hit", Target(
        "TTFT <= 1/3 of recompute; read >= 0.8x the disk's rate",
        (Rule("storage_hit_over_recompute", "TTFT", at_most=0.3333),
         Rule("fetch_read_over_disk", "read", at_least=0.8)))


def main(argv: list[str] | None = None) -> int:
    return cli.main("storage-hit", "storage_hit", __doc__ or "", argv, add_options,
                    lambda args, save: bench_storage_hit(args), tables.storage_hit_table,
                    page_row)


if __name__ == "__main__":
    sys.exit(main())
