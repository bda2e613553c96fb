"""The bench's engines: their EngineConfig from the command line, from a preset or weights."""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Iterator

from jhicache.async_engine import AsyncEngine
from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.engine_process import EngineSpec
from jhicache.warmup import freeze_heap


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, dtype=args.dtype, write_policy=args.write_policy,
                        max_running_requests=args.max_running_requests,
                        chunked_prefill_tokens=args.chunked_prefill_tokens, **overrides)


def engine_spec(args: argparse.Namespace, **overrides) -> EngineSpec:
    """How to build the bench's engine, here or in an engine process."""
    if overrides.get("device_kv_tokens"):  # pools hold whole pages: round a derived size up
        tokens, page = overrides["device_kv_tokens"], args.page_size
        overrides["device_kv_tokens"] = -(-tokens // page) * page
    config = engine_config(args, **overrides)
    if args.weights:
        return EngineSpec(config, path=args.weights)
    return EngineSpec(config, preset=args.preset, seed=args.seed)


def make_engine(args: argparse.Namespace, **overrides) -> Engine:
    return engine_spec(args, **overrides).build()


@contextlib.contextmanager
def as_served(engine: Engine | None = None) -> Iterator[None]:
    """The block runs as a server's engine does after its start: `engine` warmed up (every
    program compiled) and this process's heap frozen (`warmup.freeze_heap`), so that the
    collections a measured run meets walk what it makes, not the startup heap. The
    collector is given back as it was at the end: the bench goes on to build other engines,
    whose predecessors must be collectable. Without `engine`: the heap frozen alone (a process
    whose engine runs in another)."""
    thresholds = gc.get_threshold()
    if engine is not None:
        engine.warmup(progress=False, freeze_heap=True)
    else:
        freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def warm_up_served(engine: AsyncEngine) -> None:
    """`engine`'s warm-up, as a server's start runs it (the heap frozen at its end), waited
    for; RuntimeError if its engine process stops meanwhile."""
    engine.start_warmup(progress=False, freeze_heap=True)
    while not engine.is_ready:
        if not engine.is_running:
            raise RuntimeError(f"the engine process stopped: {engine.error}")
        time.sleep(0.05)
