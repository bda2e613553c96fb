"""Test support for the server: a tiny Qwen2 checkpoint with a BPE tokenizer trained here and a
chat template, and a real uvicorn server on 127.0.0.1 in a thread of the test process."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import uvicorn
from jhicache.models import init_random, preset_config, save_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jhicache import AsyncEngine, Engine, EngineConfig
from jhicache.serve import tokenizer as serve_tokenizer
from jhicache.serve.app import build_app
from jhicache.serve.context import ServerContext

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
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


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ServerThread:
    """uvicorn serving `ctx` on a free port of 127.0.0.1 from a thread; `stop()` shuts it down
    (which closes the engine, as the command's server does)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._sock = free_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(ctx), log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(60)
        self._sock.close()


def start_server(checkpoint: Path | None, tokenizer: bool = True) -> ServerThread:
    """A server over the checkpoint (with its tokenizer, or none), or the tiny preset."""
    if checkpoint is None:
        engine = AsyncEngine(Engine.from_preset("tiny", ENGINE_CONFIG))
        return ServerThread(ServerContext.create(engine, None, "tiny", "preset:tiny")).start()
    engine = AsyncEngine(Engine.from_pretrained(str(checkpoint), ENGINE_CONFIG))
    tok = serve_tokenizer.Tokenizer.from_dir(checkpoint) if tokenizer else None
    return ServerThread(ServerContext.create(engine, tok, "tiny-test", str(checkpoint))).start()
