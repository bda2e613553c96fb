"""The wire format: request bodies of the OpenAI and SGLang endpoints as pydantic models (strict
types, unknown fields refused), the OpenAI error body and the server-sent-event framing."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

PositiveInt = Annotated[int, Field(ge=1)]
LogprobCount = Annotated[int, Field(ge=0, le=20)]  # jhicache.logprobs.MAX_LOGPROBS
TokenIds = list[Annotated[int, Field(ge=0)]]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's presence and frequency range
RepetitionPenalty = Annotated[float, Field(gt=0)]  # 1: off
MinP = Annotated[float, Field(ge=0, le=1)]
SSE_DONE = b"data: [DONE]\n\n"


class _Body(BaseModel):
    # strict: "5" is not an int nor 1 a bool (a wrong type is a 400, not a silent cast);
    # a field this server does not implement is a 400 naming it (extra_forbidden), never
    # ignored: a client relying on it would get other results than it asked for
    model_config = ConfigDict(strict=True, extra="forbid")


class _Penalties(_Body):
    """The penalties and cuts both APIs name alike (SGLang's names, vLLM's too)."""

    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Penalties):
    """Sampling fields shared by both OpenAI endpoints (`top_k`, `min_p`, `min_tokens`,
    `repetition_penalty`, `ignore_eos` and `stop_token_ids` are the extensions vLLM and SGLang
    accept too)."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: int = -1  # -1: off (vLLM's and SGLang's convention); 0 and below -1 are refused
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # refused when set (400 naming the field), not ignored: a client relying on them would
    # get other results than it asked for
    logit_bias: dict[str, float] | None = None
    # SGLang's, which sglang-router writes into every request it forwards: accepted at the
    # value that asks for what this server does anyway, refused (400 naming it) otherwise
    no_stop_trim: Literal[False] = False
    skip_special_tokens: Literal[True] = True
    return_hidden_states: Literal[False] = False


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions: one prompt, text or token ids (a list of one is accepted too)."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=0)] = 16  # 0: with echo, the prompt scored alone
    logprobs: LogprobCount | None = None  # alternatives per token (0: the chosen one only)
    echo: bool = False  # the prompt's text before the completion's
    best_of: PositiveInt | None = None  # 1 only
    suffix: str | None = None  # refused


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, as chat templates expect)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions; with no max tokens, the rest of the context is the limit."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None  # with logprobs: alternatives per token
    # accepted only where they ask for what the server does anyway (refused otherwise): no
    # tools, and text out
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # SGLang's, as sglang-router forwards them (see _OpenAISampling); with no reasoning parser
    # here, either value of the reasoning pair asks for the same text
    continue_final_message: Literal[False] = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class NativeSampling(_Penalties):
    """SGLang's `sampling_params` (its defaults: 128 new tokens, temperature 1)."""

    max_new_tokens: PositiveInt = 128
    min_new_tokens: Annotated[int, Field(ge=0)] = 0
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: int = -1
    sampling_seed: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    n: Literal[1] = 1


class GenerateRequest(_Body):
    """POST /generate: `text` or `input_ids` (one prompt; a list of one is accepted too).
    `return_logprob` adds the generated tokens' log probabilities to `meta_info`."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: NativeSampling = NativeSampling()
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: LogprobCount = 0
    logprob_start_len: int = -1  # -1: output tokens only; else the prompt's from there on
    # ids whose log probabilities come at every position given (a list of one list accepted,
    # as for input_ids); needs return_logprob
    token_ids_logprob: TokenIds | list[TokenIds] | None = None
    return_text_in_logprobs: bool = False
    lora_path: str | None = None  # SGLang's: refused unless empty (this server has no adapter)
    # SGLang's, which sglang-router writes into every /generate it forwards (`model` null):
    # accepted at the value that asks for what this server does anyway, refused otherwise
    model: str | None = None
    log_metrics: Literal[True] = True
    return_hidden_states: Literal[False] = False
    background: Literal[False] = False
    no_logs: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_bytes(payload: Any) -> bytes:
    """`payload` as compact UTF-8 JSON, by msgspec's encoder: a scored prompt's body holds
    lists of a token's worth of values per position, which it writes several times quicker
    than the standard library's."""
    return msgspec.json.encode(payload)


class JsonResponse(Response):
    """A JSON response body written by `json_bytes`."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json_bytes(payload) + b"\n\n"
