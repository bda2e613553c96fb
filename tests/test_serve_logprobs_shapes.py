"""The log-probability objects the server writes (jhicache.serve.logprobs), built from a
prompt's columns and generated records, against the same objects written entry by entry from
`PromptLogprobs`' own per-position records: positions without an entry anywhere in the prompt,
0 to several alternatives, and generated records of differing lengths."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import pytest

from jhicache.logprobs import PromptLogprobs, TokenLogprob
from jhicache.serve.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
    sglang_logprobs,
)


def decoded(built: CompletionLogprobs) -> dict[str, Any]:
    """The object a client reads: `built`'s columns are JSON already."""
    return msgspec.json.decode(msgspec.json.encode(built.value()))


def texts(tokens: list[int]) -> list[str]:
    return [f"<{token}>" for token in tokens]


def prompt_columns(rng: np.random.Generator, n: int, alternatives: int) -> PromptLogprobs:
    """`n` positions, filled in two runs with a gap between, position 0 never."""
    prompt = PromptLogprobs.empty(rng.integers(0, 50, n).tolist(), alternatives, asked=(7, 9))

    def fill(first: int, end: int) -> None:
        rows = end - first
        prompt.fill(first, rng.standard_normal(rows).astype(np.float32),
                    rng.standard_normal((rows, 20)).astype(np.float32),
                    rng.integers(0, 50, (rows, 20)).astype(np.int32),
                    rng.standard_normal((rows, 20)).astype(np.float32))
    fill(1, n // 2)
    fill(n // 2 + 2, n)
    return prompt


def generated(rng: np.random.Generator) -> list[TokenLogprob]:
    return [TokenLogprob(int(rng.integers(50)), float(rng.standard_normal()),
                         [(int(rng.integers(50)), float(rng.standard_normal()))
                          for _ in range(count)], [(7, -1.5), (9, -2.5)])
            for count in (2, 0, 3)]


def entry_by_entry(prompt: PromptLogprobs | None, records: list[TokenLogprob], offset: int
                   ) -> dict[str, Any]:
    entries = (list(prompt) if prompt is not None else []) + records
    ids = (prompt.token_ids.tolist() if prompt is not None else []) + [r.token_id for r in records]
    tokens = texts(ids)
    starts = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {f"<{i}>": v for i, v in e.top}
                             for e in entries],
            "text_offset": starts}


@pytest.mark.parametrize("alternatives", [0, 1, 3])
def test_completion_logprobs_equal_entry_by_entry(alternatives: int) -> None:
    rng = np.random.default_rng(alternatives)
    prompt, records = prompt_columns(rng, 12, alternatives), generated(rng)
    built = completion_logprobs(prompt, records, texts, 4)
    assert decoded(built) == entry_by_entry(prompt, records, 4)
    assert built.offset == 4 + sum(map(len, decoded(built)["tokens"]))
    assert decoded(completion_logprobs(None, records, texts)) == entry_by_entry(None, records, 0)
    assert decoded(completion_logprobs(prompt, [], texts)) == entry_by_entry(prompt, [], 0)
    assert decoded(completion_logprobs(None, [], texts)) == entry_by_entry(None, [], 0)


@pytest.mark.parametrize("alternatives", [0, 1, 3])
def test_completion_logprobs_built_as_chunks_fill_the_prompt(alternatives: int) -> None:
    """The prompt's entries added a part at a time, as a chunked prefill scores them (each
    step's rows after the last's, position 0 never filled): the same object as built at once."""
    rng = np.random.default_rng(alternatives)
    whole, records = prompt_columns(rng, 40, alternatives), generated(rng)
    whole.filled[1:] = True  # no gap: steps fill a prompt's entries in order
    built = CompletionLogprobs(texts, 3)
    given = 0
    for end in (1, 9, 9, 26, 40):  # a step's last entry, one with none (a chunk of others)
        if end > given:
            built.add_prompt(whole.rows(given, end))
        given = end
    built.add_records(records)
    assert decoded(built) == entry_by_entry(whole, records, 3)


def test_chat_logprobs_entry_by_entry() -> None:
    records = generated(np.random.default_rng(0))
    content = chat_logprobs(records, texts)["content"]
    assert [c["token"] for c in content] == texts([r.token_id for r in records])
    assert [c["logprob"] for c in content] == [r.logprob for r in records]
    assert [[(a["token"], a["logprob"], a["bytes"]) for a in c["top_logprobs"]]
            for c in content] == [[(f"<{i}>", v, list(f"<{i}>".encode())) for i, v in r.top]
                                  for r in records]


@pytest.mark.parametrize("alternatives", [0, 2])
def test_sglang_logprobs_entry_by_entry(alternatives: int) -> None:
    rng = np.random.default_rng(10 + alternatives)
    prompt, records = prompt_columns(rng, 9, alternatives), generated(rng)
    fields = sglang_logprobs(records, texts, prompt, named=(7, 9))
    for name, entries, tokens in (("output", records, [r.token_id for r in records]),
                                  ("input", list(prompt), prompt.token_ids.tolist())):
        assert fields[f"{name}_token_logprobs"] == [
            (None if e is None else e.logprob, token, f"<{token}>")
            for e, token in zip(entries, tokens)]
        assert fields[f"{name}_top_logprobs"] == [
            None if e is None else [(v, i, f"<{i}>") for i, v in e.top] for e in entries]
        assert fields[f"{name}_token_ids_logprobs"] == [
            None if e is None else [(v, i, f"<{i}>") for i, v in e.asked] for e in entries]
    bare = sglang_logprobs(records, None)
    assert bare["output_token_logprobs"] == [(r.logprob, r.token_id, None) for r in records]
    assert bare["input_token_logprobs"] == [] and "output_token_ids_logprobs" not in bare
    assert list(itertools.chain(*bare["output_top_logprobs"])) == [
        (v, i, None) for r in records for i, v in r.top]
