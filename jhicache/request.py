"""Request: one prompt's life in the engine (tokens, pages it holds, cache hits, timing)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jhicache.logprobs import PromptLogprobs, PromptScores, TokenLogprob
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
    """One request's news, as deltas: what `Engine.step` reports when a request gains tokens,
    finishes, or has more of its prompt scored (then without tokens): the tokens, log
    probabilities and prompt rows since its last output, never the whole so far. What
    `Engine.generate` returns is the delta of the whole run (every token is new), with
    `token_ids` and `prompt_logprobs` holding the whole too."""

    request_id: str
    new_token_ids: list[int]  # the tokens gained since the last output; a stop token included
    finished: bool
    prompt_len: int
    device_hit_tokens: int  # prompt tokens found on the device tier
    host_hit_tokens: int  # prompt tokens loaded back from the host tier (storage's excluded)
    ttft_s: float | None  # submission to first token known on the host; None before it
    finish_reason: str | None  # "length", "stop" or "abort"; None while running
    storage_hit_tokens: int = 0  # prompt tokens read from the storage tier, then loaded back
    # with SamplingParams.logprobs: one record per token of `new_token_ids`; else None
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: the prompt's rows scored since the last output
    prompt_scores: PromptScores | None = None
    # a whole run's (`Engine.generate`, `AsyncEngine.generate`): every generated token, and
    # with prompt_logprobs one entry per prompt position from its start on (None for position
    # 0, which nothing precedes); empty and None in a step's output
    token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


@dataclasses.dataclass(eq=False)
class OutputCollector:
    """One request's outputs added up, for a caller that keeps more than the newest: the
    tokens, log probabilities and prompt rows since the first it was given (each appended,
    nothing copied whole)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt: list[PromptScores] = dataclasses.field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.tokens += out.new_token_ids
        self.logprobs += out.logprobs or ()
        if out.prompt_scores is not None:
            self.prompt.append(out.prompt_scores)
        self.last = out

    def merged(self) -> RequestOutput:
        """The outputs added, as one: the last's state, with every delta since the first."""
        assert self.last is not None
        return dataclasses.replace(
            self.last, new_token_ids=self.tokens,
            logprobs=None if self.last.logprobs is None else self.logprobs,
            prompt_scores=PromptScores.join(self.prompt))

    def whole(self) -> RequestOutput:
        """`merged`, with `token_ids` and `prompt_logprobs` filled: a whole run's output (the
        collector must have had every output since the request's first)."""
        out = self.merged()
        return dataclasses.replace(out, token_ids=out.new_token_ids, prompt_logprobs=(
            None if out.prompt_scores is None else out.prompt_scores.rows))


@dataclasses.dataclass(eq=False)
class Request:
    """Mutable per-request state owned by the scheduler.

    `tokens` is the one list of the request's tokens, matched against the tree as it is:
    `device_pages[i]` holds tokens [i * page_size, (i + 1) * page_size) of it; the first
    `cached_len` tokens have KV in those pages, or will have once the steps already dispatched
    complete. `pending` counts tokens sampled by dispatched steps whose values the host has not
    read yet: they follow `tokens`, and the step that reads them appends them in order.
    `cache_handle` is the locked tree node that protects the prefix pages shared with the cache
    (None when nothing is locked).
    """

    request_id: str
    tokens: list[int]  # the prompt, then each generated token the host has read: grows in place
    params: SamplingParams
    arrival_s: float
    pending: int = 0
    pending_row: int = -1  # the row of the newest pending token in its step's sampled tokens
    status: RequestStatus = RequestStatus.WAITING
    device_pages: list[int] = dataclasses.field(default_factory=list)
    cached_len: int = 0
    shared_len: int = 0  # leading tokens whose pages belong to the cache, not to this request
    # leading tokens it cached while running (their hits counted), up to the end of the node
    # `counted_node`: kept through a retraction while that node stays in the cache
    counted_len: int = 0
    counted_node: Any = None
    cache_handle: Any = None
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None
    prefetched: tuple[int, int] | None = None  # (device hit before, tokens) loaded ahead for it
    storage_hit_tokens: int = 0
    prompt_len: int = dataclasses.field(init=False)
    logprobs: list[TokenLogprob] | None = dataclasses.field(init=False)  # per output token
    # per prompt position from params.prompt_logprobs_start, filled as its rows are computed
    prompt_logprobs: PromptLogprobs | None = dataclasses.field(init=False)
    prompt_given: int = 0  # entries of prompt_logprobs already in an output

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.logprobs = [] if self.params.logprobs is not None else None
        start, alternatives = self.params.prompt_logprobs_start, self.params.prompt_logprobs
        self.prompt_logprobs = (None if alternatives is None
                                else PromptLogprobs.empty(self.tokens[start:], alternatives,
                                                          self.params.token_ids_logprob))

    @property
    def match_tokens(self) -> list[int]:
        """What the cache may match of it: with prompt log probabilities, only the prefix
        before the first position whose logits they need (those positions are computed)."""
        if self.prompt_logprobs is None:
            return self.tokens
        return self.tokens[:max(self.params.prompt_logprobs_start, 1)]

    @property
    def output(self) -> list[int]:
        """The generated tokens the host knows (a copy)."""
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def add_output(self, token: int) -> None:
        """Appends a generated token the host has read."""
        self.tokens.append(token)

    @property
    def known_len(self) -> int:
        """len(tokens): the tokens whose values the host knows."""
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """The sequence length once the pending tokens are known."""
        return self.known_len + self.pending

    @property
    def num_generated(self) -> int:
        return self.num_output + self.pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end]; a pending token reads as 0 (see `Batch.patches`)."""
        known = self.known_len
        return self.tokens[start:min(end, known)] + [0] * max(0, end - max(start, known))

    @property
    def pending_len(self) -> int:
        """Tokens of the sequence not yet in the KV cache."""
        return self.num_tokens - self.cached_len

    def take_output(self, new_token_ids: list[int]) -> RequestOutput:
        """Its output now, with what is new since the last: `new_token_ids` (the caller's), their
        log probabilities, and the prompt rows scored since (a copy of those rows alone; taken:
        the next output's rows start after them)."""
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = logprobs[len(logprobs) - len(new_token_ids):]
        scores = None
        table = self.prompt_logprobs
        if table is not None and table.filled_to > self.prompt_given:
            scores = PromptScores(self.prompt_given,
                                  table.rows(self.prompt_given, table.filled_to).copy())
            self.prompt_given = table.filled_to
        return self._output(new_token_ids, logprobs, scores)

    def result(self) -> RequestOutput:
        """The whole run, as `Engine.generate` returns it."""
        tokens, table = self.output, self.prompt_logprobs
        out = self._output(tokens, None if self.logprobs is None else list(self.logprobs),
                           None if table is None else PromptScores(0, table))
        return dataclasses.replace(out, token_ids=tokens, prompt_logprobs=table)

    def _output(self, new_token_ids: list[int], logprobs: list[TokenLogprob] | None,
                scores: PromptScores | None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            finished=self.finished,
            prompt_len=self.prompt_len,
            device_hit_tokens=self.device_hit_tokens,
            host_hit_tokens=self.host_hit_tokens,
            ttft_s=None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            storage_hit_tokens=self.storage_hit_tokens,
            logprobs=logprobs,
            prompt_scores=scores,
        )
