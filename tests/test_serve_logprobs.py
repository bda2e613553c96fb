"""Log probabilities through the server: /v1/completions and /v1/chat/completions with the
official openai client (streamed and not), SGLang's /generate `return_logprob`, echo, and the
fields the server refuses with a 400 naming them rather than ignoring them."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "openai", "tokenizers"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402

from jhicache import Engine, SamplingParams  # noqa: E402
from jhicache.logprobs import TokenLogprob  # noqa: E402
from jhicache.serve import openai_routes  # noqa: E402
from jhicache.serve.logprobs import CompletionLogprobs  # noqa: E402
from jhicache.serve.tokenizer import Tokenizer  # noqa: E402
from tests.delivery import one_at_a_time  # noqa: E402
from tests.serve_support import (  # noqa: E402
    ENGINE_CONFIG,
    TIMEOUT_S,
    metric,
    server_fixtures,
    start_server,
)

MODEL = "tiny-test"
PROMPT = "the quick brown fox jumps over"
TOLERANCE = 1e-5  # the same engine configuration: only batching differs


checkpoint, server, tok, http, client = server_fixtures(process=False)


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tok: Tokenizer) -> list[TokenLogprob]:
    """What the engine itself gives for PROMPT's first 8 tokens (eos ignored), 3 alternatives."""
    engine = Engine.from_pretrained(str(checkpoint), ENGINE_CONFIG)
    out = engine.generate([tok.encode(PROMPT)], SamplingParams(max_new_tokens=8, logprobs=3))[0]
    assert out.logprobs is not None
    return out.logprobs


def text_of(tok: Tokenizer, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def test_completion_logprobs_equal_the_engine_streamed_or_not(client: openai.OpenAI,
                                                              tok: Tokenizer, reference) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})
    got = client.completions.create(**kwargs).choices[0].logprobs
    assert got.tokens == [text_of(tok, r.token_id) for r in reference]
    assert got.token_logprobs == pytest.approx([r.logprob for r in reference], abs=TOLERANCE)
    for alternatives, want in zip(got.top_logprobs, reference):
        # by text: tokens whose text is the same (a partial UTF-8 sequence) share a key
        by_text = {text_of(tok, i): v for i, v in want.top}
        assert list(alternatives) == list(by_text)
        assert list(alternatives.values()) == pytest.approx(list(by_text.values()),
                                                            abs=TOLERANCE)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(8)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.token_logprobs] == pytest.approx(
        got.token_logprobs, abs=TOLERANCE)
    assert [o for lp in streamed for o in lp.text_offset] == got.text_offset


def test_chat_logprobs_in_openai_shape_streamed_or_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=TOLERANCE)
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_generate_return_logprob(http: httpx.Client, tok: Tokenizer, reference) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == [r.token_id for r in reference]
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(
        [r.logprob for r in reference], abs=TOLERANCE)
    assert [t[2] for t in meta["output_token_logprobs"]] == [text_of(tok, r.token_id)
                                                             for r in reference]
    assert [[a[1] for a in top] for top in meta["output_top_logprobs"]] == [
        [i for i, _ in r.top] for r in reference]
    assert meta["input_token_logprobs"] == []
    events = [json.loads(line[len("data: "):]) for line in
              http.post("/generate", json={**body, "stream": True}).iter_lines()
              if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    plain = http.post("/generate", json={**body, "return_logprob": False}).json()["meta_info"]
    assert "output_token_logprobs" not in plain


@pytest.fixture(scope="module")
def prompt_reference(checkpoint: Path, tok: Tokenizer) -> list[TokenLogprob | None]:
    """The engine's own prompt log probabilities of PROMPT, 2 alternatives."""
    engine = Engine.from_pretrained(str(checkpoint), ENGINE_CONFIG)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=2)
    out = engine.generate([tok.encode(PROMPT)], params)[0]
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI, http: httpx.Client,
                                                     tok: Tokenizer, prompt_reference,
                                                     stream: bool) -> None:
    """What lm-evaluation-harness asks to score a continuation: the prompt's tokens, each with
    its log probability (the first null) and its alternatives, and nothing generated (nor
    counted as generated by /metrics)."""
    generated = metric(http, "jhicache:generation_tokens_total")
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, echo=True,
                  logprobs=2)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
                  if c.choices]
        text = "".join(c.text for c in chunks)
        lps = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        values = [v for lp in lps for v in lp.token_logprobs]
    else:
        got = client.completions.create(**kwargs)
        assert got.usage.completion_tokens == 0
        choice = got.choices[0]
        text, tokens, values = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        assert choice.logprobs.top_logprobs[0] is None
        assert len(choice.logprobs.top_logprobs[1]) <= 2
        assert choice.model_extra["token_ids"] == []
    ids = tok.encode(PROMPT)
    assert text == PROMPT and tokens == [text_of(tok, i) for i in ids]
    assert values[0] is None and prompt_reference[0] is None
    assert values[1:] == pytest.approx([r.logprob for r in prompt_reference[1:]],
                                       abs=TOLERANCE)
    assert metric(http, "jhicache:generation_tokens_total") == generated


def test_a_prompt_of_several_chunks_scored_as_its_chunks_are_computed(
        checkpoint: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Echo with logprobs over a prompt of several chunks, not streamed: the server formats
    each chunk's entries as its step fills them (before the first token; those outputs are
    delivered one at a time, which a lagging server would take merged), and the body equals
    the engine's own log probabilities; streamed, the same values."""
    config = dataclasses.replace(ENGINE_CONFIG, chunked_prefill_tokens=16)
    prompt = " ".join([PROMPT] * 8)
    ids = tok.encode(prompt)
    assert len(ids) > 3 * 16
    engine = Engine.from_pretrained(str(checkpoint), config)
    params = SamplingParams(max_new_tokens=2, logprobs=1, prompt_logprobs=1)  # no eos
    [want] = engine.generate([ids], params)
    engine.close()
    assert want.prompt_logprobs is not None and want.logprobs is not None
    records = [*want.prompt_logprobs, *want.logprobs]
    settled: list[int] = []  # the prompt entries formatted, after each addition
    pacing = threading.Event()  # set while the request not streamed runs
    taken = one_at_a_time(monkeypatch, lambda out: pacing.is_set() and not out.new_token_ids)

    class Recorded(CompletionLogprobs):
        def add_prompt(self, rows) -> None:
            super().add_prompt(rows)
            settled.append(len(rows) + (settled[-1] if settled else 0))
            taken.set()

    monkeypatch.setattr(openai_routes, "CompletionLogprobs", Recorded)
    server = start_server(checkpoint, config=config)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                               timeout=TIMEOUT_S, max_retries=0)
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                      logprobs=1, extra_body={"ignore_eos": True})
        pacing.set()
        got = client.completions.create(**kwargs).choices[0].logprobs
        pacing.clear()
        streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True,
                                                                             **kwargs)
                    if c.choices and c.choices[0].logprobs is not None]
    finally:
        server.stop()
    assert any(0 < done < len(ids) for done in settled)  # entries before the last chunk's
    assert settled == sorted(settled) and settled[-1] == len(ids)
    assert got.tokens == [text_of(tok, i) for i in [*ids, *want.token_ids]]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx([r.logprob for r in records[1:]],
                                                   abs=TOLERANCE)
    for alternatives, record in zip(got.top_logprobs[1:], records[1:]):
        assert list(alternatives) == [text_of(tok, i) for i, _ in record.top]
        assert list(alternatives.values()) == pytest.approx([v for _, v in record.top],
                                                            abs=TOLERANCE)
    assert got.text_offset == [sum(map(len, got.tokens[:i])) for i in range(len(got.tokens))]
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(
        got.token_logprobs, abs=TOLERANCE)


def test_echo_with_logprobs_scores_prompt_and_completion(client: openai.OpenAI,
                                                         tok: Tokenizer) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1, extra_body={"ignore_eos": True})
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == len(tok.encode(PROMPT)) + 3
    assert got.choices[0].text.startswith(PROMPT) and got.usage.completion_tokens == 3


def test_generate_prompt_logprobs_from_a_start(http: httpx.Client, tok: Tokenizer,
                                               prompt_reference) -> None:
    ids = tok.encode(PROMPT)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert [t[0] for t in meta["input_token_logprobs"][1:]] == pytest.approx(
        [r.logprob for r in prompt_reference[1:]], abs=TOLERANCE)
    later = http.post("/generate", json={**body, "logprob_start_len": 3}).json()["meta_info"]
    assert len(later["input_token_logprobs"]) == len(ids) - 3
    past = http.post("/generate", json={**body, "logprob_start_len": len(ids)})
    assert past.status_code == 400


def test_generate_token_ids_logprob(http: httpx.Client, tok: Tokenizer,
                                    checkpoint: Path) -> None:
    """SGLang's token_ids_logprob: (log probability, id, text) of each named id, in order, per
    generated token and per prompt token from logprob_start_len (None at position 0), as the
    engine gives them; refused without return_logprob, for two prompts' lists, past the
    vocabulary or past MAX_TOKEN_IDS ids."""
    ids, named = tok.encode(PROMPT), [3, 11, 3]
    engine = Engine.from_pretrained(str(checkpoint), ENGINE_CONFIG)
    want = engine.generate([ids], SamplingParams(max_new_tokens=3, logprobs=0, prompt_logprobs=0,
                                                 token_ids_logprob=tuple(named)))[0]
    assert want.logprobs is not None and want.prompt_logprobs is not None
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                  "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [named],
            "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    texts = [text_of(tok, i) for i in named]
    wanted_rows = [r.asked for r in want.logprobs]
    prompt_rows = [None if r is None else r.asked for r in want.prompt_logprobs]
    for got_rows, rows in ((meta["output_token_ids_logprobs"], wanted_rows),
                           (meta["input_token_ids_logprobs"], prompt_rows)):
        assert len(got_rows) == len(rows) and (got_rows[0] is None) == (rows[0] is None)
        for got, row in zip(got_rows, rows):
            if row is None:
                continue
            assert [(i, t) for _, i, t in got] == list(zip(named, texts))
            assert [v for v, _, _ in got] == pytest.approx([v for _, v in row], abs=TOLERANCE)
    plain = http.post("/generate", json={**body, "token_ids_logprob": None}).json()
    assert "output_token_ids_logprobs" not in plain["meta_info"]
    for bad in ({"return_logprob": False}, {"token_ids_logprob": [named, named]},
                {"token_ids_logprob": [10**6]}, {"token_ids_logprob": list(range(21))}):
        refused = http.post("/generate", json={**body, **bad})
        assert refused.status_code == 400, bad
        assert "token_ids_logprob" in refused.text
    again = http.post("/generate", json=body).json()["meta_info"]  # served on after refusals
    assert again["output_token_ids_logprobs"] == meta["output_token_ids_logprobs"]


def test_echo_repeats_the_prompt(client: openai.OpenAI) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True).choices[0]
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      temperature=0).choices[0]
    assert got.text == PROMPT + alone.text


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 2}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
])
def test_completion_fields_it_cannot_honour_are_refused(http: httpx.Client, extra: dict,
                                                        param: str) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                  "max_tokens": 2, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_chat_and_generate_refusals(http: httpx.Client) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    generate = {"text": PROMPT, "return_logprob": True}
    for extra, param in (({"logprob_start_len": -2}, "logprob_start_len"),
                         ({"token_ids_logprob": [1, 2], "return_logprob": False},
                          "token_ids_logprob")):
        response = http.post("/generate", json={**generate, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
