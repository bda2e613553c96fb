"""Request: one prompt's life in the engine (tokens, pages it holds, cache hits, timing)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jhicache.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    PREFILLING = "prefilling"  # admitted; some prompt tokens still to compute (chunked prefill)
    DECODING = "decoding"  # whole prompt computed; generating
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens generated
    STOP = "stop"  # a stop token was generated (it is the last output token)
    ABORT = "abort"  # dropped before it finished


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What `Engine.generate` returns per prompt."""

    token_ids: list[int]
    prompt_len: int
    device_hit_tokens: int
    host_hit_tokens: int
    ttft_s: float
    finish_reason: str


@dataclasses.dataclass(eq=False)
class Request:
    """Mutable per-request state owned by the scheduler.

    `device_pages[i]` holds tokens [i * page_size, (i + 1) * page_size) of `tokens`; the first
    `cached_len` tokens have KV in those pages. `cache_handle` is the locked tree node that
    protects the prefix pages shared with the cache (None when nothing is locked).
    """

    rid: int
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    output: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    device_pages: list[int] = dataclasses.field(default_factory=list)
    cached_len: int = 0
    shared_len: int = 0  # leading tokens whose pages belong to the cache, not to this request
    cache_handle: Any = None
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt plus generated tokens: the sequence whose KV the request builds."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building the list."""
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without concatenating prompt and output (a decode step reads one
        token of a sequence thousands long)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:] + self.output[:end - n]

    @property
    def pending_len(self) -> int:
        """Tokens of `tokens` not yet in the KV cache."""
        return self.num_tokens - self.cached_len

    def to_output(self) -> RequestOutput:
        assert self.first_token_s is not None and self.finish_reason is not None
        return RequestOutput(
            token_ids=list(self.output),
            prompt_len=len(self.prompt),
            device_hit_tokens=self.device_hit_tokens,
            host_hit_tokens=self.host_hit_tokens,
            ttft_s=self.first_token_s - self.arrival_s,
            finish_reason=self.finish_reason.value,
        )
