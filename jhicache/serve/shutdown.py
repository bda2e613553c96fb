"""The server's stop: at SIGINT or SIGTERM it admits no more requests (503), lets those in flight
finish within the shutdown timeout, ends the rest by closing the engine (each then gets a 503,
or a stream its error event and [DONE]), and only then lets uvicorn close its connections.

uvicorn's own graceful shutdown stops listening at once (new clients are refused a connection,
not answered) and, past its timeout, cancels the tasks still running: each then ends with a
CancelledError traceback and a plain-text 500. Here every request has had its answer before
uvicorn's shutdown starts, so its timeout only covers sending the last bytes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType
from typing import Any

import uvicorn

from jhicache.async_engine import AsyncEngine
from jhicache.serve.protocol import error_body, json_bytes

logger = logging.getLogger("jhicache.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

POLL_S = 0.05  # how often the drain looks at the requests in flight
# After the drain, the engine gets what is left of the shutdown timeout, at least this, to end
# (its process is killed past it): its last step, the aborts, the copies in flight, a storage
# tier's last writes (EngineProcess keeps 2 s of it for the exit).
CLOSE_GRACE_S = 5.0
# A warm-up stops at its next program, but a program's compile cannot be cut short: past this,
# the engine's process is killed (its compiles hold nothing a later start needs).
WARMUP_STOP_S = 2.0
ANSWER_GRACE_S = 5.0  # for the requests the engine's close ended to send their answers
# uvicorn's own shutdown, after the drain: what is left is sending the answers' last bytes
CONNECTIONS_GRACE_S = 3  # (uvicorn takes whole seconds)
ALWAYS_ADMITTED = frozenset({"/metrics"})  # a scrape while draining sees the drain


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # new requests are refused; those in flight run
    ENDING = "ending"  # the engine is closed: the requests left end with a 503


class Drain:
    """The requests in flight (counted by `Admission`) and the server's phase; `run` is the
    stop: it waits up to `timeout_s` for the requests in flight, or until asked again, then
    closes the engine."""

    def __init__(self, engine: AsyncEngine, timeout_s: float) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s={timeout_s}: expected a number >= 0")
        self.engine, self.timeout_s = engine, timeout_s
        self.phase = Phase.SERVING
        self.in_flight = 0
        self.asks = 0
        self._deadline: float | None = None  # the event loop's time the drain ends at

    def ask(self) -> None:
        """Asks for the stop; a second ask ends the drain at once. Safe in a signal handler
        (a count, read by the event loop's polls)."""
        self.asks += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.phase = Phase.DRAINING
        self._deadline = loop.time() + self.timeout_s
        logger.info("shutting down: new requests get 503; the %d in flight have up to %g s to "
                    "finish (--shutdown-timeout; a second Ctrl-C or SIGTERM ends them now)",
                    self.in_flight, self.timeout_s)
        while self.in_flight and self.asks < 2 and loop.time() < self._deadline:
            await asyncio.sleep(POLL_S)
        self.phase = Phase.ENDING
        if self.in_flight:
            logger.warning("ending the %d requests still in flight (%s): each gets a 503, or "
                           "its stream an error event", self.in_flight,
                           "asked again" if self.asks > 1 else "the shutdown timeout is over")
        await self.close_engine()
        answered = loop.time() + ANSWER_GRACE_S
        while self.in_flight and loop.time() < answered:
            await asyncio.sleep(POLL_S)

    async def close_engine(self) -> None:
        """Closes the engine (its requests end with `EngineClosedError`; a storage tier stores
        the cache meanwhile), killing its process if it has not ended within what is left of
        the drain's time, at least `CLOSE_GRACE_S` (only that once asked twice), or
        `WARMUP_STOP_S` while it warms up. Idempotent."""
        loop = asyncio.get_running_loop()
        warming = self.engine.is_running and not self.engine.is_ready
        left = 0.0
        if self._deadline is not None and self.asks < 2:
            left = self._deadline - loop.time()
        await self.engine.aclose(WARMUP_STOP_S if warming else max(left, CLOSE_GRACE_S))


class Admission:
    """ASGI middleware: counts the HTTP requests in flight for `drain`, and once it has begun
    answers new ones (but `ALWAYS_ADMITTED` paths) with a JSON 503 that closes the
    connection."""

    def __init__(self, app: App, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.phase is not Phase.SERVING and scope["path"] not in ALWAYS_ADMITTED:
            await _refuse(send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def _refuse(send: Send) -> None:
    body = json_bytes(error_body("the server is shutting down: it takes no new requests", 503,
                                 None, "shutting_down"))
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose stop begins with `drain`: SIGINT or SIGTERM (or `stop()`) starts
    it, a second one ends it at once, and uvicorn's own shutdown follows once it is over. The
    signal is not raised again after the server ends (uvicorn does, which makes SIGTERM's exit
    status 143): a stop asked for exits 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's handler of SIGINT and SIGTERM."""
        self.stop()

    def stop(self) -> None:
        """Asks for the stop (from a signal handler or any thread)."""
        if self.started:
            self.drain.ask()
        else:  # still starting: nothing is in flight
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop's tick (every 0.1 s): starts the drain once asked, and ends the
        main loop (uvicorn's shutdown follows) once it is over."""
        if self.drain.asks and self._draining is None:
            self._draining = asyncio.create_task(self.drain.run())
        if self._draining is not None and self._draining.done():
            if not self._draining.cancelled() and self._draining.exception() is not None:
                logger.error("the drain failed", exc_info=self._draining.exception())
            self.should_exit = True
        return await super().on_tick(counter)
