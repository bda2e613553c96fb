"""EngineLoop: the one loop that drives an `Engine` for an `AsyncEngine`: it applies the wire's
commands between steps, steps while it has work and sends each step's outputs up, over a
`LoopEnd` (a thread's queue, or ZeroMQ to a child process: `engine_process`)."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Protocol

import msgspec

from jhicache.cache.invariants import InvariantError
from jhicache.engine import Engine
from jhicache.request import OutputCollector, RequestOutput
from jhicache.warmup import WarmupReport
from jhicache.wire import (
    ANSWERED_WARMING,
    Abort,
    Add,
    Answer,
    Cancel,
    Close,
    Done,
    Hold,
    Outputs,
    Query,
    QueryName,
    SetStorage,
    Started,
    ToLoop,
    ToParent,
    Warmup,
)

IDLE_POLL_S = 0.1  # how long an idle loop waits for a command before it looks around again


class LoopEnd(Protocol):
    """The loop's end of a transport."""

    def receive(self, wait: bool) -> list[ToLoop]:
        """The commands queued, in the order sent; with `wait`, waits up to `IDLE_POLL_S` for
        one when none is."""

    def post(self, message: ToParent) -> None:
        """Sends `message` up."""

    def orphaned(self) -> bool:
        """True once nobody is left to read what the loop sends (a child's parent died)."""


def engine_info(engine: Engine) -> Started:
    """What a server says of `engine`."""
    model, grid = engine.model_config, engine.grid
    return Started(vocab_size=model.vocab_size,
                   max_position_embeddings=model.max_position_embeddings,
                   max_context_len=grid.max_context_len,
                   device_pages=engine.occupancy().device_pages,
                   page_size=engine.config.page_size, grid=grid.describe(),
                   config=msgspec.to_builtins(engine.config))


@dataclasses.dataclass(eq=False)
class _Followed:
    """A request the loop serves for the parent; a `final_only` one's outputs are collected
    here and sent whole once it finishes."""

    final_only: bool
    collected: OutputCollector = dataclasses.field(default_factory=OutputCollector)


def _calls(engine: Engine) -> dict[QueryName, Callable[[int], Answer]]:
    """The call table: each query's answer (but check_invariants', the loop's own)."""
    return {
        "stats": lambda call: Answer(call, stats=engine.stats()),
        "occupancy": lambda call: Answer(call, occupancy=engine.occupancy()),
        "startup": lambda call: Answer(call, startup=engine.startup),
        "compiles": lambda call: Answer(call, compiles={
            phase.value: n for phase, n in engine.compiles.counts.items()}),
        "flush_cache": lambda call: Answer(call, flag=engine.flush_cache()),
        "clear_storage": lambda call: Answer(call, flag=engine.clear_storage()),
    }


class EngineLoop:
    """Applies the parent's commands between steps and sends each step's outputs. A warm-up
    runs in a thread of its own, so that the loop answers stats meanwhile; the other commands
    wait for its end. While holds are open (`AsyncEngine.together`) it applies commands but
    takes no step, so that submissions made together start together. `run` returns at
    `Close` or once orphaned, having aborted what runs and ended the copies in flight (a
    warm-up still running is stopped at its next program); it raises what a step raised."""

    def __init__(self, engine: Engine, end: LoopEnd) -> None:
        self.engine, self.end = engine, end
        self.calls = {**_calls(engine),
                      "check_invariants": lambda call: Answer(call, problem=self._check())}
        self.followed: dict[str, _Followed] = {}
        self.holds = 0
        self.stepped = False  # a step ran since the last drain
        self.warming: threading.Thread | None = None
        self.stop_warmup = threading.Event()  # set as the loop ends: the warm-up ends too
        self.warmed: tuple[int, WarmupReport | BaseException] | None = None  # once it ended
        self.deferred: collections.deque[ToLoop] = collections.deque()
        self.close_timeout_s: float | None = None  # the `Close` that ended `run`'s

    def run(self) -> None:
        try:
            while self._apply_all(self.end.receive(wait=not self._busy())):
                if self.warming is not None and not self.warming.is_alive():
                    self._warmed()
                if not self.holds and self.warming is None:
                    self._advance()
                if self.end.orphaned():
                    break
        except BaseException:
            self._abandon()
            raise
        finally:
            if self.warming is not None:
                self.stop_warmup.set()
                self.warming.join()
        self._abort_all()

    def _busy(self) -> bool:
        return not self.holds and not self.warming and (self.engine.has_unfinished()
                                                        or self.stepped)

    def _apply_all(self, messages: list[ToLoop]) -> bool:
        """Applies `messages`, in order, but for those that wait for a warm-up's end; False at
        `Close`."""
        for message in messages:
            if isinstance(message, Close):
                self.close_timeout_s = message.timeout_s
                return False
            if isinstance(message, Hold):
                self.holds += message.delta
            elif isinstance(message, Query) and (self.warming is None
                                                 or message.name in ANSWERED_WARMING):
                self.end.post(self.calls[message.name](message.call))
            else:
                self.deferred.append(message)
        self._apply_deferred()
        return True

    def _apply_deferred(self) -> None:
        while self.deferred and self.warming is None:
            self._apply(self.deferred.popleft())

    def _apply(self, message: ToLoop) -> None:
        if isinstance(message, Warmup):
            self.warming = threading.Thread(target=self._warm, name="jhicache-warmup",
                                            args=(message,))
            self.warming.start()
        elif isinstance(message, Add):
            self._add(message)
        elif isinstance(message, Abort):
            known = self.followed.pop(message.request_id, None) is not None
            self.end.post(Done(message.call, flag=known and self.engine.abort(message.request_id)))
        elif isinstance(message, Cancel):
            if self.followed.pop(message.request_id, None) is not None:
                self.engine.abort(message.request_id)
        elif isinstance(message, Query):
            self.end.post(self.calls[message.name](message.call))
        elif isinstance(message, SetStorage):
            self.end.post(self._set_storage(message))

    def _set_storage(self, message: SetStorage) -> Done:
        try:
            config = self.engine.set_storage(message.backend, message.storage_dir,
                                             message.backend_config, message.timeout_s)
        except ValueError as e:
            return Done(message.call, error=str(e))
        return Done(message.call, config=msgspec.to_builtins(config))

    def _warm(self, message: Warmup) -> None:
        try:
            self.warmed = (message.call, self.engine.warmup(
                message.progress, message.freeze_heap, self.stop_warmup))
        except BaseException as e:  # noqa: BLE001 (raised again on the loop's thread)
            self.warmed = (message.call, e)

    def _warmed(self) -> None:
        assert self.warmed is not None
        self.warming, (call, report) = None, self.warmed
        if isinstance(report, BaseException):
            raise report
        self.end.post(Done(call))
        self._apply_deferred()

    def _add(self, message: Add) -> None:
        try:
            if len(message.ids) == 1:  # its errors name "prompt", as Engine.add_request's do
                self.engine.add_request(message.prompts[0], message.params[0], message.ids[0])
            else:
                self.engine.add_requests(message.prompts, message.params, message.ids)
        except ValueError as e:
            self.end.post(Done(message.call, error=str(e)))
            return
        for rid in message.ids:
            self.followed[rid] = _Followed(message.final_only)
        self.end.post(Done(message.call))

    def _check(self) -> str | None:
        """What is wrong with the engine's page accounting, or with the requests this loop
        follows for the parent (each must be unfinished in the engine); None when sound."""
        try:
            self.engine.check_invariants()
        except InvariantError as e:
            return str(e)
        lost = [rid for rid in self.followed if not self.engine.is_unfinished(rid)]
        return f"followed requests the engine does not run: {lost}" if lost else None

    def _advance(self) -> None:
        """One step while there is work; then one drain that ends the step and copies in
        flight; the step's outputs for followed requests go up in one message."""
        if self.engine.has_unfinished():
            outputs, self.stepped = self.engine.step(), True
        elif self.stepped:
            outputs, self.stepped = self.engine.drain(), False
        else:
            return
        items = [item for out in outputs if (item := self._item(out)) is not None]
        if items:
            self.end.post(Outputs(items))

    def _item(self, out: RequestOutput) -> RequestOutput | None:
        """What of `out` goes up: itself, or for a final-only request, the whole once it
        finished (None meanwhile, and for a request nobody follows)."""
        followed = self.followed.get(out.request_id)
        if followed is None:
            return None
        if out.finished:
            del self.followed[out.request_id]
        if not followed.final_only:
            return out
        followed.collected.add(out)
        return followed.collected.whole() if out.finished else None

    def _abort_all(self) -> None:
        for request_id in list(self.followed):
            self.engine.abort(request_id)
        self.followed.clear()
        self.engine.drain()

    def _abandon(self) -> None:
        """After a failure: best effort to leave the engine with nothing of the parent's."""
        for request_id in list(self.followed):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 (the engine already failed; its error is reported)
                pass
        self.followed.clear()


class LoopThread:
    """An `EngineLoop` in a thread of this process: commands go through a queue, the loop's
    messages to `on_message` on the loop's thread, and `on_exit` gets the reason it stopped
    (None after `Close`)."""

    def __init__(self, engine: Engine, on_message: Callable[[ToParent], None],
                 on_exit: Callable[[BaseException | None], None]) -> None:
        self.engine = engine
        self.info = engine_info(engine)
        self._on_message, self._on_exit = on_message, on_exit
        self._cond = threading.Condition()
        self._queue: collections.deque[ToLoop] = collections.deque()  # under _cond
        self.thread = threading.Thread(target=self._run, name="jhicache-engine-loop",
                                       daemon=True)
        self.thread.start()

    def send(self, message: ToLoop) -> None:
        with self._cond:
            self._queue.append(message)
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        self.send(Close())
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # the loop's end (`LoopEnd`), on the loop's thread
    def receive(self, wait: bool) -> list[ToLoop]:
        with self._cond:
            if wait and not self._queue:
                self._cond.wait(IDLE_POLL_S)
            messages = list(self._queue)
            self._queue.clear()
            return messages

    def post(self, message: ToParent) -> None:
        self._on_message(message)

    def orphaned(self) -> bool:
        return False

    def _run(self) -> None:
        reason: BaseException | None = None
        try:
            EngineLoop(self.engine, self).run()
        except BaseException as e:  # noqa: BLE001 (reported to every caller, not swallowed)
            reason = e
        finally:
            self._on_exit(reason)
