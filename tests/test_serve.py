"""The real server on 127.0.0.1 (uvicorn in a thread, the engine in a child process, as the
CLI runs it) over a tiny checkpoint with a trained BPE tokenizer: the official openai client,
plain HTTP for /generate, /metrics and /flush_cache, greedy outputs equal to the engine's, cache
hits, stop strings, bad requests, disconnects."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

# The serve extra (`pip install -e '.[test,serve]'`, as `make test` does); the GPU machine's
# preinstalled packages may lack it: skip these tests there rather than fail collection.
for _module in ("fastapi", "uvicorn", "httpx", "openai", "tokenizers", "prometheus_client"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402

from jhicache import Engine, SamplingParams
from jhicache.serve.shutdown import Phase
from jhicache.serve.tokenizer import Tokenizer
from tests.serve_support import (
    ENGINE_CONFIG,
    POOL_TOKENS,
    TIMEOUT_S,
    ServerThread,
    metric,
    server_fixtures,
    start_server,
)

MODEL = "tiny-test"


checkpoint, server, tok, http, client = server_fixtures(process=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Engine:
    """A second engine over the same checkpoint: what the server's outputs must equal."""
    return Engine.from_pretrained(str(checkpoint), ENGINE_CONFIG)


def greedy(reference: Engine, ids: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    params = SamplingParams(max_new_tokens=n, stop_token_ids=stop)
    return reference.generate([ids], params)[0].token_ids


def sse_events(response: httpx.Response) -> list[str]:
    """The data of each event, "[DONE]" included; every non-empty line must be an event."""
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            events.append(line[len("data: "):])
    return events


def busy(server: ServerThread) -> bool:
    """Whether the engine (in its process) has a request running or waiting."""
    occupancy = server.ctx.engine.occupancy()
    return occupancy.running_requests + occupancy.waiting_requests > 0


def finished_requests(server: ServerThread) -> int:
    return server.ctx.engine.stats().finished_requests


def wait_idle(server: ServerThread, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while busy(server):
        assert time.monotonic() < deadline, "the engine still has unfinished requests"
        time.sleep(0.05)


# ---- OpenAI API through the official client ----------------------------------------------

def test_completion_text_prompt_equals_engine_greedy(client: openai.OpenAI, tok: Tokenizer,
                                                     reference: Engine):
    prompt = "the quick brown fox jumps"
    ids = tok.encode(prompt)
    want = greedy(reference, ids, 12, tok.eos_token_ids)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.text == tok.decode(want)
    assert choice.finish_reason == ("length" if len(want) == 12 else "stop")
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
    assert got.model == MODEL and got.object == "text_completion"


def test_completion_token_ids_prompt_and_ignore_eos(client: openai.OpenAI, tok: Tokenizer,
                                                    reference: Engine):
    ids = [7, 50, 120, 33, 200, 9, 41]
    want = greedy(reference, ids, 10)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].model_extra["token_ids"] == want
    assert got.choices[0].text == tok.decode(want)
    assert got.usage.completion_tokens == 10


def test_completion_stream_equals_non_stream(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt="hello world, hello", max_tokens=14, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_and_chat_stream_equal_engine_greedy(client: openai.OpenAI, tok: Tokenizer,
                                                  reference: Engine):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what does a cache keep?"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    want = tok.decode(greedy(reference, ids, 9, tok.eos_token_ids))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                         temperature=0)
    assert got.choices[0].message.content == want
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    assert stream[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_chat_without_max_tokens_is_bounded_by_the_pool(http: httpx.Client):
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "ignore_eos": True, "max_tokens": None}
    got = http.post("/v1/chat/completions", json=body).json()
    usage = got["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == POOL_TOKENS


def test_cached_tokens_on_a_repeated_prompt(client: openai.OpenAI):
    prompt = "hierarchical caches move pages between device and host " * 3  # > 2 pages of 16
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text


def test_stop_string_cuts_text_streamed_or_not(client: openai.OpenAI):
    kwargs = dict(model=MODEL, prompt="streams of tokens become", temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs, max_tokens=24).choices[0].text
    assert len(full) >= 10, full
    stop = full[5:8]
    cut = full[:full.index(stop)]
    got = client.completions.create(**kwargs, max_tokens=24, stop=[stop, "never-seen"])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 24
    chunks = list(client.completions.create(**kwargs, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.5}


def test_penalties_min_tokens_and_min_p_are_applied_on_both_apis(
        client: openai.OpenAI, http: httpx.Client, tok: Tokenizer, reference: Engine):
    """The penalties, min_tokens and min_p reach the engine from /v1/completions,
    /v1/chat/completions and /generate: each answer is the engine's own greedy run with them
    (EOS held back by min_tokens), and the penalties change the plain run's tokens."""
    ids = [7, 50, 120, 33, 200, 9, 41] * 3
    eos = tuple(tok.eos_token_ids)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=eos, min_tokens=10, min_p=0.5,
                            **PENALTIES)
    want = reference.generate([ids], params)[0].token_ids
    assert want != greedy(reference, ids, 12, eos)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={**PENALTIES, "min_tokens": 10, "min_p": 0.5})
    assert got.choices[0].model_extra["token_ids"] == want
    native = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "min_new_tokens": 10, "min_p": 0.5,
        **PENALTIES}}).json()
    assert native["output_ids"] == want
    messages = [{"role": "user", "content": "what does a cache keep?"}]
    chat_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    chat_want = reference.generate([chat_ids], SamplingParams(
        max_new_tokens=9, stop_token_ids=eos, min_tokens=3, **PENALTIES))[0].token_ids
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                          temperature=0, presence_penalty=1.5,
                                          frequency_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5,
                                                      "min_tokens": 3})
    assert chat.choices[0].message.content == tok.decode(
        [t for t in chat_want if t not in eos])


def test_min_tokens_holds_stop_strings_back(client: openai.OpenAI):
    """A stop string is looked for only once min_tokens tokens are out (vLLM's rule): one
    that the plain run meets early is passed over, then met again after them."""
    kwargs = dict(model=MODEL, prompt="streams of tokens become", temperature=0, max_tokens=24)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0]
    stop = full.text[2:5]
    assert full.text.index(stop) < len(full.text) // 2
    held = client.completions.create(**kwargs, stop=[stop], extra_body={
        "ignore_eos": True, "min_tokens": 24}).choices[0]
    assert held.text == full.text and held.finish_reason == "length"
    cut = client.completions.create(**kwargs, stop=[stop], extra_body={
        "ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and len(cut.text) < len(full.text)


# ---- SGLang's native API over plain HTTP -------------------------------------------------

def test_generate_stream_format(http: httpx.Client, reference: Engine, tok: Tokenizer):
    ids = [11, 12, 13, 14, 15, 16]
    want = greedy(reference, ids, 8)
    body = {"input_ids": ids, "stream": True, "lora_path": "", "return_logprob": False,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])  # cumulative
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["output_ids"] == want and last["text"] == tok.decode(want)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert last["meta_info"]["prompt_tokens"] == 6
    assert last["meta_info"]["completion_tokens"] == 8
    assert {"id", "cached_tokens"} <= set(last["meta_info"])
    # the server's and the engine's own TTFT, once the first token is out
    meta = last["meta_info"]
    assert 0 < meta["engine_ttft_s"] <= meta["server_ttft_s"]


def test_generate_text_stop_token_ids(http: httpx.Client, tok: Tokenizer, reference: Engine):
    text = "a cache keeps"
    want = greedy(reference, tok.encode(text), 12)
    stop_id = want[4]
    cut = want[:want.index(stop_id) + 1]
    body = {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                              "stop_token_ids": [stop_id], "ignore_eos": True}}
    got = http.post("/generate", json=body).json()
    assert got["output_ids"] == cut  # the stop token ends the ids, not the text
    assert got["text"] == tok.decode(cut[:-1])
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_metrics_after_requests(http: httpx.Client):
    before = metric(http, "jhicache:time_to_first_token_seconds_count")
    prompt = "the lazy dog sleeps while the quick brown fox jumps over it again"
    for _ in range(2):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        assert http.post("/generate", json=body).status_code == 200
    text = http.get("/metrics").text
    for name in ("jhicache:cache_hit_tokens_total", "jhicache:load_back_bytes_total",
                 "jhicache:load_back_seconds_total", "jhicache:write_back_bytes_total",
                 "jhicache:write_back_seconds_total", "jhicache:pool_occupancy",
                 "jhicache:num_waiting_reqs", "jhicache:num_running_reqs",
                 "jhicache:inter_token_latency_seconds_bucket",
                 "jhicache:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert metric(http, "jhicache:time_to_first_token_seconds_count") == before + 2
    assert metric(http, "jhicache:cache_hit_tokens_total", tier="device") >= 32
    assert metric(http, "jhicache:pool_pages", tier="device") == POOL_TOKENS // 16
    assert metric(http, "jhicache:pool_pages", tier="host") == 4096 // 16
    assert 0 < metric(http, "jhicache:pool_occupancy", tier="device") <= 1
    assert metric(http, "jhicache:num_running_reqs") == 0
    assert metric(http, "jhicache:requests_total", finish_reason="length") >= 2


def test_flush_cache(http: httpx.Client):
    body = {"text": "naive cafe tea " * 6, "sampling_params": {"max_new_tokens": 2}}
    http.post("/generate", json=body)
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200 and "flushed" in flushed.text.lower()
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert metric(http, "jhicache:pool_free_pages", tier="host") <= 4096 // 16


def test_flush_cache_refused_while_a_request_runs(server: ServerThread, http: httpx.Client):
    body = {"input_ids": [5] * 8,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # no step while the block is open: the request, once queued, stays unfinished
        with server.ctx.engine.together():
            reply = pool.submit(http.post, "/generate", json=body)
            deadline = time.monotonic() + TIMEOUT_S
            while not busy(server):
                assert time.monotonic() < deadline and not reply.done()
                time.sleep(0.01)
            assert http.post("/flush_cache").status_code == 400
        assert reply.result().status_code == 200
    wait_idle(server)
    assert http.post("/flush_cache").status_code == 200


def test_health_models_and_model_info(http: httpx.Client, client: openai.OpenAI,
                                      checkpoint: Path, reference: Engine):
    assert http.get("/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(checkpoint) and info["is_generation"] is True
    assert info["tokenizer_path"] == str(checkpoint)
    assert info["vocab_size"] == reference.model_config.vocab_size


# ---- concurrency, disconnects, bad requests ------------------------------------------------

def test_concurrent_streams_equal_engine_greedy(server: ServerThread, reference: Engine):
    prompts = [[(3 * i + j) % 300 + 3 for j in range(5 + 7 * i)] for i in range(5)]
    wants = [greedy(reference, p, 6 + i) for i, p in enumerate(prompts)]

    def run(i: int) -> list[int]:
        body = {"input_ids": prompts[i], "stream": True,
                "sampling_params": {"max_new_tokens": 6 + i, "temperature": 0,
                                    "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
            with c.stream("POST", "/generate", json=body) as response:
                events = sse_events(response)
        return json.loads(events[-2])["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(run, range(len(prompts)))) == wants


def wait_for_abort(http: httpx.Client, aborted: float, timeout_s: float = 30.0) -> None:
    """Until the server has counted one more aborted request than `aborted`."""
    deadline = time.monotonic() + timeout_s
    while metric(http, "jhicache:requests_total", missing=0.0, finish_reason="abort") <= aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_aborts(server: ServerThread, http: httpx.Client):
    body = {"prompt": [9] * 8, "max_tokens": POOL_TOKENS - 8, "stream": True,
            "ignore_eos": True}
    # The engine process runs ahead of this process: on a loaded machine the tiny model can
    # finish all its tokens before the hold below arrives. Then the request is sent again.
    for _ in range(20):
        aborted = metric(http, "jhicache:requests_total", missing=0.0, finish_reason="abort")
        finished = finished_requests(server)
        with contextlib.ExitStack() as stack:  # the hold, closed last
            with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
                with c.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    next(response.iter_lines())  # (its first text may need more than a step)
                    stack.enter_context(server.ctx.engine.together())  # no step: it cannot
                    running = busy(server)  # finish meanwhile
            if running:  # leaving the client closed the connection mid-stream
                wait_for_abort(http, aborted)
        if running:
            break
    assert running
    wait_idle(server)
    assert finished_requests(server) == finished  # it never ended
    assert http.post("/generate", json={"input_ids": [1, 2, 3]}).status_code == 200


def test_client_disconnect_before_a_plain_response_aborts(server: ServerThread,
                                                          http: httpx.Client):
    body = {"input_ids": [4] * 8,
            "sampling_params": {"max_new_tokens": POOL_TOKENS - 8, "ignore_eos": True}}

    def impatient() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/generate", json=body, timeout=httpx.Timeout(5.0, read=0.5))

    for _ in range(5):
        aborted = metric(http, "jhicache:requests_total", missing=0.0, finish_reason="abort")
        finished = finished_requests(server)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            client = pool.submit(impatient)
            while not busy(server) and not client.done():
                time.sleep(0.01)
            with server.ctx.engine.together():  # no step until the client has given up
                running = busy(server)
                client.result()
                if running:
                    wait_for_abort(http, aborted)
        if running:
            break
    assert running
    wait_idle(server)
    assert finished_requests(server) == finished
    assert http.get("/health").status_code == 200


BAD = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": ["x", "y"]}, "prompt"),
    ("/v1/completions", {"prompt": [1] * (POOL_TOKENS + 10), "max_tokens": 4}, None),
    ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 4}, None),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, None),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b " * 600}]}, "messages"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"input_ids": [1] * 2000}, None),
]


# fields the server does not implement: refused, naming the field, never ignored
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
UNIMPLEMENTED = [
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "tools": []}, "tools"),
    ("/v1/completions", {"prompt": "x", "regex": "a+"}, "regex"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"a": "b"}}, "metadata"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi",
                                                    "name": "ann"}]}, "messages.0.name"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{}"}},
     "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"5": 1.0}}},
     "sampling_params.logit_bias"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "sampling_params.min_new_tokens"),
    ("/generate", {"text": "x", "lora_path": "adapter"}, "lora_path"),
    ("/generate", {"text": "x", "image_data": "x.png"}, "image_data"),
]


@pytest.mark.parametrize("path, body, field", UNIMPLEMENTED,
                         ids=[f"{path}-{field}" for path, _, field in UNIMPLEMENTED])
def test_fields_the_server_does_not_implement_are_refused_by_name(
        http: httpx.Client, path: str, body: dict, field: str):
    """The message names the field (nested ones by their path), `param` its top-level one."""
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field.split(".")[0] and field in error["message"], error


def test_tool_and_format_fields_asking_for_what_the_server_does_are_accepted(
        http: httpx.Client):
    for extra in ({"tools": [], "tool_choice": "none"}, {"tool_choice": "auto"},
                  {"response_format": {"type": "text"}}):
        assert http.post("/v1/chat/completions", json={**CHAT, **extra}).status_code == 200
    assert http.post("/generate", json={"text": "x", "lora_path": ""}).status_code == 200


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_requests_get_openai_style_400(http: httpx.Client, path: str, body: object,
                                           param: str | None):
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    # the server keeps serving, with nothing left queued
    ok = http.post("/generate",
                   json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_bad_requests_name_the_limit(http: httpx.Client):
    pool = http.post("/v1/completions", json={"prompt": [1] * (POOL_TOKENS + 10)}).json()
    assert "device pool" in pool["error"]["message"]
    context = http.post("/v1/completions", json={"prompt": [1] * 5000}).json()
    assert "context" in context["error"]["message"]


def test_server_without_tokenizer_takes_token_ids_only(checkpoint: Path):
    srv = start_server(checkpoint, tokenizer=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as c:
            for path, body in [("/v1/completions", {"prompt": "hello"}),
                               ("/generate", {"text": "hello"}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]})]:
                response = c.post(path, json=body)
                assert response.status_code == 400
                assert "token-id prompts only" in response.json()["error"]["message"]
            got = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}).json()
            assert len(got["choices"][0]["token_ids"]) == 3 and got["choices"][0]["text"] == ""
    finally:
        srv.stop()


def test_a_text_that_is_not_unicode_gets_a_400_with_the_json_error_body(
        server: ServerThread) -> None:
    """A lone surrogate, which JSON's escapes carry, is refused by name, not a 500."""
    for path, body in (("/v1/completions", {"prompt": "t5 \ud800", "max_tokens": 2}),
                       ("/generate", {"text": "t5 \ud800"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "t5 \ud800"}]})):
        r = httpx.post(server.url + path, content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "not valid Unicode" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_text_is_tokenized_off_the_event_loop(server: ServerThread,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.ctx.tokenizer
    assert tokenizer is not None
    threads: list[threading.Thread] = []
    encode = tokenizer.encode

    def recorded(text: str, add_special_tokens: bool = True,
                 limit: int | None = None) -> list[int]:
        threads.append(threading.current_thread())
        return encode(text, add_special_tokens, limit)

    monkeypatch.setattr(tokenizer, "encode", recorded)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200 and threads
    assert all(t is not server.thread for t in threads)  # the event loop runs on server.thread


def test_a_stop_lets_the_requests_in_flight_finish_and_refuses_new_ones(checkpoint: Path):
    """A stop (Ctrl-C's) with time enough: the requests in flight, streamed and not, run to
    their end; a request sent meanwhile, /health included, gets a JSON 503 naming the
    shutdown."""
    srv = start_server(checkpoint, shutdown_timeout=120)
    body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    ends: list[str | None] = []
    streaming = threading.Event()

    def one(stream: bool) -> None:
        if not stream:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
            ends.append(r.json()["choices"][0]["finish_reason"] if r.status_code == 200
                        else r.text)
            return
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT_S,
                          json={**body, "stream": True}) as r:
            events = []
            for event in sse_events(r):
                events.append(event)
                streaming.set()
        ends.append(json.loads(events[-2])["choices"][0]["finish_reason"]
                    if events[-1] == "[DONE]" else str(events))

    clients = [threading.Thread(target=one, args=(i % 2 == 0,)) for i in range(6)]
    stopper = threading.Thread(target=srv.stop)
    try:
        for t in clients:
            t.start()
        assert streaming.wait(TIMEOUT_S)
        stopper.start()
        deadline = time.monotonic() + 30
        while srv.drain.phase is Phase.SERVING and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = [httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT_S),
                   httpx.get(srv.url + "/health", timeout=TIMEOUT_S)]
        for t in clients:
            t.join(TIMEOUT_S)
    finally:
        if stopper.ident is None:  # failed before the stop
            srv.stop()
        else:
            stopper.join(TIMEOUT_S)
    assert ends == ["length"] * 6
    for r in refused:
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text


def test_a_body_over_the_limit_gets_a_413_before_it_is_read(checkpoint: Path) -> None:
    srv = start_server(checkpoint, max_request_bytes=1000)
    try:
        big = {"prompt": "hello " * 400, "max_tokens": 1}
        r = httpx.post(srv.url + "/v1/completions", json=big, timeout=60)  # Content-Length
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunks = iter([json.dumps(big).encode()[i:i + 300] for i in range(0, 2500, 300)])
        r = httpx.post(srv.url + "/v1/completions", content=chunks,  # chunked: no length
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413
        small = httpx.post(srv.url + "/v1/completions",
                           json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        assert small.status_code == 200
    finally:
        srv.stop()


def test_a_restarted_server_serves_a_prefix_from_storage(checkpoint: Path,
                                                          tmp_path: Path) -> None:
    """A server with a storage directory, stopped and started again: the same prompt's pages
    come from storage (cached_tokens_details and /metrics say so), with the same tokens; a
    flush keeps them, /clear_hicache_storage_backend deletes them."""
    config = dataclasses.replace(ENGINE_CONFIG, storage_dir=str(tmp_path),
                                 write_policy="write_through", fetch_threshold=16,
                                 fetch_policy="wait_complete")
    body = {"input_ids": list(range(3, 103)),
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    replies = []
    for restart in (False, True):
        srv = start_server(checkpoint, config=config)
        try:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as c:
                replies.append(c.post("/generate", json=body).json())
                hits = metric(c, "jhicache:cache_hit_tokens_total", tier="storage")
                full = metric(c, "jhicache:storage_fetches_total", outcome="full")
                assert metric(c, "jhicache:storage_write_failures_total",
                              reason="no_space") == 0
                assert c.post("/flush_cache").status_code == 200  # it waits for the backups
                assert metric(c, "jhicache:storage_bytes") > 0  # a flush keeps storage
                if restart:
                    assert c.post("/clear_hicache_storage_backend").status_code == 200
                    assert metric(c, "jhicache:storage_bytes") == 0
        finally:
            srv.stop()
    assert replies[0]["output_ids"] == replies[1]["output_ids"]
    details = [r["meta_info"]["cached_tokens_details"] for r in replies]
    assert details[0]["storage"] == 0 and details[1] == {"device": 0, "host": 0, "storage": 96}
    assert replies[1]["meta_info"]["cached_tokens"] == 96  # 6 whole pages; the last token left
    assert (hits, full) == (96, 1)
