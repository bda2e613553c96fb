"""HttpBackend: the bench clients' turns sent to a server's POST /generate (SGLang's native API)
and streamed back; also the server's /get_model_info, /metrics and /flush_cache. Needs aiohttp
(SGLang's serving benchmark's client): the clients' own time per request counts in the latency
they measure, and httpx's took several times as long (benchmarks/LOG.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp.http_exceptions import HttpProcessingError

from jhicache.bench.backends import Chunk, ServerError
from jhicache.sampling import SamplingParams

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a turn's prefill on a loaded server: slow, but not a hang
LINE_BYTES = 1 << 20  # aiohttp's read buffer: events up to twice it (its default: 128 KiB)
JSON_HEADERS = {"content-type": "application/json"}


def generate_body(prompt: Sequence[int], params: SamplingParams) -> bytes:
    """POST /generate's body for one turn: token ids, streamed, the sampling params in SGLang's
    names; EOS ignored, so that every answer has the length asked for (as in process, where the
    bench gives the engine no stop tokens)."""
    sampling: dict[str, Any] = {"max_new_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "ignore_eos": True}
    optional = {"top_k": params.top_k, "top_p": params.top_p, "sampling_seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids) or None,
                "presence_penalty": params.presence_penalty or None,
                "frequency_penalty": params.frequency_penalty or None,
                "repetition_penalty": (None if params.repetition_penalty == 1
                                       else params.repetition_penalty)}
    sampling.update({k: v for k, v in optional.items() if v is not None})
    body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
    return msgspec.json.encode(body)  # the bench's prompts are lists of Python ints


def parse_chunk(payload: dict[str, Any], before: tuple[int, ...]) -> Chunk:
    """One `data:` event of the stream; `before` is the previous event's output_ids (the
    server sends them cumulatively)."""
    if "error" in payload:
        raise ServerError(f"the server ended the stream with an error: {payload['error']}")
    try:
        ids, meta = tuple(payload["output_ids"]), payload["meta_info"]
        prompt_len = meta["prompt_tokens"]
    except (KeyError, TypeError) as e:
        raise ServerError(f"a /generate event without output_ids or meta_info: {payload}") from e
    if ids[:len(before)] != before:
        raise ServerError("a /generate event whose output_ids do not extend the last event's")
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict) and {"device", "host"} <= details.keys():
        device, host = details["device"], details["host"]
        storage = details.get("storage", 0)
    else:  # a server that reports no split (SGLang): its cached tokens count as device hits
        device, host, storage = meta.get("cached_tokens", 0), 0, 0
    return Chunk(new_token_ids=ids[len(before):], token_ids=ids,
                 finished=meta.get("finish_reason") is not None, prompt_len=prompt_len,
                 device_hit_tokens=device, host_hit_tokens=host,
                 engine_ttft_s=meta.get("engine_ttft_s"), storage_hit_tokens=storage,
                 server_ttft_s=meta.get("server_ttft_s"))


def _json(data: bytes, what: str = "a /generate event") -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServerError(f"{what} that is not JSON: {data[:200]!r}") from e
    if not isinstance(payload, dict):
        raise ServerError(f"{what} that is not a JSON object: {data[:200]!r}")
    return payload


class HttpBackend:
    """The turns go to a server's POST /generate over one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url

    def together(self) -> contextlib.AbstractContextManager[None]:
        # Nothing tells a server that requests belong together: it gets them as they arrive.
        return contextlib.nullcontext()

    async def stream(self, prompt: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        # request_id is the bench's name for the turn; the server names its requests itself,
        # so that two bench runs against one server never send the same id.
        before: tuple[int, ...] = ()
        finished = False
        url = self.url + "/generate"
        try:
            async with self.session.post(url, data=generate_body(prompt, params),
                                         headers=JSON_HEADERS) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    raise ServerError(f"POST {url} answered {response.status}: {text[:500]}")
                async for line in response.content:  # read to the end: keep-alive
                    data = line[len(b"data:"):].strip() if line.startswith(b"data:") else None
                    if data is None or data == b"[DONE]":
                        continue
                    chunk = parse_chunk(_json(data), before)
                    before, finished = chunk.token_ids, chunk.finished
                    yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ServerError(f"POST {url} failed: {e!r}") from e
        except (ValueError, HttpProcessingError) as e:  # a line past twice the read buffer
            raise ServerError(f"POST {url}: an event too long to read ({e!r})") from e
        if not finished:
            raise ServerError(f"{request_id}: the /generate stream ended before its last event")


@contextlib.asynccontextmanager
async def http_backend(url: str, connections: int) -> AsyncIterator[HttpBackend]:
    """An HttpBackend for `url` with room for `connections` requests at once (fewer would
    queue the rest unseen by the server, and the wait count as TTFT)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                    sock_read=READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     read_bufsize=LINE_BYTES) as session:
        yield HttpBackend(session, url.rstrip("/"))


def model_info(url: str) -> dict[str, Any]:
    """GET /get_model_info: the served model (pool_tokens and vocab_size where jhicache serves)."""
    return _json(_call("GET", url, "/get_model_info"), "an answer of /get_model_info")


def serving_compiles(url: str) -> float | None:
    """The server's compiles while serving (its /metrics, `jhicache:compiles_total`); None for
    a server that does not report them (SGLang's)."""
    status, body = _fetch("GET", url, "/metrics")
    for line in body.decode(errors="replace").splitlines() if status == 200 else ():
        if line.startswith('jhicache:compiles_total{phase="serving"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def flush_cache(url: str) -> None:
    """POST /flush_cache: both tiers emptied (refused while requests run)."""
    _call("POST", url, "/flush_cache")


def _call(method: str, url: str, path: str) -> bytes:
    """The body of a request that must answer 200."""
    status, body = _fetch(method, url, path)
    if status != 200:
        raise ServerError(f"{method} {url}{path} answered {status}: "
                          f"{body.decode(errors='replace').strip()[:500]}")
    return body


def _fetch(method: str, url: str, path: str) -> tuple[int, bytes]:
    """One request from synchronous code: its status and body."""
    async def fetch() -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S * 6)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.request(method, url.rstrip("/") + path) as response:
                return response.status, await response.read()

    try:
        return asyncio.run(fetch())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ServerError(f"cannot reach the server at {url}: {e!r}") from e
