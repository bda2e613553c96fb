"""LongTexts: a child process that tokenizes long texts, so that the server's interpreter lock is
never held for long by one.

`tokenizers`' `encode_batch` releases the lock while it tokenizes, but what it returns holds it:
building the list of a long text's ids, and above all freeing its `Encoding` (a string per
token), which for a 7 MB text (4M tokens) held it 0.1-0.25 s and 0.4-1 s on the 2-core box,
while every other request, `/health` included, waited. Here that work happens in the child;
the parent gets the count of the tokens, then, if it is within the caller's limit, their ids as
one bytes object (int32).
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import numpy as np
import tokenizers

# Longer texts are tokenized by `LongTexts` (about 64K tokens and more: freeing the `Encoding`
# of a shorter one takes a few milliseconds)
LONG_TEXT_CHARS = 1 << 18


class TokenCountError(ValueError):
    """A text with more tokens than the caller's limit: `tokens` is its count."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the text has {tokens} tokens, over the limit of {limit}")
        self.tokens = tokens


class TokenizerProcessError(RuntimeError):
    """The tokenizing process died while it had a text (the next call starts another)."""


class LongTexts:
    """Tokenizes with `backend` in a child process (started at the first call, again after it
    died): one text at a time, from any thread (each call blocks its thread, not the others'
    interpreter lock). `close()` ends the child; it also ends when this process does (it reads
    nothing more from its pipe)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def encode(self, text: str, add_special_tokens: bool, limit: int | None) -> list[int]:
        """The token ids of `text`; `TokenCountError` (their list never built) over `limit`,
        `TokenizerProcessError` if the child died meanwhile."""
        with self._lock:
            conn = self._started()
            try:
                conn.send((text, add_special_tokens, limit))
                tokens = conn.recv()
                data = conn.recv_bytes() if limit is None or tokens <= limit else b""
            except (EOFError, OSError) as e:
                self._stop()
                raise TokenizerProcessError(f"the tokenizing process ended ({e!r})") from None
        if limit is not None and tokens > limit:
            raise TokenCountError(tokens, limit)
        return np.frombuffer(data, np.int32).tolist()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self) -> Connection:
        if self._process is None or self._conn is None or not self._process.is_alive():
            self._stop()
            context = multiprocessing.get_context("spawn")  # a server's threads and JAX: no fork
            ours, theirs = context.Pipe()
            self._process = context.Process(target=_tokenize, name="jhicache-tokenizer",
                                            args=(theirs, self._backend.to_str()), daemon=True)
            self._process.start()
            theirs.close()
            self._conn = ours
        return self._conn

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the child reads EOF and returns
        if self._process is not None:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = self._conn = None


def _tokenize(conn: Connection, backend_json: str) -> None:
    """The child: (text, add_special_tokens, limit) in; out the count of its tokens, then, unless
    it is over the limit, their ids as int32 bytes; until EOF."""
    backend = tokenizers.Tokenizer.from_str(backend_json)
    while True:
        try:
            text, add_special_tokens, limit = conn.recv()
        except (EOFError, OSError):
            return
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        try:
            conn.send(len(encoding))
            if limit is None or len(encoding) <= limit:
                conn.send_bytes(np.asarray(encoding.ids, np.int32).tobytes())
        except OSError:  # the parent has gone
            return
