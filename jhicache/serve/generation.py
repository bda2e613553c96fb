"""Generation: one request's run through the AsyncEngine as the routes see it: released text
(incremental detokenization, stop strings), token ids, finish reason, metrics and a log line."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from jhicache.async_engine import AsyncEngine
from jhicache.logprobs import PromptLogprobs, PromptScores, TokenLogprob
from jhicache.request import FinishReason, RequestOutput
from jhicache.sampling import SamplingParams
from jhicache.serve.detokenizer import IncrementalDetokenizer
from jhicache.serve.metrics import ServerMetrics
from jhicache.serve.stop_strings import StopStrings
from jhicache.serve.tokenizer import Tokenizer

logger = logging.getLogger("jhicache.serve")


@dataclasses.dataclass(frozen=True)
class GenerationInput:
    """What a route submits: token ids, engine sampling params and the stop strings, which the
    server applies to the text (the engine sees only stop token ids)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    # False: a prompt scored alone (OpenAI's max_tokens 0): the one token generated for its log
    # probabilities is left out of every update, of the usage, the metrics and the log line
    returns_tokens: bool = True


@dataclasses.dataclass
class _Run:
    """What a generation has returned so far, kept once for all its updates: each list only
    grows (an update reads its own length of them)."""

    token_ids: list[int] = dataclasses.field(default_factory=list)  # a stop token included
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # a stop token's not
    prompt: list[PromptScores] = dataclasses.field(default_factory=list)
    given_prompt: bool = False  # an update with tokens has had the prompt's entries


@dataclasses.dataclass(frozen=True)
class Update:
    """The request after one engine output: `delta` is the text released by it, `text` all text
    released so far; the last update has a `finish_reason`. Before the first token, an update
    may only bring prompt rows (`prompt_scores`)."""

    delta: str
    text: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    matched_stop: int | str | None  # the stop token id or stop string that ended it
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int = 0
    # with logprobs asked for: the records of `new_token_ids`, a stop token's left out (its text
    # is not part of the output either)
    new_logprobs: list[TokenLogprob] | None = None
    # with prompt log probabilities asked for: the prompt rows this output brought
    prompt_scores: PromptScores | None = None
    # ... and every prompt entry, in the first update with tokens and in the last
    prompt_logprobs: PromptLogprobs | None = None
    # once the first token is out: the server's TTFT (the route's submission to the update on
    # the event loop) and the engine's own (its `add_request` to the token on its host)
    server_ttft_s: float | None = None
    engine_ttft_s: float | None = None
    run: _Run = dataclasses.field(default_factory=_Run, repr=False)
    generated: int = 0  # len(token_ids): the run's tokens as of this update
    recorded: int = 0  # len(logprobs), likewise

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Every generated token up to this update (a stop token included): a copy, made when
        read (a response reads it once, at its end)."""
        return self.run.token_ids[:self.generated]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With logprobs asked for, the records of `token_ids` (a stop token's left out)."""
        return None if self.new_logprobs is None else self.run.logprobs[:self.recorded]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a cache tier (OpenAI's and SGLang's cached_tokens)."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


class _TextState:
    """Engine outputs -> released text: detokenized (with a tokenizer), cut at a stop string;
    and the run so far."""

    def __init__(self, tokenizer: Tokenizer | None, spec: GenerationInput) -> None:
        self._detok = (IncrementalDetokenizer(tokenizer.decode, spec.prompt_ids)
                       if tokenizer is not None else None)
        self._stops = StopStrings(spec.stop_strings)
        self._stop_ids = frozenset(spec.params.stop_token_ids)
        self._min_tokens = spec.params.min_tokens  # no stop string ends before them either
        self._returns_tokens = spec.returns_tokens
        self._released = 0
        self._searched = 0
        self._run = _Run()

    def advance(self, out: RequestOutput, server_ttft_s: float | None) -> Update:
        run = self._run
        if out.prompt_scores is not None:
            run.prompt.append(out.prompt_scores)
        if not self._returns_tokens:
            out = dataclasses.replace(out, new_token_ids=[],
                                      logprobs=None if out.logprobs is None else [])
        reason = FinishReason(out.finish_reason) if out.finish_reason else None
        matched: int | str | None = None
        new = out.new_token_ids
        new_logprobs = out.logprobs
        run.token_ids += new
        if reason is FinishReason.STOP and new and new[-1] in self._stop_ids:
            matched = new[-1]
            new = new[:-1]  # a stop token's text is not part of the output (OpenAI, SGLang)
            if new_logprobs is not None:
                new_logprobs = new_logprobs[:-1]
        run.logprobs += new_logprobs or ()
        text = self._detokenize(new, reason is not None)
        # as vLLM: a stop string is looked for once min_tokens tokens are out (in the text
        # since the last look, and the longest stop string's length before it)
        hit = (self._stops.find(text, self._searched)
               if len(run.token_ids) >= self._min_tokens else None)
        self._searched = len(text)
        if hit is not None:
            text, reason, matched = text[:hit[0]], FinishReason.STOP, hit[1]
        end = len(text) if reason is not None else self._stops.streamable(len(text))
        delta, self._released = text[self._released:end], max(end, self._released)
        return Update(delta=delta, text=text[:self._released], new_token_ids=out.new_token_ids,
                      finish_reason=reason, matched_stop=matched, prompt_tokens=out.prompt_len,
                      device_hit_tokens=out.device_hit_tokens, host_hit_tokens=out.host_hit_tokens,
                      storage_hit_tokens=out.storage_hit_tokens, new_logprobs=new_logprobs,
                      prompt_scores=out.prompt_scores,
                      prompt_logprobs=self._prompt_logprobs(out, reason is not None),
                      server_ttft_s=server_ttft_s, engine_ttft_s=out.ttft_s, run=run,
                      generated=len(run.token_ids), recorded=len(run.logprobs))

    def _prompt_logprobs(self, out: RequestOutput, final: bool) -> PromptLogprobs | None:
        """Every prompt entry, for the first update with tokens and the last (joined then)."""
        run = self._run
        if not run.prompt or not (final or (out.new_token_ids and not run.given_prompt)):
            return None
        run.given_prompt = True
        joined = PromptScores.join(run.prompt)
        assert joined is not None
        run.prompt = [joined]
        return joined.rows

    def _detokenize(self, ids: Sequence[int], final: bool) -> str:
        if self._detok is None:
            return ""
        self._detok.push(ids)
        if final:
            self._detok.finish()
        return self._detok.text


class Generation:
    """Runs one request. `updates()` yields an `Update` per engine output: tokens, an end, or
    (before the first token) prompt rows alone; the first `__anext__` submits the request and
    raises `ValueError` for a bad one (nothing queued). Leaving the iteration early (a client
    gone, a stop string) aborts the engine request."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer | None, metrics: ServerMetrics,
                 spec: GenerationInput) -> None:
        self._engine, self._metrics, self.spec = engine, metrics, spec
        self._text = _TextState(tokenizer, spec)
        self._arrival = time.perf_counter()
        self._last_token_s: float | None = None
        self._ttft_s: float | None = None

    async def updates(self) -> AsyncGenerator[Update, None]:
        stream = self._engine.stream(self.spec.prompt_ids, self.spec.params, self.spec.request_id)
        last: Update | None = None
        refused = False
        try:
            async for out in stream:
                self._time(len(out.new_token_ids) if self.spec.returns_tokens else 0)
                last = self._text.advance(out, self._ttft_s)
                yield last
                if last.finished:
                    return
        except ValueError as e:
            refused = True
            logger.info("request %s refused: %s", self.spec.request_id, e)
            raise
        finally:
            await stream.aclose()  # aborts the engine request if it is still running
            if not refused:
                self._end(last)

    def _time(self, new_tokens: int) -> None:
        """Metrics of the tokens an output returns (none when scoring)."""
        now = time.perf_counter()
        if new_tokens and self._ttft_s is None:
            self._ttft_s = now - self._arrival
            self._metrics.observe_tokens(self._ttft_s, new_tokens, first=True)
        elif new_tokens and self._last_token_s is not None:
            self._metrics.observe_tokens(now - self._last_token_s, new_tokens, first=False)
        if new_tokens:
            self._last_token_s = now

    def _end(self, last: Update | None) -> None:
        """Metrics and the request's log line; a request left early (even before its first
        output: `last` None) counts as aborted."""
        reason = (last.finish_reason.value if last is not None and last.finish_reason
                  else FinishReason.ABORT.value)
        prompt = last.prompt_tokens if last is not None else len(self.spec.prompt_ids)
        cached = last.cached_tokens if last is not None else 0
        generated = last.generated if last is not None else 0
        e2e = time.perf_counter() - self._arrival
        self._metrics.observe_end(e2e, prompt, cached, generated, reason)
        ttft = f"{self._ttft_s:.3f}s" if self._ttft_s is not None else "-"
        logger.info("request %s: prompt_tokens=%d cached_tokens=%d ttft=%s completion_tokens=%d "
                    "e2e=%.3fs finish=%s", self.spec.request_id, prompt, cached, ttft, generated,
                    e2e, reason)
