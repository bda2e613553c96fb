"""The bench's engines: their EngineConfig from the command line, from a preset or weights."""

from __future__ import annotations

import argparse

from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.engine_process import EngineSpec


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
