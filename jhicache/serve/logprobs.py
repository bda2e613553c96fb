"""Log probabilities in the shapes clients read: OpenAI's completions (legacy) and chat objects,
and SGLang's `meta_info` lists. A token's text is its own decoding (special tokens kept), or
`token_id:<id>` on a server without a tokenizer (vLLM's spelling)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from jhicache.logprobs import PromptLogprobs, TokenLogprob
from jhicache.serve.tokenizer import Tokenizer

TokenText = Callable[[int], str]


def token_text(tokenizer: Tokenizer | None) -> TokenText:
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return tokenizer.token_text


def completion_logprobs(prompt: PromptLogprobs | None, records: Sequence[TokenLogprob],
                        text: TokenText, offset: int = 0) -> dict[str, Any]:
    """/v1/completions' `logprobs` of the prompt's entries (`prompt`, with echo), then of the
    generated `records`: the tokens, their log probabilities, the alternatives as {token: log
    probability}, and where each token's text starts (from `offset` on). The prompt's first
    token, which nothing precedes, has null values."""
    ids, logprobs, top_ids, top_values = _columns(prompt, records)
    tokens = [text(i) for i in ids]
    starts = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [None if logprob is None else {text(i): v for i, v in zip(i_s, v_s)}
                             for logprob, i_s, v_s in zip(logprobs, top_ids, top_values)],
            "text_offset": starts if tokens else []}


def chat_logprobs(records: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """/v1/chat/completions' `logprobs`: one entry per token, with its UTF-8 bytes and its
    alternatives."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [{**entry(r.token_id, r.logprob),
                         "top_logprobs": [entry(i, v) for i, v in r.top]} for r in records],
            "refusal": None}


def sglang_logprobs(records: Sequence[TokenLogprob], text: TokenText | None,
                    prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    """SGLang's `meta_info` fields: (log probability, token id, text or None) per generated
    token and per alternative, and per prompt token from where they were asked for (`prompt`;
    the first prompt token has a null log probability and no alternatives)."""
    def entry(token: int, logprob: float | None) -> tuple[float | None, int, str | None]:
        return (logprob, token, None if text is None else text(token))

    ids, logprobs, top_ids, top_values = _columns(prompt, ())
    return {"output_token_logprobs": [entry(r.token_id, r.logprob) for r in records],
            "output_top_logprobs": [[entry(i, v) for i, v in r.top] for r in records],
            "input_token_logprobs": [entry(i, v) for i, v in zip(ids, logprobs)],
            "input_top_logprobs": [None if logprob is None
                                   else [entry(i, v) for i, v in zip(i_s, v_s)]
                                   for logprob, i_s, v_s in zip(logprobs, top_ids, top_values)]}


def _columns(prompt: PromptLogprobs | None, records: Sequence[TokenLogprob]) -> tuple[
        list[int], list[float | None], list[list[int]], list[list[float]]]:
    """The prompt's entries (none without `prompt`) and then the records' as columns: token
    ids, log probabilities, and the alternatives' ids and log probabilities. A prompt's
    columns are taken as they are, not entry by entry: a scored prompt has one per token."""
    ids: list[int] = [] if prompt is None else list(prompt.token_ids)
    logprobs: list[float | None] = [] if prompt is None else list(prompt.logprobs)
    top_ids: list[list[int]] = [] if prompt is None else list(prompt.top_ids)
    top_values: list[list[float]] = [] if prompt is None else list(prompt.top_values)
    for r in records:
        ids.append(r.token_id)
        logprobs.append(r.logprob)
        top_ids.append([i for i, _ in r.top])
        top_values.append([v for _, v in r.top])
    return ids, logprobs, top_ids, top_values
