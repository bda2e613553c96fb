"""Log probabilities in the shapes clients read: OpenAI's completions (legacy) and chat objects,
and SGLang's `meta_info` lists. A token's text is its own decoding (special tokens kept), or
`token_id:<id>` on a server without a tokenizer (vLLM's spelling)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from jhicache.logprobs import PromptLogprobs, TokenLogprob
from jhicache.serve.tokenizer import Tokenizer

TokenTexts = Callable[[list[int]], list[str]]  # tokens -> their texts, in one call
_Cell = TypeVar("_Cell")
_Row = TypeVar("_Row")
_COMPLETION_COLUMNS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def token_texts(tokenizer: Tokenizer | None) -> TokenTexts:
    if tokenizer is None:
        return lambda tokens: [f"token_id:{token}" for token in tokens]
    return tokenizer.token_texts


@dataclasses.dataclass(frozen=True, slots=True)
class _Entries:
    """Entries as flat columns, a prompt's then generated tokens': a scored prompt has one per
    token, and its columns are built from its arrays in a few list operations, its
    alternatives grouped a run of entries at a time, where records would take an object and
    Python steps each."""

    ids: list[int]
    logprobs: list[float | None]  # None: no entry (a prompt's position 0)
    missing: list[int]  # the positions without an entry
    # (entries, alternatives each): the layout of `alt_ids`, a prompt's run then a record's each
    # (a position without an entry keeps its place in its run's alternatives)
    runs: list[tuple[int, int]]
    alt_ids: list[int]  # every entry's alternatives, entry after entry
    alt_values: list[float]

    @classmethod
    def of(cls, prompt: PromptLogprobs | None, records: Sequence[TokenLogprob]) -> _Entries:
        """The prompt's entries (none without `prompt`), then the records'."""
        entries = cls([], [], [], [], [], [])
        if prompt is not None:
            entries.ids.extend(prompt.token_ids.tolist())
            entries.logprobs.extend(prompt.logprobs.tolist())
            entries.missing.extend(np.flatnonzero(~prompt.filled).tolist())
            for position in entries.missing:
                entries.logprobs[position] = None
            entries.runs.append(prompt.top_ids.shape)
            entries.alt_ids.extend(prompt.top_ids.ravel().tolist())
            entries.alt_values.extend(prompt.top_values.ravel().tolist())
        for r in records:
            entries.ids.append(r.token_id)
            entries.logprobs.append(r.logprob)
            entries.runs.append((1, len(r.top)))
            entries.alt_ids.extend(i for i, _ in r.top)
            entries.alt_values.extend(v for _, v in r.top)
        return entries

    def grouped(self, cells: Iterable[_Cell], row: Callable[[tuple[_Cell, ...]], _Row]
                ) -> list[_Row | None]:
        """Per entry, `row` of its alternatives' `cells` (one each, in `alt_ids`' order), or
        None where it has no entry."""
        rest = iter(cells)
        rows: list[_Row | None] = []
        for entries, alternatives in self.runs:
            # `alternatives` references to one iterator: zip takes that many cells a group
            groups = zip(*[rest] * alternatives) if alternatives else itertools.repeat(())
            rows.extend(map(row, itertools.islice(groups, entries)))
        return self._unfilled(rows)

    def dicts(self, keys: list[str], values: list[float]) -> list[dict[str, float] | None]:
        """Per entry, {key: value} of its alternatives, or None where it has no entry."""
        if any(alternatives != 1 for _, alternatives in self.runs):
            return self.grouped(zip(keys, values), dict)
        # one alternative each, as an evaluation's log-likelihood asks: a dict display per
        # entry, which takes a fraction of the time `dict` takes to build one from a pair
        return self._unfilled([{key: value} for key, value in zip(keys, values)])

    def _unfilled(self, rows: list[_Row | None]) -> list[_Row | None]:
        """`rows` (one per entry) with None at the positions without an entry."""
        for position in self.missing:
            rows[position] = None
        return rows


class CompletionLogprobs:
    """/v1/completions' `logprobs` built a part at a time: a scored prompt's entries as the
    engine's steps score them (`add_prompt`, while the next chunk computes), then the generated
    tokens' records; `value()` is the object. Each entry has its token, its log probability,
    its alternatives as {token: log probability} and where its token's text starts.

    Each part is written as JSON when it is added, and `value()`'s columns are that JSON
    (`msgspec.Raw`, which the response's encoder copies as it is): after a scored prompt's
    last step, only its last chunk's entries are left to build and encode."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self._texts = texts
        self._offset = offset  # where the next entry's token text starts
        # per column, each part's entries as JSON items (the list's, without its brackets)
        self._encoded: tuple[list[bytes], ...] = tuple([] for _ in _COMPLETION_COLUMNS)

    def add_prompt(self, rows: PromptLogprobs) -> None:
        """The prompt's next entries (`PromptScores.rows`: each part follows the last)."""
        entries = _Entries.of(rows, ())
        tokens = self._texts(entries.ids)
        starts = list(itertools.accumulate(map(len, tokens), initial=self._offset))
        self._offset = starts.pop()
        self._extend(tokens, entries, starts)

    def add_records(self, records: Sequence[TokenLogprob]) -> None:
        entries = _Entries.of(None, records)
        tokens = self._texts(entries.ids)
        starts = list(itertools.accumulate(map(len, tokens), initial=self._offset))
        self._offset = starts.pop()
        self._extend(tokens, entries, starts)

    @property
    def offset(self) -> int:
        """Where the text after the last entry added starts."""
        return self._offset

    def value(self) -> dict[str, msgspec.Raw]:
        return {name: msgspec.Raw(b"[" + b",".join(encoded) + b"]")
                for name, encoded in zip(_COMPLETION_COLUMNS, self._encoded)}

    def _extend(self, tokens: list[str], entries: _Entries, starts: list[int]) -> None:
        top = entries.dicts(self._texts(entries.alt_ids), entries.alt_values)
        parts: tuple[list[Any], ...] = (tokens, entries.logprobs, top, starts)
        for encoded, part in zip(self._encoded, parts):
            if part:
                encoded.append(msgspec.json.encode(part)[1:-1])


def completion_logprobs(prompt: PromptLogprobs | None, records: Sequence[TokenLogprob],
                        texts: TokenTexts, offset: int = 0) -> CompletionLogprobs:
    """/v1/completions' `logprobs` of the prompt's entries (`prompt`, with echo), then of the
    generated `records`, token texts from `offset` on, built at once. The prompt's first
    token, which nothing precedes, has null values."""
    built = CompletionLogprobs(texts, offset)
    if prompt is not None:
        built.add_prompt(prompt)
    built.add_records(records)
    return built


def chat_logprobs(records: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """/v1/chat/completions' `logprobs`: one entry per token, with its UTF-8 bytes and its
    alternatives."""
    def entry(piece: str, logprob: float | None) -> dict[str, Any]:
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    entries = _Entries.of(None, records)
    alternatives = entries.grouped(map(entry, texts(entries.alt_ids), entries.alt_values), list)
    return {"content": [{**entry(piece, logprob), "top_logprobs": top} for piece, logprob, top
                        in zip(texts(entries.ids), entries.logprobs, alternatives)],
            "refusal": None}


def sglang_logprobs(records: Sequence[TokenLogprob], texts: TokenTexts | None,
                    prompt: PromptLogprobs | None = None,
                    named: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang's `meta_info` fields: (log probability, token id, text or None) per generated
    token and per alternative, and per prompt token from where they were asked for (`prompt`;
    the first prompt token has a null log probability and no alternatives); with `named`
    ids (token_ids_logprob), one for each of them per generated and per prompt token."""
    def names(tokens: list[int]) -> Iterable[str | None]:
        return itertools.repeat(None) if texts is None else texts(tokens)

    def columns(entries: _Entries) -> tuple[list[Any], list[Any]]:
        alternatives = zip(entries.alt_values, entries.alt_ids, names(entries.alt_ids))
        return (list(zip(entries.logprobs, entries.ids, names(entries.ids))),
                entries.grouped(alternatives, list))

    output, output_top = columns(_Entries.of(None, records))
    prompt_entries, prompt_top = columns(_Entries.of(prompt, ()))
    fields = {"output_token_logprobs": output, "output_top_logprobs": output_top,
              "input_token_logprobs": prompt_entries, "input_top_logprobs": prompt_top}
    if named:
        labels = list(zip(named, names(list(named))))

        def row(values: Iterable[float]) -> list[tuple[float, int, str | None]]:
            return [(value, token, name) for value, (token, name) in zip(values, labels)]

        fields["output_token_ids_logprobs"] = [row(v for _, v in r.asked) for r in records]
        fields["input_token_ids_logprobs"] = [] if prompt is None else [
            row(values) if is_filled else None for values, is_filled
            in zip(prompt.asked_values.tolist(), prompt.filled.tolist())]
    return fields
