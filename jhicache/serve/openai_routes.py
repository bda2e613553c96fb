"""The OpenAI routes: POST /v1/completions and /v1/chat/completions (streamed or not) and
GET /v1/models, in the shapes the official `openai` client reads."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response

from jhicache.logprobs import TokenLogprob
from jhicache.serve.context import SamplingFields, ServerContext
from jhicache.serve.errors import ApiError
from jhicache.serve.generation import Update
from jhicache.serve.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
    token_texts,
)
from jhicache.serve.protocol import ChatCompletionRequest, CompletionRequest, JsonResponse, sse
from jhicache.serve.responses import event_stream, first_update, last_update

_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the log does


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request; a list of one prompt counts (n=1, one choice)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: got {len(prompt)} prompts; this server takes one per "
                                f"request", "prompt")
        return prompt[0]
    return prompt  # type: ignore[return-value]


def _fields(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int | None) -> SamplingFields:
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")
    if body.min_tokens > max(max_tokens, 1):
        raise ApiError(400, f"min_tokens={body.min_tokens} exceeds the {max_tokens} tokens "
                            f"asked for", "min_tokens")
    return SamplingFields(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=body.stop,
                          stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                          logprobs=logprobs, min_p=body.min_p,
                          presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty,
                          repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens)


def _refuse_tools_and_formats(body: ChatCompletionRequest) -> None:
    """Tools and response formats are not implemented: a request may name them only to ask
    for what the server does anyway (no tools; plain text)."""
    if body.tools:
        raise ApiError(400, "tools: this server does not call tools", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, f"tool_choice={body.tool_choice!r}: this server does not call "
                            f"tools", "tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: this server writes plain text only "
                            "({\"type\": \"text\"})", "response_format")


def _completion_fields(body: CompletionRequest) -> SamplingFields:
    """The fields of a completion, refusing those it cannot honour."""
    if body.best_of not in (None, 1):
        raise ApiError(400, f"best_of={body.best_of}: this server returns one completion, "
                            f"best_of must be 1", "best_of")
    if body.suffix is not None:
        raise ApiError(400, "suffix is not supported by this server", "suffix")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens=0 needs echo: it asks for the prompt alone",
                       "max_tokens")
    fields = _fields(body, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:  # the prompt's tokens scored too
        fields = dataclasses.replace(fields, prompt_logprobs=body.logprobs)
    return fields


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _usage(update: Update) -> dict[str, Any]:
    completion = update.generated
    return {"prompt_tokens": update.prompt_tokens, "completion_tokens": completion,
            "total_tokens": update.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": update.cached_tokens}}


def _finish(update: Update) -> str | None:
    return update.finish_reason.value if update.finish_reason else None


class _Reply:
    """The envelope every body and chunk of one response shares: id, kind, time, model."""

    def __init__(self, prefix: str, obj: str, model: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.object, self.model, self.created = obj, model, int(time.time())

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}


def _completion_choice(update: Update, text: str, ids: list[int],
                       logprobs: CompletionLogprobs | None) -> dict[str, Any]:
    # token_ids: vLLM's extension, for clients that bring their own tokenizer
    return {"index": 0, "text": text, "logprobs": None if logprobs is None else logprobs.value(),
            "finish_reason": _finish(update), "token_ids": ids}


def openai_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": ctx.model.name, "object": "model", "created": int(time.time()),
            "owned_by": "jhicache", "root": ctx.model.model_path,
            "max_model_len": ctx.model.max_total_tokens}]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = _single_prompt(body.prompt)
        prompt_ids = await ctx.prompt_ids(prompt, "prompt")
        fields = _completion_fields(body)
        echoed = await _prompt_text(ctx, prompt, prompt_ids) if body.echo else ""
        gen = ctx.generation(prompt_ids, fields)
        reply = _Reply("cmpl", "text_completion", ctx.model.name)
        texts = token_texts(ctx.tokenizer)
        scores_prompt = body.echo and body.logprobs is not None
        updates = gen.updates()
        first = await first_update(request, updates)
        if first is None:
            return Response(status_code=_CLIENT_GONE)

        if body.stream:
            offset = 0  # where the next token's text starts: the pieces before it
            started = False  # the first chunk (echo, the prompt's entries) is out

            def chunks(update: Update) -> Iterator[bytes]:
                nonlocal offset, started
                if not (update.new_token_ids or update.finished):
                    return  # prompt rows alone: they come whole with the first token's chunk
                head = "" if started else echoed
                prompt = update.prompt_logprobs if scores_prompt and not started else None
                started = True
                if head or update.delta or update.new_logprobs or prompt or update.finished:
                    built = None
                    if body.logprobs is not None:
                        built = completion_logprobs(prompt, update.new_logprobs or [], texts,
                                                    offset)
                        offset = built.offset
                    yield sse(reply.body([_completion_choice(
                        update, head + update.delta, update.new_token_ids, built)]))

            return event_stream(first, updates, chunks, _usage_chunk(body, reply))
        # one body at the end: the prompt's entries formatted and encoded as steps score them,
        # each part while the engine computes the next chunk, not all of them after the last
        built = (None if body.logprobs is None
                 else CompletionLogprobs(texts, 0 if scores_prompt else len(echoed)))

        def add_prompt(update: Update) -> None:
            if built is not None and scores_prompt and update.prompt_scores is not None:
                built.add_prompt(update.prompt_scores.rows)

        last = await last_update(request, first, updates, add_prompt)
        if last is None:
            return Response(status_code=_CLIENT_GONE)
        if built is not None:
            built.add_records(last.logprobs or [])
        item = _completion_choice(last, echoed + last.text, last.token_ids, built)
        return JsonResponse(reply.body([item], usage=_usage(last)))

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _refuse_tools_and_formats(body)
        tokenizer = ctx.require_tokenizer("a chat request", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        # the template writes the special tokens itself: none are added around it
        prompt_ids = await ctx.encode(tokenizer, text, "messages", add_special_tokens=False)
        limit = body.max_completion_tokens or body.max_tokens or ctx.room(len(prompt_ids))
        gen = ctx.generation(prompt_ids, _fields(body, limit, _chat_logprobs(body)))
        texts = token_texts(ctx.tokenizer)

        def logprobs(records: list[TokenLogprob] | None) -> dict[str, Any] | None:
            return None if records is None else chat_logprobs(records, texts)
        reply = _Reply("chatcmpl", "chat.completion", ctx.model.name)
        updates = gen.updates()
        first = await first_update(request, updates)
        if first is None:
            return Response(status_code=_CLIENT_GONE)

        if body.stream:
            reply.object = "chat.completion.chunk"

            def delta(update: Update, content: dict[str, str]) -> bytes:
                return sse(reply.body([{"index": 0, "delta": content,
                                        "logprobs": logprobs(update.new_logprobs),
                                        "finish_reason": _finish(update)}]))

            def chunks(update: Update) -> Iterator[bytes]:
                if update is first:  # the role comes first, alone, as OpenAI sends it
                    yield sse(reply.body([{"index": 0, "logprobs": None, "finish_reason": None,
                                           "delta": {"role": "assistant", "content": ""}}]))
                if update.delta or update.new_logprobs or update.finished:
                    yield delta(update, {"content": update.delta} if update.delta else {})

            return event_stream(first, updates, chunks, _usage_chunk(body, reply))
        last = await last_update(request, first, updates)
        if last is None:
            return Response(status_code=_CLIENT_GONE)
        message = {"role": "assistant", "content": last.text}
        return JsonResponse(reply.body([{"index": 0, "message": message,
                                         "logprobs": logprobs(last.logprobs),
                                         "finish_reason": _finish(last)}], usage=_usage(last)))

    return router


async def _prompt_text(ctx: ServerContext, prompt: str | list[int], ids: list[int]) -> str:
    """The prompt as `echo` repeats it: its text, or its token ids decoded (off the event loop:
    the engine refuses a prompt longer than its context only later)."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = ctx.require_tokenizer("echo of a token-id prompt", "echo")
    return await asyncio.to_thread(tokenizer.decode, ids)


def _usage_chunk(body: Any, reply: _Reply) -> Callable[[Update], Iterator[bytes]]:
    """The stream's last chunk: usage alone, when the request's stream_options ask for it."""
    def end(update: Update) -> Iterator[bytes]:
        if body.stream_options and body.stream_options.include_usage:
            yield sse(reply.body([], usage=_usage(update)))
    return end
