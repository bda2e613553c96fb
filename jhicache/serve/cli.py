"""The `python -m jhicache.serve` command line: flags (the engine's generated from EngineConfig's
fields and docstring), building the engine and tokenizer, and running uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import re
import signal
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jhicache.arg_types import (
    Given,
    non_negative_float,
    non_negative_int,
    positive_int,
    text_or_file,
)
from jhicache.config import EngineConfig

DEFAULT_PORT = 30000  # SGLang's
# jhicache.models.PRESETS' names, spelt out: importing the models loads JAX, which --help avoids
PRESET_NAMES = ("tiny", "tiny-tp", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b",
                "tiny-qwen3", "qwen3-0.6b", "qwen3-8b", "tiny-llama3", "llama3-8b")
logger = logging.getLogger("jhicache.serve")


def _field_docs() -> dict[str, str]:
    """EngineConfig's "Attributes:" entries, name -> text (continuation lines joined)."""
    doc = EngineConfig.__doc__ or ""
    section = doc.split("Attributes:", 1)[-1]
    docs: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(r"^\s{2,6}(\w+): (.*)$", line)
        if entry and entry.group(1) in {f.name for f in dataclasses.fields(EngineConfig)}:
            name = entry.group(1)
            docs[name] = entry.group(2).strip()
        elif name and line.strip():
            docs[name] += " " + line.strip()
    return docs


def _parser_type(hint: Any) -> tuple[Callable[[str], Any] | None, list[str] | None]:
    """An argparse type (None for a bool) and the choices, for one EngineConfig field's type:
    `int | None` parses an int, an enum (or `Enum | str`) offers its values."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    members = tuple(m for m in members if m is not type(None))
    enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
    if enums:
        return str, [m.value for m in enums[0]]
    if members == (bool,):
        return None, None
    return members[0], None


def _storage_field(name: str) -> bool:
    """Whether a field matters only with a storage tier: the storage_ and fetch_ fields but
    storage_dir itself (storage_backend "mooncake" makes a tier: `parse_args` asks the
    config)."""
    return name.startswith(("storage_", "fetch_")) and name != "storage_dir"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--page-size` for page_size), its help from the docs;
    a field that is a dataclass of its own (`transfer_tuning`), one per field of that
    (`--transfer-tuning-load-head-bytes`). EngineConfig itself checks their values
    (`parse_args`); the storage tier's flags record that they were given (`args.given`), for
    `parse_args` to refuse them without a storage tier."""
    parser.set_defaults(given=frozenset())
    group = parser.add_argument_group("engine (EngineConfig fields)")
    hints, docs = typing.get_type_hints(EngineConfig), _field_docs()
    for field in dataclasses.fields(EngineConfig):
        nested = _nested(field)
        if nested is not None:
            for sub in dataclasses.fields(nested):
                default = getattr(nested, sub.name)
                group.add_argument(_flag(field.name, sub.name), type=type(default), default=default,
                                   dest=f"{field.name}__{sub.name}",
                                   help=f"{type(nested).__name__}.{sub.name} (default: "
                                        f"{default})")
            continue
        flag = _flag(field.name)
        kind, choices = _parser_type(hints[field.name])
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        shown = "unset" if default is None else default
        help_text = f"{docs.get(field.name, field.name)} (default: {shown})"
        if kind is None:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text.replace("%", "%%"))
        else:
            action = Given if _storage_field(field.name) else "store"
            group.add_argument(flag, type=kind, choices=choices, default=default, action=action,
                               help=help_text.replace("%", "%%"))


def _flag(*names: str) -> str:
    return "--" + "-".join(names).replace("_", "-")


def _nested(field: dataclasses.Field[Any]) -> Any:
    """A field's default where it is a dataclass of its own (its fields get flags), else
    None."""
    default = field.default
    return default if dataclasses.is_dataclass(default) and not isinstance(default, type) else None


def _flag_names(message: str) -> str:
    """An EngineConfig (or TransferTuning) error with each field named as its flag:
    `EngineConfig.page_size` and `page_size` become `--page-size`."""
    message = re.sub(r"TransferTuning\.(\w+)", lambda m: _flag("transfer_tuning", m.group(1)),
                     message)
    for field in dataclasses.fields(EngineConfig):
        bare = r"\b" if "_" in field.name else r"(?!)"  # "dtype" alone may be prose
        message = re.sub(rf"EngineConfig\.{field.name}\b|{bare}{field.name}\b",
                         _flag(field.name), message)
    return message


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(EngineConfig):
        nested = _nested(field)
        if nested is not None:  # its fields' flags, gathered
            values[field.name] = dataclasses.replace(
                nested, **{sub.name: getattr(args, f"{field.name}__{sub.name}")
                           for sub in dataclasses.fields(nested)})
        else:
            values[field.name] = getattr(args, field.name)
    text = values.get("storage_backend_config")
    if isinstance(text, str):
        try:
            values["storage_backend_config"] = text_or_file(text)
        except ValueError as e:
            raise ValueError(f"--storage-backend-config {e}") from e
    return EngineConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jhicache.serve",
        description="An HTTP server over jhicache's engine: OpenAI's /v1/completions, "
                    "/v1/chat/completions and /v1/models, SGLang's /generate, /flush_cache, "
                    "/health and /get_model_info, and Prometheus' /metrics.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR",
                        help="a Hugging Face checkpoint directory of Qwen2, Qwen3 or Llama 3 "
                             "(config.json and safetensors); its tokenizer.json is used when "
                             "there is one")
    source.add_argument("--preset", metavar="NAME",
                        help=f"random weights of a preset shape ({', '.join(PRESET_NAMES)}); "
                             "token-id prompts only, unless --tokenizer is given")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="a directory with tokenizer.json (and tokenizer_config.json with "
                             "the chat template); default: the --model directory")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model name that /v1/models lists and responses carry "
                             "(default: the directory's name, or the preset's)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of a preset's random weights")
    parser.add_argument("--admin-api-key", metavar="KEY", default=None,
                        help="the bearer token the storage tier's admin routes "
                             "(/hicache/storage-backend) need; unset: they are open")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                        help="port to listen on")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="log level (info logs one line per request)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", metavar="DIR", default=default_compilation_cache(),
                       help="JAX's persistent compilation cache: the programs the warm-up "
                            "compiles are written there and read back by later starts, which "
                            "then skip those compiles (default: %(default)s)")
    cache.add_argument("--no-compilation-cache", action="store_true",
                       help="compile every program at each start")
    # app.DEFAULT_MAX_REQUEST_BYTES, spelt out: importing the app loads FastAPI, which --help avoids
    parser.add_argument("--max-request-bytes", type=positive_int, default=8 << 20,
                        help="request bodies larger than this are refused with 413, before "
                             "they are read whole (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                        help="seconds a shutdown (Ctrl-C, SIGTERM) waits for the requests in "
                             "flight, new ones refused with 503, before it ends them with a "
                             "503 (or a stream's error event); a second Ctrl-C or SIGTERM ends "
                             "them at once (default: %(default)s)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="step the engine in a child process of its own, so that HTTP and "
                             "text work never hold up a step (--no-engine-process: in a thread "
                             "of the server's process)")
    add_engine_flags(parser)
    return parser


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port from 1 to 65535")
    return value


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """The flags and the engine's config; a bad value, or a storage flag without a storage
    tier, exits with argparse's usage error (status 2) naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config(args)
    except ValueError as e:
        parser.error(_flag_names(str(e)))
    stray = sorted(flag for flag in args.given if _storage_field(flag[2:].replace("-", "_")))
    if stray and not config.storage_enabled:
        parser.error(f"{', '.join(stray)}: {'they set' if len(stray) > 1 else 'it sets'} the "
                     f"storage tier, which is off without --storage-dir (or --storage-backend "
                     f"mooncake)")
    return args, config


def default_compilation_cache() -> str:
    """A per-user cache directory (XDG's), as JAX engines keep theirs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jhicache", "jax-compilation")


def _tokenizer_dir(args: argparse.Namespace) -> str | None:
    from jhicache.serve.tokenizer import has_tokenizer

    if args.tokenizer:
        return args.tokenizer
    return args.model if args.model and has_tokenizer(args.model) else None


def main(argv: Sequence[str] | None = None) -> None:
    """The command: exits 0 once stopped by Ctrl-C or SIGTERM (at any moment: starting, warming
    up, serving or draining), 1 when the engine failed (to start, to warm up, or while
    serving), 2 for bad flags, 3 when uvicorn cannot listen (the port is taken)."""
    args, config = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM ends a start as Ctrl-C does (uvicorn takes both over while it serves)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _serve(args, config)
    except KeyboardInterrupt:
        logger.info("stopped while starting")


def _serve(args: argparse.Namespace, config: EngineConfig) -> None:
    # Imported here, so that --help and bad flags answer without loading JAX.
    import uvicorn

    from jhicache.async_engine import AsyncEngine
    from jhicache.engine_process import EngineProcessError, EngineSpec
    from jhicache.serve.app import build_app
    from jhicache.serve.context import ServerContext
    from jhicache.serve.shutdown import CONNECTIONS_GRACE_S, Drain, DrainingServer
    from jhicache.serve.tokenizer import Tokenizer

    cache_dir = None if args.no_compilation_cache else args.compilation_cache
    tokenizer_dir = _tokenizer_dir(args)
    tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
    spec = EngineSpec(config, path=args.model, preset=None if args.model else args.preset,
                      seed=args.seed, compilation_cache=cache_dir, log_level=args.log_level)
    # the engine (and JAX's compilation cache) set up in a child process, or here
    try:
        engine = (AsyncEngine(spec) if args.engine_process
              else AsyncEngine(spec.build(), owns_engine=True))
    except EngineProcessError as e:
        logger.error("%s", e)
        sys.exit(1)
    if args.model:
        name, path = Path(args.model).resolve().name, args.model
    else:
        name, path = args.preset, f"preset:{args.preset}"
    try:
        ctx = ServerContext.create(engine, tokenizer, args.served_model_name or name, path)
    except BaseException:
        engine.close(timeout=5.0)
        raise
    logger.info("serving %s (%s) on http://%s:%d; tokenizer: %s; /health answers 503 until "
                "the warm-up has compiled every program", ctx.model.name, path, args.host,
                args.port, tokenizer_dir or "none (token-id prompts only)")
    drain = Drain(engine, args.shutdown_timeout)
    app = build_app(ctx, drain, warmup=True, max_request_bytes=args.max_request_bytes,
                    admin_api_key=args.admin_api_key)
    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=CONNECTIONS_GRACE_S), drain)

    def stopped() -> None:  # a failed engine ends the server, which exits non-zero
        if engine.error is not None:
            server.should_exit = True

    engine.when_stopped(stopped)
    server.run()
    if engine.error is not None:
        logger.error("the engine stopped: %s", engine.error.__cause__ or engine.error)
        sys.exit(1)
