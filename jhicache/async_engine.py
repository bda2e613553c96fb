"""AsyncEngine: an asyncio face on `Engine`, whose `EngineLoop` runs in a background thread or
in a child process (`jhicache.engine_process`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing.process
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Sequence
from typing import Any

from jhicache import inputs
from jhicache.cache.invariants import InvariantError
from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.engine_loop import LoopThread
from jhicache.engine_process import EngineProcess, EngineProcessError, EngineSpec
from jhicache.request import OutputCollector, RequestOutput
from jhicache.sampling import SamplingParams
from jhicache.stats import EngineStats, Occupancy, StartupTimes
from jhicache.wire import (
    Abort,
    Add,
    Answer,
    Cancel,
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

logger = logging.getLogger("jhicache.engine")

class EngineDeadError(RuntimeError):
    """The engine loop failed; raised (from the original exception) to every waiting caller and
    to every later submission. The `AsyncEngine` serves no more; `close()` still works."""


class EngineClosedError(RuntimeError):
    """The `AsyncEngine` was closed: raised to streams still waiting and to later submissions."""


@dataclasses.dataclass(eq=False)
class _Sink:
    """Where one request's outputs go: its caller's event loop and queue.

    `last` is the message thread's (the newest output it posted); `done` is the caller's (it
    has taken the final item, so there is nothing left to abort)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    request_id: str
    prompt_len: int
    last: RequestOutput | None = None
    done: bool = False
    error: BaseException | None = None  # the caller's: taken from the queue, not yet raised


def _put_all(items: list[tuple[_Sink, RequestOutput]]) -> None:
    """On a caller's event loop: one step's outputs into their queues."""
    for sink, out in items:
        sink.queue.put_nowait(out)


@dataclasses.dataclass(eq=False)
class _Call:
    """A command awaiting its reply: an `Add`'s `sinks` are followed once it is accepted, an
    `Abort`'s request (`aborts`) ends there."""

    future: concurrent.futures.Future[Done | Answer]
    sinks: list[_Sink] = dataclasses.field(default_factory=list)
    aborts: str | None = None


class AsyncEngine:
    """Serves `Engine` requests to asyncio callers. One `EngineLoop` owns the engine, in a
    thread of this process or in a child process (`jhicache.engine_process`); this side keeps
    only the map from request id to its caller's queue, and the calls awaiting a reply.

    The loop sleeps until there is work, then calls `engine.step()` while any request is
    unfinished; each step's outputs come back in one message, posted to each request's asyncio
    queue on the caller's event loop (`call_soon_threadsafe`); once there is no work, one
    `Engine.drain` ends the step and the copies in flight. Callers never touch the engine:
    every call sends a command of the wire (`jhicache.wire`) that the loop applies between
    steps, so the event loop never blocks on a step (only the sync `close()` and the engine
    calls do). A submission is validated there by `Engine.add_request` itself, and its
    outcome comes back through a `concurrent.futures.Future` awaited with
    `asyncio.wrap_future`: a bad prompt or bad params raise `ValueError` to the caller and
    change nothing. A consumer that stops early aborts its request: on cancel or `aclose()` at
    once, on `break` once the generator is finalised (`contextlib.aclosing` makes that
    immediate too). Any event loop may call in (each request keeps its own); requests added to
    the engine directly while this owns it are stepped, but their outputs dropped.

    If `engine.step()` raises, the loop stops: each waiting caller and each later submission
    gets a fresh `EngineDeadError` (a `RuntimeError`, "engine loop failed") raised from the
    original exception, as vLLM's AsyncLLM raises its EngineDeadError. `close()` / `aclose()` /
    `async with` stop the loop: requests still in flight are aborted and their callers get
    `EngineClosedError` (a `RuntimeError`, "AsyncEngine closed").
    """

    def __init__(self, engine: Engine | EngineSpec, owns_engine: bool = False) -> None:
        """Over an `Engine` (its loop in a thread of this process), or over an `EngineSpec`
        (the engine built and stepped in a child process: `jhicache.engine_process`). With
        `owns_engine`, `close()` closes an `Engine` given here too (its storage tier stores the
        cache), as an engine process closes its own."""
        # Under _lock: the state the callers' threads and the message thread share. Messages
        # from the loop arrive on one thread (the loop's, or the receiver of the process's).
        self._lock = threading.Lock()
        self._closing = False
        self._error: BaseException | None = None  # why the loop stopped, once it failed
        self._sinks: dict[str, _Sink] = {}  # the unfinished requests by id
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ready = threading.Event()  # cleared while a warm-up runs
        self._ready.set()
        self._engine = engine if isinstance(engine, Engine) else None
        self._owns_engine = owns_engine
        self._link: LoopThread | EngineProcess = (
            LoopThread(engine, self._on_message, self._on_exit) if isinstance(engine, Engine)
            else EngineProcess(engine, self._on_message, self._on_exit))

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig = EngineConfig(),
                        process: bool = False) -> AsyncEngine:
        """Over `Engine.from_pretrained(path, config)`: built here, synchronously, or with
        `process` in a child process that steps it."""
        if process:
            return cls(EngineSpec(config, path=path))
        return cls(Engine.from_pretrained(path, config), owns_engine=True)

    @classmethod
    def from_preset(cls, name: str, config: EngineConfig = EngineConfig(), seed: int = 0,
                    process: bool = False) -> AsyncEngine:
        """Over `Engine.from_preset(name, config, seed)`, here or (`process`) in a child."""
        if process:
            return cls(EngineSpec(config, preset=name, seed=seed))
        return cls(Engine.from_preset(name, config, seed), owns_engine=True)

    @property
    def engine(self) -> Engine:
        """The engine, when its loop is a thread of this process; the loop owns it: read it,
        do not drive it. With an engine process there is none here (ValueError)."""
        if self._engine is None:
            raise ValueError("the engine runs in a child process: use AsyncEngine's own calls "
                             "(info, stats, occupancy, ...)")
        return self._engine

    @property
    def in_process(self) -> bool:
        """True when the engine is stepped in a thread of this process, False in a child."""
        return self._engine is not None

    @property
    def info(self) -> Started:
        """What a server says of the engine: vocabulary, context limits, pool, grid, config."""
        return self._link.info

    @property
    def thread(self) -> threading.Thread:
        """The thread the loop's messages arrive on (the loop's own, or the receiver of the
        engine process's); it ends once the engine is closed or has failed."""
        return self._link.thread

    @property
    def process(self) -> multiprocessing.process.BaseProcess | None:
        """The engine's child process, or None when it runs in a thread here."""
        return self._link.process if isinstance(self._link, EngineProcess) else None

    @property
    def is_ready(self) -> bool:
        """False while `start_warmup`'s warm-up runs (and once closed or failed)."""
        return self._ready.is_set() and self.is_running

    def start_warmup(self, progress: bool = True, freeze_heap: bool = False) -> None:
        """Has the loop run `Engine.warmup(progress, freeze_heap)` (in the engine's process)
        before the commands sent after this; `is_ready` is False until it ends. A warm-up that
        fails stops the loop, as a failed step does."""
        self._ready.clear()
        call = _Call(concurrent.futures.Future())
        call.future.add_done_callback(lambda _: self._ready.set())
        self._send(lambda n: Warmup(n, progress, freeze_heap), call)

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving, once its loop (or process) failed; None otherwise."""
        with self._lock:
            return self._error

    def when_stopped(self, callback: Callable[[], object]) -> None:
        """Calls `callback` (on some thread) once the engine has stopped: closed or failed."""
        self._stopped.add_done_callback(lambda _: callback())

    @property
    def is_running(self) -> bool:
        """False once closed or failed."""
        with self._lock:
            return not self._closing and self._error is None

    # ---- engine calls (blocking; from any thread but the loop's) ----------------------------

    def stats(self) -> EngineStats:
        """`Engine.stats()`, wherever the engine runs."""
        stats = self._query("stats").stats
        assert stats is not None
        return stats

    def occupancy(self) -> Occupancy:
        """`Engine.occupancy()`, wherever the engine runs."""
        occupancy = self._query("occupancy").occupancy
        assert occupancy is not None
        return occupancy

    def startup(self) -> StartupTimes:
        """`Engine.startup`: where the start went (the warm-up's report once it ran)."""
        startup = self._query("startup").startup
        assert startup is not None
        return startup

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled (or read back) by phase, "warmup" and "serving"."""
        counts = self._query("compiles").compiles
        assert counts is not None
        return counts

    def flush_cache(self) -> bool:
        """`Engine.flush_cache()`: empties both tiers; False while requests are unfinished."""
        return self._query("flush_cache").flag

    def check_invariants(self) -> None:
        """`Engine.check_invariants()` between two steps, wherever the engine runs; also that
        every request the loop follows for this one is unfinished there. Raises
        `InvariantError`."""
        problem = self._query("check_invariants").problem
        if problem is not None:
            raise InvariantError(problem)

    def clear_storage(self) -> bool:
        """`Engine.clear_storage()`: deletes the storage tier's pages; False while requests are
        unfinished or its backend cannot be reached."""
        return self._query("clear_storage").flag

    def set_storage(self, backend: str | None, storage_dir: str | None = None,
                    backend_config: str | None = None,
                    timeout_s: float | None = 30.0) -> dict[str, Any]:
        """`Engine.set_storage(...)` between two steps, wherever the engine runs (blocks until
        it is done); returns the engine's config then, as `info.config` now shows it. Raises
        ValueError (nothing changed) for a setting the engine refused."""
        call = _Call(concurrent.futures.Future())
        self._send(lambda n: SetStorage(n, backend, storage_dir, backend_config, timeout_s),
                   call)
        done = call.future.result()
        assert isinstance(done, Done)
        if done.error is not None:
            raise ValueError(done.error)
        assert done.config is not None
        self.info.config = done.config  # the engine's config changed with its storage tier
        return done.config

    def _query(self, name: QueryName) -> Answer:
        call = _Call(concurrent.futures.Future())
        self._send(lambda n: Query(n, name), call)
        answer = call.future.result()
        assert isinstance(answer, Answer)
        return answer

    # ---- public API ----------------------------------------------------------------------

    async def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                     request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Submits one prompt and yields its outputs as `Engine.step` gives them, deltas: the
        new tokens (`new_token_ids`) and their log probabilities as tokens appear, and before
        the first token the prompt rows each step scores (`prompt_scores`); a consumer that
        lags gets the outputs waiting for it merged into one. The last has `finished=True`. A
        consumer that wants the whole so far keeps it (`OutputCollector`). The request is
        submitted at the first iteration; leaving the loop early, or cancelling the consuming
        task, aborts it. Raises `ValueError` for bad input (at the first iteration),
        `EngineDeadError` or `EngineClosedError` as described above."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        prompts = [array.tolist() for array in inputs.prompt_arrays([prompt])]
        [sink] = self._sinks_for([rid], prompts)
        try:
            await self._submit([sink], prompts, [params], final_only=False)
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
        """Runs `prompts` concurrently with every other request; returns their whole runs in
        order (as `Engine.generate`: `token_ids`, `new_token_ids` both every generated token).
        All are validated together: a bad one raises `ValueError` and none is queued.
        Cancelling the call aborts its requests. Only the whole runs cross from the loop
        (vLLM's FINAL_ONLY), which collects them."""
        arrays = inputs.prompt_arrays(prompts)  # what no engine could take is refused here
        per_prompt = inputs.per_prompt_params(arrays, params)
        if not arrays:
            return []
        lists = [array.tolist() for array in arrays]
        ids = [uuid.uuid4().hex for _ in lists]
        sinks = self._sinks_for(ids, lists)
        try:
            await self._submit(sinks, lists, per_prompt, final_only=True)
            return [await self._next(sink) for sink in sinks]
        finally:
            for sink in sinks:
                self._cancel(sink)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request submitted here; its stream then ends with a finished output whose
        `finish_reason` is "abort" (as in vLLM). False if unknown, already finished, or the
        loop stopped."""
        call = _Call(concurrent.futures.Future(), aborts=request_id)
        try:
            self._send(lambda n: Abort(n, request_id), call)
            done = await asyncio.wrap_future(call.future)
        except (EngineDeadError, EngineClosedError):
            return False
        assert isinstance(done, Done)
        return done.flag

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Submissions made inside are applied together, between two steps, as one
        `Engine.generate` call adds its prompts (so that requests sent at the same moment are
        scheduled as one batch, whatever the loop was doing). The loop takes no step while the
        block is open. A stream submits at its first iteration: let each reach it (create its
        task, then `await asyncio.sleep(0)`) before the block ends."""
        held = self._hold(1)
        try:
            yield
        finally:
            if held:
                self._hold(-1)

    def _hold(self, delta: int) -> bool:
        """Sends `Hold(delta)` unless the engine stopped; whether it was sent."""
        with self._lock:
            if self._closing or self._error is not None:
                return False
            try:
                self._link.send(Hold(delta))
            except EngineProcessError:
                return False
            return True

    def close(self, timeout: float | None = None) -> None:
        """Stops the loop (waiting for the step that runs to end), aborting the requests still
        in flight: their callers get `EngineClosedError`. Idempotent; works after a failure
        too. An engine process is asked to end, then killed after `timeout`; an engine this
        object owns is closed (`Engine.close(timeout)`) once its loop has stopped."""
        self._link.close(timeout)
        if self._owns_engine and self._engine is not None and self._error is None:
            try:
                self._engine.close(timeout)
            except ValueError as e:  # a request the loop did not end: nothing is lost but time
                logger.warning("the engine was not closed: %s", e)

    async def aclose(self, timeout: float | None = None) -> None:
        """`close(timeout)` without blocking the event loop."""
        await asyncio.to_thread(self.close, timeout)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---- the callers' side ---------------------------------------------------------------

    @staticmethod
    def _sinks_for(ids: list[str], prompts: list[list[int]]) -> list[_Sink]:
        loop = asyncio.get_running_loop()
        return [_Sink(loop, asyncio.Queue(), rid, len(p)) for rid, p in zip(ids, prompts)]

    async def _submit(self, sinks: list[_Sink], prompts: list[list[int]],
                      params: list[SamplingParams], final_only: bool) -> None:
        """Sends the requests and waits until the loop has added them (or refused them)."""
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
        call = _Call(concurrent.futures.Future(), sinks=sinks)
        try:
            self._send(lambda n: Add(n, [sink.request_id for sink in sinks], prompts, params,
                                     final_only), call)
            done = await asyncio.wrap_future(call.future)  # a cancel here cancels it too
        except BaseException:
            with self._lock:  # refused, never added, or added as its caller left
                for sink in sinks:
                    sink.done = True
                    if self._sinks.get(sink.request_id) is sink:
                        self._drop(sink)
            raise
        assert isinstance(done, Done)
        if done.error is not None:
            for sink in sinks:
                sink.done = True
            raise ValueError(done.error)

    @staticmethod
    async def _next(sink: _Sink) -> RequestOutput:
        """The next output; outputs already queued behind it (a consumer that lags the steps)
        come merged into one, their deltas joined, so that a slow consumer catches up in one
        iteration."""
        if sink.error is not None:
            item: RequestOutput | BaseException = sink.error
        else:
            item = await sink.queue.get()
            if isinstance(item, RequestOutput) and not item.finished and not sink.queue.empty():
                merged = OutputCollector()
                merged.add(item)
                while not item.finished and not sink.queue.empty():
                    later = sink.queue.get_nowait()
                    if isinstance(later, BaseException):
                        sink.error = later  # raised at the next call, after these tokens
                        break
                    merged.add(later)
                    item = later
                item = merged.merged()
        if isinstance(item, BaseException):
            sink.done = True
            raise item
        sink.done = item.finished
        return item

    def _cancel(self, sink: _Sink) -> None:
        """The consumer is gone: abort the request unless it already ended. Never raises, never
        waits (safe in a `finally` of a generator being closed)."""
        if sink.done:
            return
        sink.done = True
        with self._lock:
            if self._sinks.get(sink.request_id) is sink:
                self._drop(sink)

    def _drop(self, sink: _Sink) -> None:
        """Under the lock: stops following `sink`'s request and has the loop abort it."""
        del self._sinks[sink.request_id]
        if self._closing or self._error is not None:
            return
        try:
            self._link.send(Cancel(sink.request_id))
        except EngineProcessError:  # it has just gone: `_on_exit` tells every caller
            pass

    def _send(self, message: Callable[[int], ToLoop], call: _Call) -> None:
        """Sends the command `message(call id)`, whose reply settles `call`; raises the
        stopped error once the engine stopped."""
        with self._lock:
            if self._closing or self._error is not None:
                raise self._stopped_error()
            n, self._next_call = self._next_call, self._next_call + 1
            self._calls[n] = call
            try:
                self._link.send(message(n))
            except EngineProcessError:  # it has just gone: `_on_exit` tells every caller
                del self._calls[n]
                raise self._stopped_error() from None

    def _stopped_error(self) -> RuntimeError:
        """A fresh error for one caller (each raises its own; the cause is shared)."""
        if self._error is not None:
            error = EngineDeadError("engine loop failed")
            error.__cause__ = self._error
            return error
        return EngineClosedError("AsyncEngine closed")

    # ---- the message thread (the loop's, or the engine process's receiver) ----------------

    def _on_message(self, message: ToParent) -> None:
        """A message from the loop, in the order it sent them."""
        if isinstance(message, Outputs):
            self._deliver(message.items)
        else:
            self._settle(message)

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Posts a step's outputs to their callers: one wake-up per event loop, not per output
        (each `call_soon_threadsafe` writes the loop's wake-up pipe and takes the lock the
        loop's thread wants)."""
        posts: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue  # not ours, or its consumer is gone
                sink.last = out
                if out.finished:
                    del self._sinks[out.request_id]
                posts.setdefault(sink.loop, []).append((sink, out))
        for loop, items in posts.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # "Event loop is closed": nobody will read them
                with self._lock:
                    for sink, out in items:
                        if not out.finished and self._sinks.get(sink.request_id) is sink:
                            self._drop(sink)

    def _settle(self, reply: Done | Answer) -> None:
        with self._lock:
            call = self._calls.pop(reply.call)
            if isinstance(reply, Done) and reply.error is None:
                reply = self._accepted(call, reply)
        if call.future.set_running_or_notify_cancel():
            call.future.set_result(reply)
        elif call.sinks and isinstance(reply, Done) and reply.error is None:
            with self._lock:  # added, but its caller is gone
                for sink in call.sinks:
                    if self._sinks.get(sink.request_id) is sink:
                        self._drop(sink)

    def _accepted(self, call: _Call, reply: Done) -> Done:
        """Under the lock: an accepted command's effect here, before the loop's next output."""
        for sink in call.sinks:
            self._sinks[sink.request_id] = sink
        if call.aborts is not None:
            aborted = self._sinks.pop(call.aborts, None) if reply.flag else None
            if aborted is not None:
                self._post(aborted, _abort_output(aborted))
            return Done(reply.call, flag=aborted is not None)
        return reply

    @staticmethod
    def _post(sink: _Sink, item: RequestOutput | BaseException) -> bool:
        """Puts `item` on the sink's queue from this thread; False if its event loop closed."""
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _on_exit(self, reason: BaseException | None) -> None:
        """The loop has stopped (closed, or failed with `reason`): every caller still waiting
        gets the error."""
        with self._lock:
            self._closing = True
            if reason is not None:
                self._error = reason
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for sink in sinks:
            self._post(sink, self._stopped_error())
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(self._stopped_error())
        self._stopped.set_result(None)


def _abort_output(sink: _Sink) -> RequestOutput:
    """The final output of a request aborted by id: nothing new, finished, reason "abort"."""
    last = sink.last
    if last is not None:
        return dataclasses.replace(last, new_token_ids=[], finished=True, finish_reason="abort",
                                   logprobs=None if last.logprobs is None else [],
                                   prompt_scores=None)
    return RequestOutput(request_id=sink.request_id, new_token_ids=[], finished=True,
                         prompt_len=sink.prompt_len, device_hit_tokens=0, host_hit_tokens=0,
                         ttft_s=None, finish_reason="abort")
