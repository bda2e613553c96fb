"""SGLang's native routes: POST /generate (streamed or not), POST /flush_cache, POST
/clear_hicache_storage_backend, GET /health, GET /get_model_info, and Prometheus' GET
/metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jhicache.request import FinishReason
from jhicache.serve.context import SamplingFields, ServerContext
from jhicache.serve.errors import ApiError
from jhicache.serve.generation import Update
from jhicache.serve.logprobs import TokenTexts, sglang_logprobs, token_texts
from jhicache.serve.protocol import GenerateRequest, JsonResponse, sse
from jhicache.serve.responses import event_stream, first_update, last_update
from jhicache.serve.storage_routes import cleared_storage, storage_tier

_CLIENT_GONE = 499


async def _prompt(ctx: ServerContext, body: GenerateRequest) -> list[int]:
    """The one prompt: `text` (tokenized here) or `input_ids`, not both; a list of one counts."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of `text` and `input_ids`", "text")
    prompt: Any = body.text if body.text is not None else body.input_ids
    param = "text" if body.text is not None else "input_ids"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"{param}: got {len(prompt)} prompts; this server takes one per "
                                f"request", param)
        prompt = prompt[0]
    return await ctx.prompt_ids(prompt, param)


def _finish_reason(update: Update) -> dict[str, Any] | None:
    """SGLang's form: {"type": "length", "length": n}, {"type": "stop", "matched": id or
    string}, {"type": "abort", "message": ...}; None while running."""
    if update.finish_reason is None:
        return None
    if update.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": update.generated}
    if update.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": update.matched_stop}
    return {"type": "abort", "message": "aborted"}


async def _when_idle(call: Callable[[], bool], done: str, refused: str) -> Response:
    """An engine call that only acts while no request runs: 200, or 400 when refused. It waits
    for the step that runs (a lock, or the engine process's reply): off the event loop."""
    if await asyncio.to_thread(call):
        return PlainTextResponse(f"{done}.\n")
    return PlainTextResponse(f"{refused}: requests are running or waiting.\n", status_code=400)


def _payload(rid: str, update: Update, text: TokenTexts | None,
             named: Sequence[int] = ()) -> dict[str, Any]:
    """The response (or a stream's event: text, ids and log probabilities cumulative)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": _finish_reason(update),
            "prompt_tokens": update.prompt_tokens, "completion_tokens": update.generated,
            "cached_tokens": update.cached_tokens,
            "cached_tokens_details": {"device": update.device_hit_tokens,
                                      "host": update.host_hit_tokens,
                                      "storage": update.storage_hit_tokens},
            "server_ttft_s": update.server_ttft_s, "engine_ttft_s": update.engine_ttft_s}
    if update.logprobs is not None:
        meta.update(sglang_logprobs(update.logprobs, text, update.prompt_logprobs, named))
    return {"text": update.text, "output_ids": update.token_ids, "meta_info": meta}


def _logprobs(ctx: ServerContext, body: GenerateRequest,
              fields: SamplingFields) -> tuple[SamplingFields, TokenTexts | None]:
    """The fields with the log probabilities asked for (generated tokens; with
    `logprob_start_len` >= 0 the prompt's from there on), and how a token's text is written."""
    if body.token_ids_logprob and not body.return_logprob:
        raise ApiError(400, "token_ids_logprob: their log probabilities come with the tokens'; "
                            "set return_logprob too", "token_ids_logprob")
    if body.logprob_start_len < -1:
        raise ApiError(400, f"logprob_start_len={body.logprob_start_len}: expected -1 (output "
                            f"tokens only) or a prompt position", "logprob_start_len")
    text = token_texts(ctx.tokenizer) if body.return_text_in_logprobs else None
    if not body.return_logprob:
        return fields, text
    top = body.top_logprobs_num
    if body.logprob_start_len >= 0:
        fields = dataclasses.replace(fields, prompt_logprobs=top,
                                     prompt_logprobs_start=body.logprob_start_len)
    return dataclasses.replace(fields, logprobs=top, token_ids_logprob=_named(body)), text


def _named(body: GenerateRequest) -> list[int]:
    """The ids `token_ids_logprob` names: a list, or a list of one list (one prompt)."""
    named = body.token_ids_logprob or []
    ids = [i for i in named if isinstance(i, int)]
    lists = [i for i in named if isinstance(i, list)]
    if not lists:
        return ids
    if len(lists) != 1 or ids:
        raise ApiError(400, f"token_ids_logprob holds {len(lists)} lists: this server takes "
                            f"one prompt a request", "token_ids_logprob")
    return lists[0]


def _limits(ctx: ServerContext) -> dict[str, Any]:
    """What a request may ask for: prompt + new tokens, requests at once, prompt tokens a step
    computes (longer prompts are chunked), and the page size."""
    config = ctx.engine.info.config
    return {"max_total_tokens": ctx.model.max_total_tokens,
            "max_running_requests": config["max_running_requests"],
            "chunked_prefill_size": config["chunked_prefill_tokens"],
            "page_size": config["page_size"]}


def native_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if body.lora_path:
            raise ApiError(400, "lora_path: this server serves no adapters", "lora_path")
        sp = body.sampling_params
        if sp.min_new_tokens > sp.max_new_tokens:
            raise ApiError(400, f"sampling_params.min_new_tokens={sp.min_new_tokens} exceeds "
                                f"max_new_tokens={sp.max_new_tokens}", "sampling_params")
        fields = SamplingFields(max_tokens=sp.max_new_tokens, temperature=sp.temperature,
                                top_p=sp.top_p, top_k=sp.top_k, seed=sp.sampling_seed,
                                stop=sp.stop, stop_token_ids=sp.stop_token_ids,
                                ignore_eos=sp.ignore_eos, min_p=sp.min_p,
                                presence_penalty=sp.presence_penalty,
                                frequency_penalty=sp.frequency_penalty,
                                repetition_penalty=sp.repetition_penalty,
                                min_tokens=sp.min_new_tokens)
        fields, text = _logprobs(ctx, body, fields)
        named = fields.token_ids_logprob
        prompt_ids = await _prompt(ctx, body)
        gen = ctx.generation(prompt_ids, fields, body.rid)
        rid = gen.spec.request_id
        updates = gen.updates()
        first = await first_update(request, updates)
        if first is None:
            return Response(status_code=_CLIENT_GONE)
        if body.stream:
            def chunks(update: Update) -> Iterator[bytes]:
                if update.new_token_ids or update.finished:  # not prompt rows alone
                    yield sse(_payload(rid, update, text, named))  # text is cumulative

            return event_stream(first, updates, chunks, lambda _: ())
        last = await last_update(request, first, updates)
        if last is None:
            return Response(status_code=_CLIENT_GONE)
        return JsonResponse(_payload(rid, last, text, named))

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return await _when_idle(ctx.engine.flush_cache, "Cache flushed", "Cache not flushed")

    @router.api_route("/clear_hicache_storage_backend", methods=["GET", "POST"])
    async def clear_storage() -> Response:  # SGLang's name
        status, why = await cleared_storage(ctx)
        if status != 200:
            return PlainTextResponse(f"Storage not cleared: {why}.\n", status_code=status)
        return PlainTextResponse("Storage cleared.\n")

    @router.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            error = ctx.engine.error
            cause = error.__cause__ or error if error is not None else None
            reason = "closed" if cause is None else str(cause).splitlines()[0]
            return PlainTextResponse(f"engine stopped: {reason}\n", status_code=503)
        if not ctx.engine.is_ready:
            return PlainTextResponse("warming up\n", status_code=503)
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": ctx.model.model_path, "tokenizer_path": ctx.model.tokenizer_path,
                "is_generation": True, "served_model_name": ctx.model.name,
                "context_length": ctx.model.context_len, "pool_tokens": ctx.model.pool_tokens,
                "vocab_size": ctx.model.vocab_size, **_limits(ctx)}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """The engine's settings (as SGLang's server_args), its limits and step grid, and where
        its start went."""
        info = ctx.engine.info
        startup = await asyncio.to_thread(ctx.engine.startup)
        warm = startup.warmup
        # SGLang's name for the tier, None without one (the config's storage_backend keeps its
        # default, "file", where no storage_dir is set)
        tier = storage_tier(info.config)["hicache_storage_backend"]
        return {**info.config, **_limits(ctx), "hicache_storage_backend": tier,
                "served_model_name": ctx.model.name,
                "model_path": ctx.model.model_path, "grid": info.grid,
                "ready": ctx.engine.is_ready,
                "engine_pid": None if ctx.engine.process is None else ctx.engine.process.pid,
                "startup": {"weights_s": startup.weights_s, "pools_s": startup.pools_s,
                            "warmup": None if warm is None else {**dataclasses.asdict(warm),
                                                                 "seconds": warm.seconds}}}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(ctx.metrics.render), media_type=CONTENT_TYPE_LATEST)

    return router
