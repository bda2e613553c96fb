"""AsyncEngine: an asyncio face on `Engine`, whose loop runs in a background thread it owns or
in a child process (`jhicache.engine_process`)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing.process
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from jhicache import inputs
from jhicache.cache.invariants import InvariantError
from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.engine_process import (
    Abort,
    Add,
    Call,
    Cancel,
    EngineProcess,
    EngineProcessError,
    EngineSpec,
    Hold,
    Outputs,
    Reply,
    Started,
    ToParent,
    engine_info,
    step_or_drain,
)
from jhicache.logprobs import TokenLogprob
from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams
from jhicache.stats import EngineStats, Occupancy, StartupTimes


class EngineDeadError(RuntimeError):
    """The engine loop failed; raised (from the original exception) to every waiting caller and
    to every later submission. The `AsyncEngine` serves no more; `close()` still works."""


class EngineClosedError(RuntimeError):
    """The `AsyncEngine` was closed: raised to streams still waiting and to later submissions."""


@dataclasses.dataclass(eq=False)
class _Sink:
    """Where one request's outputs go: its caller's event loop and queue.

    `last` is the loop thread's (the newest output it posted); `done` is the caller's (it has
    taken the final item, so there is nothing left to abort)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    request_id: str
    prompt_len: int
    final_only: bool  # generate(): only the finished output is posted
    last: RequestOutput | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # with a process: so far
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # likewise
    done: bool = False
    error: BaseException | None = None  # the caller's: taken from the queue, not yet raised


def _put_all(items: list[tuple[_Sink, RequestOutput]]) -> None:
    """On a caller's event loop: one step's outputs into their queues."""
    for sink, out in items:
        sink.queue.put_nowait(out)


@dataclasses.dataclass(eq=False)
class _Add:
    """Submit these requests together (all or none); `future` gets their ids or the error."""

    sinks: list[_Sink]
    prompts: list[Sequence[int] | np.ndarray]
    params: list[SamplingParams]
    future: concurrent.futures.Future[list[str]]


@dataclasses.dataclass(eq=False)
class _Abort:
    """Abort by id (the public `abort`): the request's stream ends with an "abort" output."""

    request_id: str
    future: concurrent.futures.Future[bool]


@dataclasses.dataclass(eq=False)
class _Cancel:
    """Abort `sink`'s request because its consumer went away; a no-op if the request already
    ended or its submission failed (the id may be someone else's by then)."""

    sink: _Sink


@dataclasses.dataclass(eq=False)
class _Warmup:
    """Run `Engine.warmup` in the loop thread before anything queued after it."""

    progress: bool
    freeze_heap: bool


@dataclasses.dataclass(eq=False)
class _Query:
    """An engine call whose result a caller waits for (stats, occupancy, ...)."""

    name: str
    future: concurrent.futures.Future[Any]


_Command = _Add | _Abort | _Cancel | _Warmup | _Query


class AsyncEngine:
    """Serves `Engine` requests to asyncio callers; one background thread owns the engine.

    The thread sleeps until there is work, then calls `engine.step()` while any request is
    unfinished, posting each output to its request's asyncio queue on the caller's event loop
    (`call_soon_threadsafe`), and after the last one steps twice more so that the step in flight
    and the copies end. Callers never touch the engine: `stream`, `generate` and `abort` enqueue
    a command that the thread applies between steps, so the event loop never blocks on a step
    (only the sync `close()` does). A submission is validated there by `Engine.add_request`
    itself, and its outcome comes back through a `concurrent.futures.Future` awaited with
    `asyncio.wrap_future`: a bad prompt or bad params raise `ValueError` to the caller and
    change nothing. A consumer that stops early aborts its request: on cancel or `aclose()` at
    once, on `break` once the generator is finalised (`contextlib.aclosing` makes that
    immediate too). Any event loop may call in (each request keeps its own); requests added to
    the engine directly while this owns it are stepped, but their outputs dropped.

    If `engine.step()` raises, the loop stops: each waiting caller and each later submission
    gets a fresh `EngineDeadError` (a `RuntimeError`, "engine loop failed") raised from the
    original exception, as vLLM's AsyncLLM raises its EngineDeadError. `close()` / `aclose()` /
    `async with` stop the thread: requests still in flight are aborted and their callers get
    `EngineClosedError` (a `RuntimeError`, "AsyncEngine closed").
    """

    def __init__(self, engine: Engine | EngineSpec) -> None:
        """Over an `Engine` (its loop in a thread of this process), or over an `EngineSpec`
        (the engine built and stepped in a child process: `jhicache.engine_process`)."""
        self._cond = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()  # under _cond
        self._closing = False  # under _cond
        self._holds = 0  # under _cond: open together() blocks; the thread waits while > 0
        self._error: BaseException | None = None  # set (under _cond) once the thread stops
        # The loop thread's (the receiver thread's with a process): unfinished requests by id
        self._sinks: dict[str, _Sink] = {}
        self._stepped = False  # the loop thread's: a step ran since the last `Engine.drain`
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ready = threading.Event()  # cleared while a warm-up runs
        self._ready.set()
        self._engine: Engine | None = None
        self._process: EngineProcess | None = None
        self._calls: dict[int, _Command] = {}  # with a process, under _cond: awaiting replies
        self._next_call = 0
        if isinstance(engine, EngineSpec):
            self._process = EngineProcess(engine, self._on_message, self._on_exit)
            self._info = self._process.started
            return
        self._engine = engine
        self._info = engine_info(engine)
        self._thread = threading.Thread(target=self._run, name="jhicache-async-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig = EngineConfig(),
                        process: bool = False) -> AsyncEngine:
        """Over `Engine.from_pretrained(path, config)`: built here, synchronously, or with
        `process` in a child process that steps it."""
        if process:
            return cls(EngineSpec(config, path=path))
        return cls(Engine.from_pretrained(path, config))

    @classmethod
    def from_preset(cls, name: str, config: EngineConfig = EngineConfig(), seed: int = 0,
                    process: bool = False) -> AsyncEngine:
        """Over `Engine.from_preset(name, config, seed)`, here or (`process`) in a child."""
        if process:
            return cls(EngineSpec(config, preset=name, seed=seed))
        return cls(Engine.from_preset(name, config, seed))

    @property
    def engine(self) -> Engine:
        """The engine, when its loop is a thread of this process; its loop thread owns it:
        read it, do not drive it. With an engine process there is none here (ValueError)."""
        if self._engine is None:
            raise ValueError("the engine runs in a child process: use AsyncEngine's own calls "
                             "(info, stats, occupancy, ...)")
        return self._engine

    @property
    def in_process(self) -> bool:
        """True when the engine is stepped in a thread of this process, False in a child."""
        return self._process is None

    @property
    def info(self) -> Started:
        """What a server says of the engine: vocabulary, context limits, pool, grid, config."""
        return self._info

    @property
    def thread(self) -> threading.Thread:
        """The loop thread; it ends once the engine is closed or has failed."""
        if self._process is not None:
            return self._process.receiver
        return self._thread

    @property
    def process(self) -> multiprocessing.process.BaseProcess | None:
        """The engine's child process, or None when it runs in a thread here."""
        return self._process.process if self._process is not None else None

    @property
    def is_ready(self) -> bool:
        """False while `start_warmup`'s warm-up runs (and once closed or failed)."""
        return self._ready.is_set() and self.is_running

    def start_warmup(self, progress: bool = True, freeze_heap: bool = False) -> None:
        """Has the loop thread run `Engine.warmup(progress, freeze_heap)` (in the engine's
        process) before the commands queued after this; `is_ready` is False until it ends. A
        warm-up that fails stops the loop, as a failed step does."""
        self._ready.clear()
        self._enqueue(_Warmup(progress, freeze_heap), raise_if_stopped=True)

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving, once its loop (or process) failed; None otherwise."""
        with self._cond:
            return self._error

    def when_stopped(self, callback: Callable[[], object]) -> None:
        """Calls `callback` (on some thread) once the engine has stopped: closed or failed."""
        self._stopped.add_done_callback(lambda _: callback())

    @property
    def is_running(self) -> bool:
        """False once closed or failed."""
        with self._cond:
            return not self._closing and self._error is None

    # ---- engine calls (blocking; from any thread but the loop's) ----------------------------

    def stats(self) -> EngineStats:
        """`Engine.stats()`, wherever the engine runs."""
        return self._call("stats", EngineStats)

    def occupancy(self) -> Occupancy:
        """`Engine.occupancy()`, wherever the engine runs."""
        return self._call("occupancy", Occupancy)

    def startup(self) -> StartupTimes:
        """`Engine.startup`: where the start went (the warm-up's report once it ran)."""
        return self._call("startup", StartupTimes)

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled (or read back) by phase, "warmup" and "serving"."""
        return self._call("compiles", dict[str, int])

    def flush_cache(self) -> bool:
        """`Engine.flush_cache()`: empties both tiers; False while requests are unfinished."""
        return self._call("flush_cache", bool)

    def check_invariants(self) -> None:
        """`Engine.check_invariants()` between two steps, wherever the engine runs; with an
        engine process, also that every request it follows for this one is unfinished there.
        Raises `InvariantError`."""
        if self._engine is not None:
            self._engine.check_invariants()  # under the engine's lock: between two steps
            return
        problem = self._call("check_invariants", str | None)
        if problem is not None:
            raise InvariantError(problem)

    def clear_storage(self) -> bool:
        """`Engine.clear_storage()`: deletes the storage tier's pages; False while requests are
        unfinished."""
        return self._call("clear_storage", bool)

    def _call(self, name: str, kind: Any) -> Any:
        if self._engine is not None:
            engine = self._engine
            return {"stats": engine.stats, "occupancy": engine.occupancy,
                    "startup": lambda: engine.startup,
                    "compiles": lambda: {p.value: n for p, n in engine.compiles.counts.items()},
                    "flush_cache": engine.flush_cache,
                    "clear_storage": engine.clear_storage}[name]()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._enqueue(_Query(name, future), raise_if_stopped=True)
        return msgspec.convert(future.result(), kind)

    # ---- public API ----------------------------------------------------------------------

    async def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                     request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Submits one prompt and yields its outputs as tokens appear (`new_token_ids` each
        time, `token_ids` so far; a consumer that lags gets the outputs waiting for it merged
        into one), and before its first token as steps fill its prompt log probabilities (no
        tokens: `Engine.step`); the last has `finished=True`. The request is submitted at
        the first iteration; leaving the loop early, or cancelling the consuming task, aborts it.
        Raises `ValueError` for bad input (at the first iteration), `EngineDeadError` or
        `EngineClosedError` as described above."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        [sink] = self._sinks_for([rid], [prompt], final_only=False)
        try:
            await self._submit([sink], [prompt], [params])
            while True:
                out = await self._next(sink)
                yield out
                if out.finished:
                    return
        finally:
            self._cancel(sink)

    async def generate(self, prompts: Sequence[Sequence[int]],
                       params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                       ) -> list[RequestOutput]:
        """Runs `prompts` concurrently with every other request; returns their final outputs in
        order, `new_token_ids` holding every generated token (as `Engine.generate`). All are
        validated together: a bad one raises `ValueError` and none is queued. Cancelling the
        call aborts its requests. Only final outputs cross threads (vLLM's FINAL_ONLY)."""
        prompts = _prompt_list(prompts)  # validated once, by Engine.add_requests
        per_prompt = inputs.per_prompt_params(prompts, params)
        if not prompts:
            return []
        ids = [uuid.uuid4().hex for _ in prompts]
        sinks = self._sinks_for(ids, prompts, final_only=True)
        try:
            await self._submit(sinks, prompts, per_prompt)
            finals = [await self._next(sink) for sink in sinks]
        finally:
            for sink in sinks:
                self._cancel(sink)
        return [dataclasses.replace(out, new_token_ids=list(out.token_ids)) for out in finals]

    async def abort(self, request_id: str) -> bool:
        """Aborts a request submitted here; its stream then ends with a finished output whose
        `finish_reason` is "abort" (as in vLLM). False if unknown, already finished, or the
        loop stopped."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        if not self._enqueue(_Abort(request_id, future), raise_if_stopped=False):
            return False
        return await asyncio.wrap_future(future)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Submissions made inside are applied together, between two steps, as one
        `Engine.generate` call adds its prompts (so that requests sent at the same moment are
        scheduled as one batch, whatever the thread was doing). The loop thread takes no step
        while the block is open. A stream submits at its first iteration: let each reach it
        (create its task, then `await asyncio.sleep(0)`) before the block ends."""
        if self._process is not None:
            self._process.send(Hold(1))
        with self._cond:
            self._holds += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify()
            if self._process is not None and self.is_running:
                self._process.send(Hold(-1))

    def close(self, timeout: float | None = None) -> None:
        """Stops the loop thread (waiting for the step that runs to end), aborting the requests
        still in flight: their callers get `EngineClosedError`. Idempotent; works after a
        failure too. An engine process is asked to end, then killed after `timeout`."""
        if self._process is not None:
            self._process.close(timeout)
            return
        self._request_close()
        self._thread.join(timeout)

    async def aclose(self) -> None:
        """`close()` without blocking the event loop."""
        if self._process is not None:
            await asyncio.to_thread(self._process.close)
            return
        self._request_close()
        await asyncio.wrap_future(self._stopped)
        self._thread.join()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---- the callers' side ---------------------------------------------------------------

    @staticmethod
    def _sinks_for(ids: list[str], prompts: Sequence[object], final_only: bool) -> list[_Sink]:
        loop = asyncio.get_running_loop()
        return [_Sink(loop, asyncio.Queue(), rid, _length(p), final_only)
                for rid, p in zip(ids, prompts)]

    async def _submit(self, sinks: list[_Sink], prompts: list[Sequence[int] | np.ndarray],
                      params: list[SamplingParams]) -> None:
        """Queues the requests and waits until the loop thread has added them (or refused)."""
        future: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        try:
            self._enqueue(_Add(sinks, prompts, params, future), raise_if_stopped=True)
            await asyncio.wrap_future(future)  # a cancel here cancels it too, if not yet applied
        except Exception:
            for sink in sinks:  # refused: nothing to abort
                sink.done = True
            raise

    @staticmethod
    async def _next(sink: _Sink) -> RequestOutput:
        """The next output; outputs already queued behind it (a consumer that lags the steps)
        come merged into one, so that a slow consumer catches up in one iteration."""
        if sink.error is not None:
            item: RequestOutput | BaseException = sink.error
        else:
            item = await sink.queue.get()
            while isinstance(item, RequestOutput) and not item.finished and not sink.queue.empty():
                later = sink.queue.get_nowait()
                if isinstance(later, BaseException):
                    sink.error = later  # raised at the next call, after these tokens
                    break
                item = dataclasses.replace(
                    later, new_token_ids=item.new_token_ids + later.new_token_ids,
                    prompt_logprobs=(item.prompt_logprobs if later.prompt_logprobs is None
                                     else later.prompt_logprobs))
        if isinstance(item, BaseException):
            sink.done = True
            raise item
        sink.done = item.finished
        return item

    def _cancel(self, sink: _Sink) -> None:
        """The consumer is gone: abort the request unless it already ended. Never raises, never
        waits (safe in a `finally` of a generator being closed)."""
        if not sink.done:
            sink.done = True
            self._enqueue(_Cancel(sink), raise_if_stopped=False)

    def _enqueue(self, command: _Command, raise_if_stopped: bool) -> bool:
        with self._cond:
            if self._closing or self._error is not None:
                if raise_if_stopped:
                    raise self._stopped_error()
                return False
            if self._process is None:
                self._commands.append(command)
                self._cond.notify()
                return True
            call = self._next_call
            self._next_call += 1
            if isinstance(command, _Cancel):
                if self._sinks.get(command.sink.request_id) is command.sink:
                    del self._sinks[command.sink.request_id]
            else:
                self._calls[call] = command
        try:
            self._process.send(_wire(command, call))
        except (TypeError, msgspec.EncodeError) as e:  # what no engine could take as a prompt
            with self._cond:
                self._calls.pop(call, None)
            raise ValueError(f"prompts must be lists of integer token ids: {e}") from None
        except EngineProcessError:  # it has just gone: `_on_exit` has told every caller
            with self._cond:
                self._calls.pop(call, None)
            if raise_if_stopped:
                raise self._stopped_error() from None
            return False
        return True

    def _request_close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _stopped_error(self) -> RuntimeError:
        """A fresh error for one caller (each raises its own; the cause is shared)."""
        if self._error is not None:
            error = EngineDeadError("engine loop failed")
            error.__cause__ = self._error
            return error
        return EngineClosedError("AsyncEngine closed")

    # ---- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (commands := self._wait_for_work()) is not None:
                for command in commands:
                    self._apply(command)
                self._advance()
            self._abort_all()
        except BaseException as e:  # noqa: BLE001 (reported to every caller, not swallowed)
            with self._cond:
                self._error = e
        finally:
            self._stop()

    def _wait_for_work(self) -> list[_Command] | None:
        """The commands queued, once there is work; None once closing."""
        with self._cond:
            while not self._closing and (self._holds or not (self._commands
                                                             or self._engine_busy())):
                self._cond.wait()
            if self._closing:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _engine_busy(self) -> bool:
        return self.engine.has_unfinished() or self._stepped

    def _advance(self) -> None:
        """One step while there is work; once there is none, one `Engine.drain` that ends the
        step and copies in flight (and delivers that step's outputs)."""
        outputs, self._stepped = step_or_drain(self.engine, self._stepped)
        self._deliver(outputs or ())

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Warmup):
            self.engine.warmup(command.progress, command.freeze_heap)
            self._ready.set()
        elif isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            command.future.set_result(self._abort(command.request_id))
        elif isinstance(command, _Cancel):
            sink = command.sink
            if self._sinks.get(sink.request_id) is sink:
                self._drop(sink)

    def _add(self, command: _Add) -> None:
        """Adds every request of the command, or (the first refusal raised) none of them."""
        if not command.future.set_running_or_notify_cancel():
            return  # the caller was cancelled before the thread got to it
        ids = [sink.request_id for sink in command.sinks]
        try:
            if len(ids) == 1:  # its errors name "prompt", as Engine.add_request's do
                added = [self.engine.add_request(command.prompts[0], command.params[0], ids[0])]
            else:
                added = self.engine.add_requests(command.prompts, command.params, ids)
        except Exception as e:  # noqa: BLE001 (the caller's: it raises there; none was queued)
            command.future.set_exception(e)
            return
        for sink in command.sinks:
            self._sinks[sink.request_id] = sink
        command.future.set_result(added)

    def _abort(self, request_id: str) -> bool:
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return False  # not ours, or already finished
        self.engine.abort(request_id)
        self._post(sink, _abort_output(sink))
        return True

    def _drop(self, sink: _Sink) -> None:
        """Aborts `sink`'s request; its consumer is gone."""
        del self._sinks[sink.request_id]
        if self._process is not None:
            self._process.send(Cancel(sink.request_id))
        else:
            self.engine.abort(sink.request_id)

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Posts a step's outputs to their callers: one wake-up per event loop, not per output
        (each `call_soon_threadsafe` writes the loop's wake-up pipe and takes the lock the
        loop's thread wants)."""
        posts: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # not ours, or its consumer is gone
            if self._process is not None and not out.finished:  # new tokens only: see Outputs
                sink.tokens += out.new_token_ids
                out = dataclasses.replace(out, token_ids=list(sink.tokens))
                if out.logprobs is not None:
                    sink.logprobs += out.logprobs
                    out = dataclasses.replace(out, logprobs=list(sink.logprobs))
            sink.last = out
            if out.finished:
                del self._sinks[out.request_id]
            if out.finished or not sink.final_only:
                posts.setdefault(sink.loop, []).append((sink, out))
        for loop, items in posts.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # "Event loop is closed": nobody will read them
                for sink, out in items:
                    if not out.finished:
                        self._drop(sink)

    @staticmethod
    def _post(sink: _Sink, item: RequestOutput | BaseException) -> bool:
        """Puts `item` on the sink's queue from this thread; False if its event loop closed."""
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _abort_all(self) -> None:
        """On close: aborts the requests in flight (their callers get `EngineClosedError`), then
        ends the steps and copies in flight."""
        for sink in list(self._sinks.values()):
            self._post(sink, self._stopped_error())
            self._drop(sink)
        if self._stepped:
            self._stepped = False
            self.engine.drain()

    def _stop(self) -> None:
        """Last act of the loop thread: every caller still waiting gets the error."""
        with self._cond:
            self._closing = True
            commands = list(self._commands)
            self._commands.clear()
        for sink in self._sinks.values():  # left only by a failure
            self._post(sink, self._stopped_error())
        self._abandon_requests()
        self._sinks.clear()
        for command in commands:
            self._refuse(command)
        self._stopped.set_result(None)

    def _abandon_requests(self) -> None:
        """After a failure: best effort to leave the engine with nothing of ours queued."""
        for rid in list(self._sinks):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 (the engine already failed; its error is reported)
                pass

    def _refuse(self, command: _Command) -> None:
        if isinstance(command, _Add):
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(self._stopped_error())
        elif isinstance(command, _Abort):
            command.future.set_result(False)
        elif isinstance(command, _Query):
            command.future.set_exception(self._stopped_error())

    # ---- the receiver thread (an engine process) -----------------------------------------

    def _on_message(self, message: ToParent) -> None:
        """A message from the engine process, in the order it sent them."""
        with self._cond:  # with a process, the sinks and the calls are under the lock
            if isinstance(message, Outputs):
                self._deliver(message.items)
            elif isinstance(message, Reply):
                self._settle(self._calls.pop(message.call), message)

    def _settle(self, command: _Command, reply: Reply) -> None:
        if isinstance(command, _Add):
            ids = [sink.request_id for sink in command.sinks]
            if not command.future.set_running_or_notify_cancel():
                if reply.error is None:  # added, but its caller is gone
                    for rid in ids:
                        self._process_send(Cancel(rid))
            elif reply.error is not None:
                command.future.set_exception(ValueError(reply.error))
            else:
                for sink in command.sinks:
                    self._sinks[sink.request_id] = sink
                command.future.set_result(ids)
        elif isinstance(command, _Abort):
            aborted = self._sinks.pop(command.request_id, None) if reply.value else None
            if aborted is not None:
                self._post(aborted, _abort_output(aborted))
            command.future.set_result(aborted is not None)
        elif isinstance(command, _Warmup):
            self._ready.set()
        elif isinstance(command, _Query):
            if reply.error is not None:
                command.future.set_exception(ValueError(reply.error))
            else:
                command.future.set_result(reply.value)

    def _process_send(self, message: Any) -> None:
        assert self._process is not None
        self._process.send(message)

    def _on_exit(self, reason: EngineProcessError | None) -> None:
        """The engine process is gone: every caller still waiting gets the error."""
        with self._cond:
            self._closing = True
            if reason is not None:
                self._error = reason
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for sink in sinks:
            self._post(sink, self._stopped_error())
        for command in calls:
            self._refuse(command)
        self._stopped.set_result(None)


def _wire(command: _Command, call: int) -> Any:
    """`command` as the message the engine process takes."""
    if isinstance(command, _Add):
        return Add(call, [sink.request_id for sink in command.sinks], command.prompts,
                   command.params, command.sinks[0].final_only)
    if isinstance(command, _Abort):
        return Abort(call, command.request_id)
    if isinstance(command, _Cancel):
        return Cancel(command.sink.request_id)
    if isinstance(command, _Warmup):
        return Call(call, "warmup", command.progress, command.freeze_heap)
    return Call(call, command.name)


def _prompt_list(prompts: object) -> list:
    """`prompts` as a list (its items checked by `Engine.add_requests`); a clear error for
    what cannot be a list of prompts at all."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    return list(prompts)


def _length(prompt: object) -> int:
    try:
        return len(prompt)  # type: ignore[arg-type]
    except TypeError:
        return 0


def _abort_output(sink: _Sink) -> RequestOutput:
    """The final output of a request aborted by id: what it had, finished, reason "abort"."""
    if sink.last is not None:
        return dataclasses.replace(sink.last, new_token_ids=[], finished=True,
                                   finish_reason="abort")
    return RequestOutput(request_id=sink.request_id, token_ids=[], new_token_ids=[], finished=True,
                         prompt_len=sink.prompt_len, device_hit_tokens=0, host_hit_tokens=0,
                         ttft_s=None, finish_reason="abort")
