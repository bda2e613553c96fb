"""CompileWatch: counts the programs JAX compiles (or loads from its persistent cache) while an
engine works, by phase, so that a compile while serving is seen, counted and, if asked, an
error."""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax

# JAX records this around every backend compile, a persistent-cache hit included, with the
# program's name: each one is a new executable, and a stall where it happens in a step.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # of those, read back from the cache


class CompilePhase(enum.Enum):
    WARMUP = "warmup"  # inside `Engine.warmup`
    SERVING = "serving"  # inside any other engine call: a step, an abort, a flush


class CompileError(RuntimeError):
    """A program was compiled while serving under `EngineConfig.fail_on_compile`."""


class Compile(NamedTuple):
    """One compile: the program's name (JAX's `jit(name)`), the phase, and its seconds."""

    name: str
    phase: CompilePhase
    seconds: float


class CompileWatch:
    """Counts compiles made on a thread while it is inside `watch(phase)`; compiles of other
    threads (another engine's, a client's) are not counted. JAX's listeners are process-wide:
    each watch registers one, which holds it weakly and goes quiet once the watch is gone."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(CompilePhase, 0)
        self.seconds = dict.fromkeys(CompilePhase, 0.0)
        self.cache_hits = dict.fromkeys(CompilePhase, 0)  # of `counts`: persistent-cache reads
        self._unseen: list[Compile] = []  # serving compiles not yet taken by `take_serving`
        ref = weakref.ref(self)

        def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
            watch = ref()
            if watch is not None and event == BACKEND_COMPILE_EVENT:
                watch._record(str(kwargs.get("fun_name", "?")), duration_secs)

        def hit_listener(event: str, **kwargs: str | int) -> None:
            watch = ref()
            if watch is not None and event == CACHE_HIT_EVENT:
                watch._record_hit()

        jax.monitoring.register_event_duration_secs_listener(listener)
        jax.monitoring.register_event_listener(hit_listener)
        weakref.finalize(self, _unregister, listener, hit_listener)

    @contextlib.contextmanager
    def watch(self, phase: CompilePhase) -> Iterator[None]:
        """Counts this thread's compiles as `phase` until the block ends; nested inside another
        watch, the outer phase stays (a warm-up's own engine calls count as warm-up)."""
        outer = getattr(self._local, "phase", None)
        self._local.phase = outer or phase
        try:
            yield
        finally:
            self._local.phase = outer

    def _record(self, name: str, seconds: float) -> None:
        phase = getattr(self._local, "phase", None)
        if phase is None:
            return
        with self._lock:
            self.counts[phase] += 1
            self.seconds[phase] += seconds
            if phase is CompilePhase.SERVING:
                self._unseen.append(Compile(name, phase, seconds))

    def _record_hit(self) -> None:
        phase = getattr(self._local, "phase", None)
        if phase is not None:
            with self._lock:
                self.cache_hits[phase] += 1

    def check_serving(self, fail: bool, where: str, grid: Callable[[], object]) -> None:
        """With `fail`, raises `CompileError` for the serving compiles since the last check
        (or `take_serving`), naming each program, `where` it happened and the grid a warm-up
        compiles (`grid()`, described only then: this runs every step)."""
        compiled = self.take_serving()
        if compiled and fail:
            names = ", ".join(f"{c.name} ({c.seconds:.2f} s)" for c in compiled)
            raise CompileError(f"compiled while serving{where}: {names}; every program should "
                               f"be compiled by warmup() (grid: {grid()})")

    def take_serving(self) -> list[Compile]:
        """The serving compiles since the last call."""
        with self._lock:
            unseen, self._unseen = self._unseen, []
        return unseen


def _unregister(listener: object, hit_listener: object) -> None:
    for name, registered in (("unregister_event_duration_listener", listener),
                             ("unregister_event_listener", hit_listener)):
        unregister = getattr(jax.monitoring, name, None)
        if unregister is not None:
            with contextlib.suppress(Exception):  # already gone: nothing to undo
                unregister(registered)
