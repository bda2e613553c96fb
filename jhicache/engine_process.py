"""EngineProcess: an `Engine` and its step loop in a child process, driven over ZeroMQ.

The parent (the server's process: HTTP, tokenizing, detokenizing) sends commands down one PUSH
socket; the child applies them between steps, steps while it has work, and sends back on another
one message per step with every output of that step (token ids only), plus the replies to
commands. Messages are msgpack (`msgspec`), tagged by type. So the step loop never shares an
interpreter lock with the parent's work, as SGLang's scheduler process and vLLM's EngineCore do.

Life cycle: the child builds its engine from an `EngineSpec`, reports `Started` (what the parent
needs to know of it), and serves until `Close` (requests in flight are aborted, copies end) or
until its parent is gone (it checks whenever it idles). A failure in the child is reported as
`Failed` before it exits; the parent notices a child that vanished without a word too.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from jhicache.cache.invariants import InvariantError
from jhicache.config import EngineConfig
from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams

_IDLE_POLL_MS = 100  # how often an idle child looks at its parent, and the parent at its child
_ANSWERED_WARMING = ("stats", "occupancy", "startup", "compiles")  # calls a warm-up lets through


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How the child builds its engine: from a checkpoint (`path`), a preset (`preset`, `seed`)
    or a picklable `factory` returning an `Engine` (tests); with JAX's persistent compilation
    cache in `compilation_cache` (None: off), logging at `log_level`."""

    config: EngineConfig = EngineConfig()
    path: str | None = None
    preset: str | None = None
    seed: int = 0
    factory: Callable[[], Any] | None = None
    compilation_cache: str | None = None
    log_level: str | None = None

    def build(self) -> Any:
        from jhicache.engine import Engine

        if self.log_level is not None:
            logging.basicConfig(level=self.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if self.compilation_cache is not None:  # every program, however quickly it compiled
            import jax

            jax.config.update("jax_compilation_cache_dir", self.compilation_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if self.factory is not None:
            return self.factory()
        if self.path is not None:
            return Engine.from_pretrained(self.path, self.config)
        if self.preset is not None:
            return Engine.from_preset(self.preset, self.config, self.seed)
        raise ValueError("EngineSpec needs a path, a preset or a factory")


# ---- messages, parent to child ------------------------------------------------------------

class Add(msgspec.Struct, tag=True):
    """Queue these requests together, all or none (`Engine.add_requests`)."""

    call: int
    ids: list[str]
    prompts: list[Any]  # as the caller gave them (numpy sent as Python): the child checks them
    params: list[SamplingParams]
    final_only: bool


class Abort(msgspec.Struct, tag=True):
    call: int
    request_id: str


class Cancel(msgspec.Struct, tag=True):
    """The consumer is gone: abort without a reply."""

    request_id: str


class Call(msgspec.Struct, tag=True):
    """An engine call with a reply: stats, occupancy, startup, compiles, flush_cache,
    clear_storage, check_invariants, warmup."""

    call: int
    name: str
    progress: bool = False
    freeze_heap: bool = False  # warmup's


class Hold(msgspec.Struct, tag=True):
    """Take no step while holds are open (+1 opens one, -1 closes it)."""

    delta: int


class Close(msgspec.Struct, tag=True):
    pass


ToChild = Add | Abort | Cancel | Call | Hold | Close


# ---- messages, child to parent ------------------------------------------------------------

class Started(msgspec.Struct, tag=True):
    """The engine is built: what a server says of it."""

    vocab_size: int
    max_position_embeddings: int
    max_context_len: int
    device_pages: int
    grid: dict[str, Any]
    config: dict[str, Any]


class Reply(msgspec.Struct, tag=True):
    call: int
    value: Any = None
    error: str | None = None  # a ValueError's message: the call was refused


class Outputs(msgspec.Struct, tag=True):
    """Every output of one step for a request the parent follows. A running request's output
    carries its new tokens only (`token_ids` empty: the parent appends them to its own list;
    `logprobs`, where asked for, those of the new tokens),
    so a step's message does not grow with the outputs' lengths; a final one carries all."""

    items: list[RequestOutput]


class Failed(msgspec.Struct, tag=True):
    """The child's loop raised; it exits after this."""

    error: str
    trace: str


class Closed(msgspec.Struct, tag=True):
    pass


ToParent = Started | Reply | Outputs | Failed | Closed


def engine_info(engine: Any) -> Started:
    """What a server says of `engine` (wherever it runs)."""
    model, grid = engine.model_config, engine.grid
    return Started(vocab_size=model.vocab_size,
                   max_position_embeddings=model.max_position_embeddings,
                   max_context_len=grid.max_context_len,
                   device_pages=engine.occupancy().device_pages, grid=grid.describe(),
                   config=msgspec.to_builtins(engine.config))


def step_or_drain(engine: Any, stepped: bool, cumulative: bool = True
                  ) -> tuple[list[RequestOutput] | None, bool]:
    """What a loop over `engine` does next: a step while it has work; once it has none, one
    `drain` that ends the step and copies in flight. Returns (their outputs, as
    `Engine.step(cumulative)` gives them, or None with nothing to do; whether a step ran since
    the last drain)."""
    if engine.has_unfinished():
        return engine.step(cumulative), True
    if stepped:
        return engine.drain(cumulative), False
    return None, False


def _numpy_as_python(obj: Any) -> Any:
    """What a caller may pass in a prompt besides Python ints: numpy arrays and numbers, sent
    as Python's (the child checks them as an engine in process would)."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not a token id")


def child_encoder() -> msgspec.msgpack.Encoder:
    """The child's messages' encoder: NumPy arrays in them (a scored prompt's columns) go as
    their raw bytes, which the parent's decoder views as arrays again (`parent_decoder`)."""
    return msgspec.msgpack.Encoder(enc_hook=_array_to_wire)


def parent_decoder() -> msgspec.msgpack.Decoder[ToParent]:
    """The parent's decoder of the child's messages (`child_encoder`'s)."""
    return msgspec.msgpack.Decoder(ToParent, dec_hook=_array_from_wire)


def _array_to_wire(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    raise TypeError(f"{type(obj).__name__} has no wire form")


def _array_from_wire(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, np.dtype(dtype)).reshape(shape)  # read-only: not refilled
    raise TypeError(f"{kind} has no wire form")


class EngineProcessError(RuntimeError):
    """The engine process failed, exited or could not start."""


# ---- the parent's side --------------------------------------------------------------------

class EngineProcess:
    """Starts the child and talks to it. `send` may be called from any thread; `on_message` is
    called on one receiver thread, in the order the child sent, and `on_exit` once with the
    reason when the child is gone (None after a clean `Close`)."""

    def __init__(self, spec: EngineSpec, on_message: Callable[[ToParent], None],
                 on_exit: Callable[[EngineProcessError | None], None],
                 start_timeout: float = 600.0) -> None:
        self._on_message, self._on_exit = on_message, on_exit
        self._dir = tempfile.mkdtemp(prefix="jhicache-engine-")
        self._ctx = zmq.Context()
        self._down = self._ctx.socket(zmq.PUSH)
        self._down.bind(f"ipc://{self._dir}/down")
        self._up = self._ctx.socket(zmq.PULL)
        self._up.bind(f"ipc://{self._dir}/up")
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_numpy_as_python)
        self._decoder = parent_decoder()
        self._closing = False
        context = multiprocessing.get_context("spawn")  # JAX does not survive a fork
        self.process = context.Process(target=_child_main, name="jhicache-engine", daemon=True,
                                       args=(spec, self._dir, os.getpid()))
        self.process.start()
        self.started = self._wait_started(start_timeout)
        self.receiver = threading.Thread(target=self._receive, name="jhicache-engine-receiver",
                                        daemon=True)
        self.receiver.start()

    def _wait_started(self, timeout: float) -> Started:
        waited = 0.0
        while waited < timeout:
            if self._up.poll(_IDLE_POLL_MS):
                message = self._decoder.decode(self._up.recv())
                if isinstance(message, Started):
                    return message
                if isinstance(message, Failed):
                    self._shutdown()
                    raise EngineProcessError(f"the engine process failed to start: "
                                             f"{message.error}\n{message.trace}")
            elif not self.process.is_alive():
                self._shutdown()
                raise EngineProcessError("the engine process exited while starting (exit code "
                                         f"{self.process.exitcode})")
            waited += _IDLE_POLL_MS / 1000
        self.process.kill()
        self._shutdown()
        raise EngineProcessError(f"the engine process did not start within {timeout:.0f} s")

    def send(self, message: ToChild) -> None:
        """Sends `message`; TypeError for what msgpack cannot carry (numpy arrays and numbers
        go as Python's)."""
        data = self._encoder.encode(message)
        with self._send_lock:
            try:
                self._down.send(data)
            except zmq.ZMQError as e:  # its sockets closed: the child has gone
                raise EngineProcessError(f"the engine process is gone ({e})") from None

    def close(self, timeout: float | None = None) -> None:
        """Asks the child to end (it aborts what runs) and waits for it and the receiver."""
        self._closing = True
        if self.process.is_alive():
            try:
                self.send(Close())
            except EngineProcessError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if threading.current_thread() is not self.receiver:
            self.receiver.join()

    def _receive(self) -> None:
        reason: EngineProcessError | None = None
        try:
            while True:
                if self._up.poll(_IDLE_POLL_MS):
                    message = self._decoder.decode(self._up.recv())
                    if isinstance(message, Closed):
                        break
                    if isinstance(message, Failed):
                        reason = EngineProcessError(f"the engine loop failed: {message.error}\n"
                                                    f"{message.trace}")
                        break
                    self._on_message(message)
                elif not self.process.is_alive():
                    if not self._closing or self.process.exitcode:
                        reason = EngineProcessError("the engine process exited (exit code "
                                                    f"{self.process.exitcode})")
                    break
        finally:
            self._on_exit(reason)  # callers learn first, so that none sends to a closed socket
            with self._send_lock:
                self._shutdown()

    def _shutdown(self) -> None:
        self._down.close(linger=0)
        self._up.close(linger=0)
        self._ctx.term()
        for name in ("down", "up"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


# ---- the child's side ---------------------------------------------------------------------

def _child_main(spec: EngineSpec, directory: str, parent_pid: int) -> None:
    """The engine process: Ctrl-C is the parent's to handle (it sends `Close`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    down, up = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    down.connect(f"ipc://{directory}/down")
    up.connect(f"ipc://{directory}/up")
    encoder = child_encoder()
    try:
        engine = spec.build()
        up.send(encoder.encode(engine_info(engine)))
        _ChildLoop(engine, down, up, parent_pid).run()
        up.send(encoder.encode(Closed()))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, then the child exits)
        up.send(encoder.encode(Failed(repr(e), traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        down.close(linger=0)
        up.close(linger=1000)
        ctx.term()


class _ChildLoop:
    """Applies the parent's commands between steps and sends each step's outputs."""

    def __init__(self, engine: Any, down: zmq.Socket, up: zmq.Socket, parent_pid: int) -> None:
        self.engine, self.down, self.up, self.parent_pid = engine, down, up, parent_pid
        self.encoder = child_encoder()
        self.decoder = msgspec.msgpack.Decoder(ToChild)
        self.final_only: dict[str, bool] = {}  # the requests the parent follows
        self.holds = 0
        self.stepped = False  # a step ran since the last drain
        # A warm-up runs in a thread of its own, so that the loop answers stats meanwhile; the
        # other commands wait for its end (as a warm-up in the parent's loop thread makes them)
        self.warming: threading.Thread | None = None
        self.warmed: tuple[int, Any] | None = None  # (call, its report or error), once ended
        self.deferred: list[ToChild] = []

    def run(self) -> None:
        while True:
            busy = not self.holds and not self.warming and (self.engine.has_unfinished()
                                                            or self.stepped)
            if self.down.poll(0 if busy else _IDLE_POLL_MS):
                if not self._apply_queued():
                    break
            elif os.getppid() != self.parent_pid:
                break  # the parent is gone: nobody will read what this serves
            if self.warming is not None and not self.warming.is_alive():
                self._warmed()
            if not self.holds and self.warming is None:
                self._advance()
        if self.warming is not None:
            self.warming.join()
        self._abort_all()

    def _warm(self, call: int, progress: bool, freeze_heap: bool) -> None:
        try:
            self.warmed = (call, self.engine.warmup(progress, freeze_heap))
        except BaseException as e:  # noqa: BLE001 (raised again on the loop's thread)
            self.warmed = (call, e)

    def _warmed(self) -> None:
        assert self.warmed is not None
        self.warming, (call, report) = None, self.warmed
        if isinstance(report, BaseException):
            raise report
        self._reply(call, report)
        deferred, self.deferred = self.deferred, []
        for message in deferred:
            self._apply(message)

    def _apply_queued(self) -> bool:
        """Applies every queued command; False at `Close`."""
        while True:
            try:
                message = self.decoder.decode(self.down.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            if isinstance(message, Close):
                return False
            self._apply(message)

    def _apply(self, message: ToChild) -> None:
        if isinstance(message, Call) and message.name == "warmup":
            self.warming = threading.Thread(target=self._warm, name="jhicache-warmup",
                                            args=(message.call, message.progress,
                                                  message.freeze_heap))
            self.warming.start()
        elif self.warming is not None and not (isinstance(message, Call)
                                               and message.name in _ANSWERED_WARMING):
            self.deferred.append(message)
        elif isinstance(message, Add):
            self._add(message)
        elif isinstance(message, Abort):
            known = self.final_only.pop(message.request_id, None) is not None
            self._reply(message.call, known and self.engine.abort(message.request_id))
        elif isinstance(message, Cancel):
            if self.final_only.pop(message.request_id, None) is not None:
                self.engine.abort(message.request_id)
        elif isinstance(message, Hold):
            self.holds += message.delta
        elif isinstance(message, Call):
            self._reply(message.call, self._call(message))

    def _add(self, message: Add) -> None:
        try:
            if len(message.ids) == 1:  # its errors name "prompt", as Engine.add_request's do
                self.engine.add_request(message.prompts[0], message.params[0], message.ids[0])
            else:
                self.engine.add_requests(message.prompts, message.params, message.ids)
        except ValueError as e:
            self.up.send(self.encoder.encode(Reply(message.call, error=str(e))))
            return
        self.final_only.update(dict.fromkeys(message.ids, message.final_only))
        self._reply(message.call, message.ids)

    def _check(self) -> str | None:
        """What is wrong with the engine's page accounting, or with the requests this process
        follows for the parent (each must be unfinished in the engine); None when sound."""
        try:
            self.engine.check_invariants()
        except InvariantError as e:
            return str(e)
        lost = [rid for rid in self.final_only if not self.engine.is_unfinished(rid)]
        return f"followed requests the engine does not run: {lost}" if lost else None

    def _call(self, message: Call) -> Any:
        engine = self.engine
        if message.name == "stats":
            return engine.stats()
        if message.name == "occupancy":
            return engine.occupancy()
        if message.name == "startup":
            return engine.startup
        if message.name == "compiles":
            return {phase.value: n for phase, n in engine.compiles.counts.items()}
        if message.name == "flush_cache":
            return engine.flush_cache()
        if message.name == "clear_storage":
            return engine.clear_storage()
        if message.name == "check_invariants":
            return self._check()
        raise ValueError(f"unknown engine call {message.name!r}")

    def _reply(self, call: int, value: Any) -> None:
        self.up.send(self.encoder.encode(Reply(call, value)))

    def _advance(self) -> None:
        """One step while there is work; then one drain that ends the step and copies in
        flight; the step's outputs for followed requests go up in one message."""
        # a running request's new tokens alone: its tokens so far are the parent's to keep
        outputs, self.stepped = step_or_drain(self.engine, self.stepped, cumulative=False)
        if outputs is None:
            return
        items = []
        for out in outputs:
            final_only = self.final_only.get(out.request_id)
            if final_only is None:
                continue
            if out.finished:
                del self.final_only[out.request_id]
            if out.finished or not final_only:
                items.append(out)
        if items:
            self.up.send(self.encoder.encode(Outputs(items)))

    def _abort_all(self) -> None:
        for request_id in list(self.final_only):
            self.engine.abort(request_id)
        self.final_only.clear()
        self.engine.drain()
