"""HttpBackend: the bench clients' turns sent to a server's POST /generate (SGLang's native API)
and streamed back; also the server's /get_model_info and /flush_cache. Needs httpx."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from jhicache.bench.backends import Chunk, ServerError
from jhicache.sampling import SamplingParams

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a turn's prefill on a loaded server: slow, but not a hang


def generate_body(prompt: Sequence[int], params: SamplingParams) -> dict[str, Any]:
    """POST /generate's body for one turn: token ids, streamed, the sampling params in SGLang's
    names; EOS ignored, so that every answer has the length asked for (as in process, where the
    bench gives the engine no stop tokens)."""
    sampling: dict[str, Any] = {"max_new_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "ignore_eos": True}
    optional = {"top_k": params.top_k, "top_p": params.top_p, "sampling_seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids) or None}
    sampling.update({k: v for k, v in optional.items() if v is not None})
    return {"input_ids": [int(t) for t in prompt], "sampling_params": sampling, "stream": True}


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
                 device_hit_tokens=device, host_hit_tokens=host, engine_ttft_s=None,
                 storage_hit_tokens=storage)


def _json(data: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except json.JSONDecodeError as e:
        raise ServerError(f"a /generate event that is not JSON: {data[:200]!r}") from e
    if not isinstance(payload, dict):
        raise ServerError(f"a /generate event that is not a JSON object: {data[:200]!r}")
    return payload


class HttpBackend:
    """The turns go to a server's POST /generate over one httpx.AsyncClient."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    def together(self) -> contextlib.AbstractContextManager[None]:
        # Nothing tells a server that requests belong together: it gets them as they arrive.
        return contextlib.nullcontext()

    async def stream(self, prompt: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        # request_id is the bench's name for the turn; the server names its requests itself,
        # so that two bench runs against one server never send the same id.
        before: tuple[int, ...] = ()
        finished = False
        try:
            async with self.client.stream("POST", "/generate",
                                          json=generate_body(prompt, params)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise ServerError(f"POST {response.url} answered {response.status_code}: "
                                      f"{text[:500]}")
                async for line in response.aiter_lines():  # read to the end: keep-alive
                    data = line[len("data:"):].strip() if line.startswith("data:") else None
                    if data is None or data == "[DONE]":
                        continue
                    chunk = parse_chunk(_json(data), before)
                    before, finished = chunk.token_ids, chunk.finished
                    yield chunk
        except httpx.HTTPError as e:
            raise ServerError(f"POST {self.client.base_url}/generate failed: {e!r}") from e
        if not finished:
            raise ServerError(f"{request_id}: the /generate stream ended before its last event")


@contextlib.asynccontextmanager
async def http_backend(url: str, connections: int) -> AsyncIterator[HttpBackend]:
    """An HttpBackend for `url` with room for `connections` requests at once (httpx's pool
    would otherwise queue the rest unseen by the server, and the wait count as TTFT)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        yield HttpBackend(client)


def model_info(url: str) -> dict[str, Any]:
    """GET /get_model_info: the served model (pool_tokens and vocab_size where jhicache serves)."""
    return _call("GET", url, "/get_model_info").json()


def serving_compiles(url: str) -> float | None:
    """The server's compiles while serving (its /metrics, `jhicache:compiles_total`); None for
    a server that does not report them (SGLang's)."""
    response = httpx.get(url + "/metrics", timeout=CONNECT_TIMEOUT_S * 6)
    for line in response.text.splitlines() if response.status_code == 200 else ():
        if line.startswith('jhicache:compiles_total{phase="serving"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def flush_cache(url: str) -> None:
    """POST /flush_cache: both tiers emptied (refused while requests run)."""
    _call("POST", url, "/flush_cache")


def _call(method: str, url: str, path: str) -> httpx.Response:
    try:
        response = httpx.request(method, url + path, timeout=CONNECT_TIMEOUT_S * 6)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach the server at {url}: {e!r}") from e
    if response.status_code != 200:
        raise ServerError(f"{method} {url}{path} answered {response.status_code}: "
                          f"{response.text.strip()[:500]}")
    return response
