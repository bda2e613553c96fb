"""Scoring: which log probabilities a step computes for the requests that asked for them (their
sampled tokens', their prompt tokens'), and their records written into those requests once the
step's values are read."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from jhicache.batch import Batch
from jhicache.logprobs import asked_ids, prompt_reduction, prompt_targets
from jhicache.logprobs import records as logprob_records
from jhicache.request import Request

Reduction = Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]]


class PromptSpan(NamedTuple):
    """Rows of a step whose logits give the log probabilities of prompt tokens a request asked
    for: rows `row` to `row + length`, each for the prompt token after its own, from `position`."""

    row: int
    request: Request
    position: int
    length: int


class Asked(NamedTuple):
    """The host arrays of a step's log-probability programs: `token_ids` (`asked_ids` of every
    sampled row, None where no request asked for its token's log probabilities), the prompt
    spans with their `targets` (None without a span), and the prompt reductions to dispatch
    (each takes the targets; a step dispatches one, a warm-up every one)."""

    token_ids: np.ndarray | None = None
    spans: tuple[PromptSpan, ...] = ()
    targets: np.ndarray | None = None
    reductions: tuple[Reduction, ...] = ()


def on_launch(batch: Batch, rows: int, tokens: int) -> Asked:
    """What a step of `batch`, padded to `rows` sampled rows and `tokens` token rows, computes:
    the sampled tokens' log probabilities where a request asked, and the spans' prompt rows."""
    chunks = batch.chunks
    wanted = any(c.samples_token and c.request.logprobs is not None for c in chunks)
    token_ids = (asked_ids([c.request.params.token_ids_logprob for c in chunks], rows)
                 if wanted else None)
    spans = prompt_spans(batch)
    if not spans:
        return Asked(token_ids)
    most = max(span.request.params.prompt_logprobs or 0 for span in spans)
    return Asked(token_ids, spans, span_targets(spans, tokens), (prompt_reduction(most),))


def on_end(batch: Batch, spans: tuple[PromptSpan, ...], gained: list[Request],
           token_rows: tuple[np.ndarray, ...] | None,
           prompt_rows: tuple[np.ndarray, ...] | None) -> list[Request]:
    """Writes a read step's log probabilities into its requests: each span's prompt entries,
    and the token of each request that gained one and asked. Returns the spans' requests."""
    if prompt_rows is not None:
        _fill_prompts(spans, *prompt_rows)
    if token_rows is not None:
        _add_token_logprobs(batch, set(gained), *token_rows)
    return [span.request for span in spans] if prompt_rows is not None else []


def _add_token_logprobs(batch: Batch, gained: set[Request], chosen: np.ndarray,
                        top_values: np.ndarray, top_ids: np.ndarray, asked: np.ndarray) -> None:
    """Each request that gained a token and asked for log probabilities keeps its row's."""
    rows = [(row, chunk.request) for row, chunk in enumerate(batch.chunks)
            if chunk.samples_token and chunk.request in gained
            and chunk.request.logprobs is not None]
    if not rows:
        return
    index = [row for row, _ in rows]
    made = logprob_records([req.tokens[-1] for _, req in rows], chosen[index],
                           top_values[index], top_ids[index], asked[index],
                           [req.params.logprobs or 0 for _, req in rows],
                           [req.params.token_ids_logprob for _, req in rows])
    for (_, req), record in zip(rows, made):
        assert req.logprobs is not None
        req.logprobs.append(record)


def _fill_prompts(spans: tuple[PromptSpan, ...], chosen: np.ndarray, top_values: np.ndarray,
                  top_ids: np.ndarray, asked: np.ndarray) -> None:
    """Each span's rows fill its request's prompt entries, with the alternatives it asked
    for (the step's reduction took as many as the most any span asked for; `fill` keeps
    the first columns)."""
    for span in spans:
        req, rows = span.request, slice(span.row, span.row + span.length)
        assert req.prompt_logprobs is not None
        req.prompt_logprobs.fill(span.position - req.params.prompt_logprobs_start,
                                 chosen[rows], top_values[rows], top_ids[rows], asked[rows])


def prompt_spans(batch: Batch) -> tuple[PromptSpan, ...]:
    """A span per chunk whose rows give prompt log probabilities its request asked for."""
    spans, offset = [], 0
    for chunk in batch.chunks:
        req = chunk.request
        if req.prompt_logprobs is not None:
            first = max(req.params.prompt_logprobs_start, 1) - 1  # the row before it
            lo, hi = max(chunk.start, first), min(chunk.start + chunk.length, req.prompt_len - 1)
            if hi > lo:
                spans.append(PromptSpan(offset + lo - chunk.start, req, lo + 1, hi - lo))
        offset += chunk.length
    return tuple(spans)


def span_targets(spans: tuple[PromptSpan, ...], tokens: int) -> np.ndarray:
    """`prompt_targets` of a step of `tokens` rows, filled: a span's rows hold the prompt
    tokens that follow them, then the ids their request names."""
    targets = prompt_targets(tokens)
    for span in spans:
        rows = slice(span.row, span.row + span.length)
        targets[rows, 0] = span.request.tokens[span.position:span.position + span.length]
        named = span.request.params.token_ids_logprob
        targets[rows, 1:1 + len(named)] = named
    return targets
