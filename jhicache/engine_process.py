"""EngineProcess: an `Engine` and its `EngineLoop` in a child process, driven over ZeroMQ.

The parent (the server's process: HTTP, tokenizing, detokenizing) sends the wire's commands
down one PUSH socket; the child's loop applies them between steps, steps while it has work, and
sends back on another one message per step with every output of that step, plus the replies to
commands. Messages are msgpack (`msgspec`), tagged by type. So the step loop never shares an
interpreter lock with the parent's work, as SGLang's scheduler process and vLLM's EngineCore do.

Life cycle: the child builds its engine from an `EngineSpec`, reports `Started` (what the parent
needs to know of it), and serves until `Close` (requests in flight are aborted, copies end) or
until its parent is gone: on Linux the kernel kills it with its parent (the parent-death
signal), whatever it is doing (compiling, stepping, blocked writing to a pipe nobody reads);
elsewhere it checks whenever it idles. A failure in the child is reported as `Failed` before
it exits; the parent notices a child that vanished without a word too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from jhicache.config import EngineConfig
from jhicache.engine import Engine
from jhicache.engine_loop import IDLE_POLL_S, EngineLoop, engine_info
from jhicache.wire import Answer, Close, Done, Outputs, Started, ToLoop, ToParent

_IDLE_POLL_MS = int(IDLE_POLL_S * 1000)  # how often the parent looks at an idle child
EXIT_S = 2.0  # of a close's timeout, left to the child's exit once its engine is closed


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How the child builds its engine: from a checkpoint (`path`), a preset (`preset`, `seed`)
    or a picklable `factory` returning an `Engine` (tests); with JAX's persistent compilation
    cache in `compilation_cache` (None: off), logging at `log_level`."""

    config: EngineConfig = EngineConfig()
    path: str | None = None
    preset: str | None = None
    seed: int = 0
    factory: Callable[[], Engine] | None = None
    compilation_cache: str | None = None
    log_level: str | None = None

    def build(self) -> Engine:
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


class Failed(msgspec.Struct, tag=True):
    """The child's loop raised; it exits after this."""

    error: str
    trace: str


class Closed(msgspec.Struct, tag=True):
    """The child's loop ended at `Close`."""


FromChild = Started | Failed | Closed | Outputs | Done | Answer


def child_encoder() -> msgspec.msgpack.Encoder:
    """The child's messages' encoder: NumPy arrays in them (a scored prompt's columns) go as
    their raw bytes, which the parent's decoder views as arrays again (`parent_decoder`)."""
    return msgspec.msgpack.Encoder(enc_hook=_array_to_wire)


def parent_decoder() -> msgspec.msgpack.Decoder[FromChild]:
    """The parent's decoder of the child's messages (`child_encoder`'s)."""
    return msgspec.msgpack.Decoder(FromChild, dec_hook=_array_from_wire)


def _array_to_wire(obj: object) -> tuple[str, tuple[int, ...], bytes]:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    raise TypeError(f"{type(obj).__name__} has no wire form")


def _array_from_wire(kind: type, obj: object) -> np.ndarray:
    if kind is np.ndarray:
        assert isinstance(obj, (list, tuple))
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
                 on_exit: Callable[[BaseException | None], None],
                 start_timeout: float = 600.0) -> None:
        self._on_message, self._on_exit = on_message, on_exit
        self._dir = tempfile.mkdtemp(prefix="jhicache-engine-")
        self._ctx = zmq.Context()
        self._down = self._ctx.socket(zmq.PUSH)
        self._down.bind(f"ipc://{self._dir}/down")
        self._up = self._ctx.socket(zmq.PULL)
        self._up.bind(f"ipc://{self._dir}/up")
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = parent_decoder()
        self._closing = False
        self._killed = False  # by `close`, past its timeout: an end asked for, not a failure
        context = multiprocessing.get_context("spawn")  # JAX does not survive a fork
        # the parent-death signal comes when the thread that started the child ends: only the
        # main thread's end is the process's
        main = threading.current_thread() is threading.main_thread()
        self.process = context.Process(target=_child_main, name="jhicache-engine", daemon=True,
                                       args=(spec, self._dir, os.getpid(), main))
        self.process.start()
        try:
            self.info = self._wait_started(start_timeout)
        except EngineProcessError:  # it has cleaned up
            raise
        except BaseException:  # a Ctrl-C while the child starts: no child, no socket left
            self.process.kill()
            self.process.join()
            self._shutdown()
            raise
        self.thread = threading.Thread(target=self._receive, name="jhicache-engine-receiver",
                                       daemon=True)
        self.thread.start()

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

    def send(self, message: ToLoop) -> None:
        """Sends `message` (from any thread)."""
        data = self._encoder.encode(message)
        with self._send_lock:
            try:
                self._down.send(data)
            except zmq.ZMQError as e:  # its sockets closed: the child has gone
                raise EngineProcessError(f"the engine process is gone ({e})") from None

    def close(self, timeout: float | None = None) -> None:
        """Asks the child to end (it aborts what runs, then closes its engine: a storage tier
        stores the cache, for up to `timeout` less EXIT_S) and waits for it and the receiver;
        kills it after `timeout` (an end asked for: not reported as a failure)."""
        self._closing = True
        if self.process.is_alive():
            try:  # the child's exit after its engine's close takes a moment of its own
                self.send(Close(None if timeout is None else max(0.0, timeout - EXIT_S)))
            except EngineProcessError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self._killed = True
            self.process.kill()
            self.process.join()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _receive(self) -> None:
        reason: BaseException | None = None
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
                    if not isinstance(message, Started):
                        self._on_message(message)
                elif not self.process.is_alive():
                    if not self._closing or (self.process.exitcode and not self._killed):
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

class _ZmqEnd:
    """The child loop's end: commands from the parent's PUSH socket, messages up another."""

    def __init__(self, down: zmq.Socket, up: zmq.Socket, parent_pid: int) -> None:
        self.down, self.up, self.parent_pid = down, up, parent_pid
        self.encoder = child_encoder()
        self.decoder = msgspec.msgpack.Decoder(ToLoop)

    def receive(self, wait: bool) -> list[ToLoop]:
        messages: list[ToLoop] = []
        if self.down.poll(_IDLE_POLL_MS if wait else 0):
            while True:
                try:
                    messages.append(self.decoder.decode(self.down.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return messages

    def post(self, message: ToParent) -> None:
        self.up.send(self.encoder.encode(message))

    def orphaned(self) -> bool:
        return os.getppid() != self.parent_pid


PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)


def die_with_parent(parent_pid: int) -> bool:
    """On Linux, has the kernel SIGKILL this process when its parent ends (prctl's
    PR_SET_PDEATHSIG), and exits now if that already happened; False where it cannot (another
    system: the loop's orphan check is left)."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # it ended before the call: no signal will come
        os._exit(0)
    return True


def _child_main(spec: EngineSpec, directory: str, parent_pid: int, main_thread: bool) -> None:
    """The engine process: Ctrl-C is the parent's to handle (it sends `Close`); it dies with its
    parent (`die_with_parent`) when the parent's main thread started it."""
    if main_thread:
        die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    down, up = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    down.connect(f"ipc://{directory}/down")
    up.connect(f"ipc://{directory}/up")
    encoder = child_encoder()
    try:
        engine = spec.build()
        up.send(encoder.encode(engine_info(engine)))
        loop = EngineLoop(engine, _ZmqEnd(down, up, parent_pid))
        loop.run()
        if not loop.end.orphaned():  # (an orphan's parent is gone: exit at once)
            engine.close(loop.close_timeout_s)  # a storage tier keeps the cache
        up.send(encoder.encode(Closed()))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, then the child exits)
        up.send(encoder.encode(Failed(repr(e), traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        down.close(linger=0)
        up.close(linger=1000)
        ctx.term()
