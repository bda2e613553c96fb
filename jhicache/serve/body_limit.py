"""BodyLimit: an ASGI middleware that refuses a request body over a size limit with 413 (OpenAI's
error body), from its Content-Length before reading any of it, or as soon as a body without one
grows past the limit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from jhicache.serve.protocol import error_body, json_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Wraps `app`: HTTP request bodies of more than `max_bytes` bytes get a 413. A body is read
    whole (up to the limit) before the app sees it, as the app's JSON parsing reads it anyway."""

    def __init__(self, app: App, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes}: expected >= 1")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it so
                await self.app(scope, receive, send)
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json_bytes(error_body(f"the request body is over the server's limit of "
                                     f"{self.max_bytes} bytes (--max-request-bytes)", 413,
                                     None, "request_too_large"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
