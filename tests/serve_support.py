"""Test support for the server: a tiny Qwen2 checkpoint with a BPE tokenizer trained here and a
chat template, and a real uvicorn server on 127.0.0.1 in a thread of the test process
(jhicache.serve.thread)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jhicache.models import init_random, preset_config, save_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jhicache import AsyncEngine, EngineConfig
from jhicache.serve import tokenizer as serve_tokenizer
from jhicache.serve.context import ServerContext
from jhicache.serve.thread import ServerThread

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "a cache keeps what was computed before",
    "hierarchical caches move pages between device and host", "hello world, hello server",
    "naive cafe tea", "streams of tokens become text one piece at a time",
] * 20
ENGINE_CONFIG = EngineConfig(page_size=16, device_kv_tokens=1024, host_kv_tokens=4096,
                             dtype="float32", max_running_requests=8)
POOL_TOKENS = 1024
CONTEXT = 4096
TIMEOUT_S = 120.0  # a test server's clients wait this long for an answer


def train_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE (multi-byte characters outside the corpus stay split into byte
    tokens), saved with a tokenizer_config.json that names the EOS token and the template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / serve_tokenizer.TOKENIZER_FILE))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    (directory / serve_tokenizer.CONFIG_FILE).write_text(json.dumps(config))
    return tok


def write_checkpoint(directory: Path) -> Path:
    """Random tiny Qwen2 weights (untied head: a tied random head echoes its input) whose
    vocabulary is the tokenizer's, and the tokenizer, in one directory."""
    tok = train_tokenizer(directory)
    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False,
                                 vocab_size=tok.get_vocab_size(), max_position_embeddings=CONTEXT)
    save_checkpoint(init_random(config, seed=3), config, directory)
    return directory


def start_server(checkpoint: Path | None, tokenizer: bool = True, process: bool = False,
                 config: EngineConfig = ENGINE_CONFIG, **server: Any) -> ServerThread:
    """A server over the checkpoint (with its tokenizer, or none), or the tiny preset, its engine
    in a thread here or (`process`, as `python -m jhicache.serve` runs it) in a child process;
    `server`: ServerThread's options."""
    if checkpoint is None:
        engine = AsyncEngine.from_preset("tiny", config, process=process)
        ctx = ServerContext.create(engine, None, "tiny", "preset:tiny")
        return ServerThread(ctx, **server).start()
    engine = AsyncEngine.from_pretrained(str(checkpoint), config, process=process)
    tok = serve_tokenizer.Tokenizer.from_dir(checkpoint) if tokenizer else None
    ctx = ServerContext.create(engine, tok, "tiny-test", str(checkpoint))
    return ServerThread(ctx, **server).start()


def metric(http: Any, name: str, missing: float | None = None, **labels: str) -> float:
    """A sample of the server's /metrics (`http` an httpx.Client on it); `missing` when it is
    absent (a labelled counter never incremented)."""
    from prometheus_client.parser import text_string_to_metric_families  # the serve extra's

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    if missing is None:
        raise KeyError(name)
    return missing


def server_fixtures(process: bool) -> tuple[Callable[..., Any], ...]:
    """A server test module's fixtures, each once per module: (checkpoint, server, tok, http,
    client), the server's engine in a thread or (`process`) an engine process. The module
    assigns them to those names (httpx and openai imported only then: the serve extra's)."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return write_checkpoint(tmp_path_factory.mktemp("ckpt"))

    @pytest.fixture(scope="module")
    def server(checkpoint: Path) -> Iterator[ServerThread]:
        srv = start_server(checkpoint, process=process)
        yield srv
        srv.stop()

    @pytest.fixture(scope="module")
    def tok(checkpoint: Path) -> serve_tokenizer.Tokenizer:
        return serve_tokenizer.Tokenizer.from_dir(checkpoint)

    @pytest.fixture(scope="module")
    def http(server: ServerThread) -> Iterator[Any]:
        import httpx

        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
            yield c

    @pytest.fixture(scope="module")
    def client(server: ServerThread) -> Any:
        import openai

        return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                             max_retries=0)

    return checkpoint, server, tok, http, client
