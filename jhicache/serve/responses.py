"""How a Generation becomes an HTTP response: an event stream or one JSON body; either way a
client that goes away before the end aborts its request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from jhicache.async_engine import EngineClosedError, EngineDeadError
from jhicache.serve.errors import ApiError, ended_by_shutdown
from jhicache.serve.generation import Update
from jhicache.serve.protocol import SSE_DONE, error_body, sse

logger = logging.getLogger("jhicache.serve")

Encoder = Callable[[Update], Iterable[bytes]]


async def first_update(request: Request, updates: AsyncGenerator[Update, None]) -> Update | None:
    """The first update: the request is submitted and has its first token (or has ended);
    None if the client disconnected first (the request is then aborted). A request the engine
    refuses (prompt too long for the context or the pool, a token id out of the vocabulary...)
    is a 400, and nothing of it stays queued."""

    async def submit() -> Update:
        try:
            return await anext(updates)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    return await _unless_disconnected(request, submit(), updates)


def event_stream(first: Update, updates: AsyncGenerator[Update, None], chunks: Encoder,
                 end: Encoder) -> StreamingResponse:
    """SSE: `chunks(update)` for each update, `end(last)` after the last one, then [DONE].

    Starlette cancels the body when the client disconnects; the cancel reaches the engine
    stream inside `updates`, which aborts the request."""

    async def body() -> AsyncIterator[bytes]:
        try:
            update = first
            for chunk in chunks(update):
                yield chunk
            while not update.finished:
                update = await anext(updates)
                for chunk in chunks(update):
                    yield chunk
            for chunk in end(update):
                yield chunk
        except EngineClosedError:  # the server's drain ended it: headers are sent, say it here
            yield sse(ended_by_shutdown().body())
        except EngineDeadError as e:
            logger.error("stream ended by the engine: %s", e)
            yield sse(error_body(f"engine unavailable: {e}", 503))
        finally:
            await updates.aclose()
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def last_update(request: Request, first: Update, updates: AsyncGenerator[Update, None],
                      each: Callable[[Update], None] | None = None) -> Update | None:
    """Runs the request to its end, passing `first` and each later update to `each`; None if
    the client disconnected first (it was aborted)."""

    async def finish() -> Update:
        update = first
        while True:
            if each is not None:
                each(update)
            if update.finished:
                return update
            update = await anext(updates)

    try:
        return await _unless_disconnected(request, finish(), updates)
    finally:
        await updates.aclose()  # ends the generation now: its metrics and log line


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Update],
                               updates: AsyncGenerator[Update, None]) -> Update | None:
    """`work`'s result, or None if the client disconnects first. Nothing cancels a handler
    whose client has left, so the work is raced against the connection's disconnect message;
    cancelling it reaches the engine stream inside `updates`, which aborts the request."""
    run = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (run, gone):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if run.cancelled():
        await updates.aclose()
        return None
    return run.result()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message on the connection is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
