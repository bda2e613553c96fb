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


def completion_logprobs(records: Sequence[TokenLogprob], text: TokenText,
                        offset: int = 0) -> dict[str, Any]:
    """/v1/completions' `logprobs`: the tokens, their log probabilities, the alternatives as
    {token: log probability}, and where each token's text starts (from `offset` on)."""
    tokens = [text(r.token_id) for r in records]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{text(i): v for i, v in r.top} for r in records],
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


def sglang_logprobs(records: Sequence[TokenLogprob], text: TokenText | None) -> dict[str, Any]:
    """SGLang's `meta_info` fields: (log probability, token id, text or None) per generated
    token and per alternative; the prompt's lists are empty (output tokens only)."""
    def entry(token: int, logprob: float) -> tuple[float, int, str | None]:
        return (logprob, token, None if text is None else text(token))

    return {"output_token_logprobs": [entry(r.token_id, r.logprob) for r in records],
            "output_top_logprobs": [[entry(i, v) for i, v in r.top] for r in records],
            "input_token_logprobs": [], "input_top_logprobs": []}
