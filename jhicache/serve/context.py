"""ServerContext: what every route needs (the engine, tokenizer, metrics and model facts), and
the checks that turn a request's prompt and sampling fields into a Generation."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence

from jhicache.async_engine import AsyncEngine
from jhicache.sampling import SamplingParams
from jhicache.serve.errors import ApiError
from jhicache.serve.generation import Generation, GenerationInput
from jhicache.serve.long_texts import TokenCountError, TokenizerProcessError
from jhicache.serve.metrics import ServerMetrics
from jhicache.serve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model that the routes report and check against."""

    name: str  # the served model name (/v1/models, responses' "model")
    model_path: str  # the checkpoint directory, or "preset:<name>"
    tokenizer_path: str | None
    context_len: int  # the model's max_position_embeddings
    pool_tokens: int  # device pool capacity: prompt + new tokens must fit in it
    vocab_size: int  # token ids the model embeds (a token-id prompt's ids are below it)
    max_total_tokens: int  # the engine's limit on prompt + new tokens (its grid's)


@dataclasses.dataclass(frozen=True)
class SamplingFields:
    """The sampling fields of a request, whichever API named them."""

    max_tokens: int  # 0: the prompt scored alone (one token generated for it, not returned)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    logprobs: int | None = None  # alternatives per token; None: no log probabilities
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    prompt_logprobs_start: int = 0  # the first prompt position they are given for
    token_ids_logprob: Sequence[int] = ()  # ids whose log probabilities come at each position
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # no stop token (EOS included) before this many new tokens


@dataclasses.dataclass(frozen=True)
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    model: ModelInfo

    @classmethod
    def create(cls, engine: AsyncEngine, tokenizer: Tokenizer | None, name: str,
               model_path: str) -> ServerContext:
        """The context of a server over `engine`; refuses a tokenizer whose ids the model
        cannot embed."""
        core = engine.info
        vocab = core.vocab_size
        if tokenizer is not None and tokenizer.vocab_size > vocab:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model "
                             f"embeds {vocab}: they do not belong together")
        if tokenizer is not None:
            tokenizer.decode_vocabulary()
        info = ModelInfo(name=name, model_path=model_path,
                         tokenizer_path=tokenizer.path if tokenizer else None,
                         context_len=core.max_position_embeddings,
                         pool_tokens=core.device_pages * core.page_size,
                         vocab_size=vocab, max_total_tokens=core.max_context_len)
        return cls(engine, tokenizer, ServerMetrics(engine), info)

    def require_tokenizer(self, what: str, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer and this server has none (it was "
                                f"started without one, e.g. from a preset without --tokenizer); "
                                f"it accepts token-id prompts only: send `prompt` as a list of "
                                f"ints (OpenAI) or `input_ids` (/generate)", param)
        return self.tokenizer

    async def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of a text (special tokens added, as Hugging Face's encode does) or as given;
        400 for an empty prompt (a text whose tokens leave no room to generate too: `encode`)."""
        if isinstance(prompt, str):
            ids = await self.encode(self.require_tokenizer("a text prompt", param), prompt, param)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        return ids

    async def encode(self, tokenizer: Tokenizer, text: str, param: str,
                     add_special_tokens: bool = True) -> list[int]:
        """`tokenizer.encode` off the event loop (a long text takes seconds, and every other
        request would wait); 400 for text it cannot take, or whose tokens leave no room to
        generate (their list is not even built)."""
        try:
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens,
                                           self.model.max_total_tokens - 1)
        except TokenCountError as e:
            raise self._no_room(e.tokens, param) from None
        except ValueError as e:
            raise ApiError(400, str(e), param) from None
        except TokenizerProcessError as e:  # it died with this text: a retry may be served
            raise ApiError(503, f"the tokenizer is unavailable: {e}", param) from None

    def room(self, prompt_len: int, param: str = "messages") -> int:
        """New tokens a prompt leaves room for (context and device pool); 400 if none."""
        room = self.model.max_total_tokens - prompt_len
        if room < 1:
            raise self._no_room(prompt_len, param)
        return room

    def _no_room(self, prompt_len: int, param: str) -> ApiError:
        return ApiError(400, f"the prompt has {prompt_len} tokens, which leaves no room to "
                             f"generate in {self.model.max_total_tokens} tokens (the context "
                             f"limit: the least of the model's context, the device pool and "
                             f"--max-context-len)", param, "context_length_exceeded")

    def require_ready(self) -> None:
        """503 while the engine warms up: clients wait for /health to answer 200."""
        if self.engine.is_running and not self.engine.is_ready:
            raise ApiError(503, "the server is warming up (compiling its programs); /health "
                                "answers 200 once it serves", None, "warming_up")

    def generation(self, prompt_ids: list[int], fields: SamplingFields,
                   request_id: str | None = None) -> Generation:
        self.require_ready()
        stops = [fields.stop] if isinstance(fields.stop, str) else list(fields.stop or ())
        if stops and self.tokenizer is None:
            self.require_tokenizer("a stop string", "stop")
        spec = GenerationInput(request_id=request_id or uuid.uuid4().hex, prompt_ids=prompt_ids,
                               params=self._params(fields), stop_strings=tuple(stops),
                               returns_tokens=fields.max_tokens > 0)
        return Generation(self.engine, self.tokenizer, self.metrics, spec)

    def _params(self, fields: SamplingFields) -> SamplingParams:
        stop_ids = list(fields.stop_token_ids or ())
        if not fields.ignore_eos and self.tokenizer is not None:
            stop_ids += self.tokenizer.eos_token_ids
        if fields.top_k == 0 or fields.top_k < -1:
            raise ApiError(400, f"top_k={fields.top_k}: expected -1 (off) or at least 1",
                           "top_k")
        try:
            return SamplingParams(max_new_tokens=max(fields.max_tokens, 1),
                                  temperature=fields.temperature,
                                  top_k=fields.top_k if fields.top_k > 0 else None,
                                  top_p=fields.top_p if fields.top_p < 1 else None,
                                  seed=fields.seed, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                                  logprobs=fields.logprobs,
                                  prompt_logprobs=fields.prompt_logprobs,
                                  prompt_logprobs_start=fields.prompt_logprobs_start,
                                  token_ids_logprob=tuple(fields.token_ids_logprob),
                                  min_p=fields.min_p, presence_penalty=fields.presence_penalty,
                                  frequency_penalty=fields.frequency_penalty,
                                  repetition_penalty=fields.repetition_penalty,
                                  min_tokens=fields.min_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
