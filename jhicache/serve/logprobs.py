"""Log probabilities in the shapes clients read: OpenAI's completions (legacy) and chat objects,
and SGLang's `meta_info` lists. A token's text is its own decoding (special tokens kept), or
`token_id:<id>` on a server without a tokenizer (vLLM's spelling)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jhicache.logprobs import TokenLogprob
from jhicache.serve.tokenizer import Tokenizer

TokenText = Callable[[int], str]


def token_text(tokenizer: Tokenizer | None) -> TokenText:
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(records: Sequence[TokenLogprob | None], text: TokenText,
                        offset: int = 0, first_token: int | None = None) -> dict[str, Any]:
    """/v1/completions' `logprobs`: the tokens, their log probabilities, the alternatives as
    {token: log probability}, and where each token's text starts (from `offset` on). A None
    record is the prompt's first token (`first_token`), which nothing precedes: null values."""
    ids = [first_token if r is None else r.token_id for r in records]
    tokens = [text(i) for i in ids if i is not None]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [None if r is None else r.logprob for r in records],
            "top_logprobs": [None if r is None else {text(i): v for i, v in r.top}
                             for r in records],
            "text_offset": starts}


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
                    prompt: Sequence[TokenLogprob | None] = (),
                    prompt_ids: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang's `meta_info` fields: (log probability, token id, text or None) per generated
    token and per alternative, and per prompt token from where they were asked for (`prompt`;
    the first prompt token has a null log probability and no alternatives)."""
    def entry(token: int, logprob: float | None) -> tuple[float | None, int, str | None]:
        return (logprob, token, None if text is None else text(token))

    first = prompt_ids[0] if prompt_ids else 0
    return {"output_token_logprobs": [entry(r.token_id, r.logprob) for r in records],
            "output_top_logprobs": [[entry(i, v) for i, v in r.top] for r in records],
            "input_token_logprobs": [entry(first, None) if r is None
                                     else entry(r.token_id, r.logprob) for r in prompt],
            "input_top_logprobs": [None if r is None else [entry(i, v) for i, v in r.top]
                                   for r in prompt]}
