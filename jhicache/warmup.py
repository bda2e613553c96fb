"""The warm-up: every program an engine's steps can dispatch, compiled before it serves.

Two passes over the engine's `ShapeGrid`, both through the one list of a step's programs that
`StepExecutor` keeps:
1. Ahead of time (`StepExecutor.lower`), on a thread pool: for each shape, every program a step
   of it dispatches (the forward's programs, the samplers, the log probabilities, a
   decode's patch of pending tokens and its first program over the patched tokens), and each
   write-back gather size, lowered with arguments typed as a real call's (the engine's own
   arrays, shardings included) and compiled (`jit(...).lower(...).compile()`, which JAX keeps
   for later calls with the same argument types). XLA times candidate kernels for each matmul
   on the GPU while it compiles, and keeps the winners in its in-process autotuning cache;
   timed beside other compiles, it chose programs that decoded slower (BENCHMARKS.md,
   start-up). So the shapes that first meet a token count or a request count (the matmuls'
   rows) compile one at a time, first; every other program should then find its matmuls timed
   already, and compiles in parallel. That the cache is hit is inferred from the decode speed
   measured after this order, not checked. When the first shape's programs are all read back
   from JAX's persistent compilation cache (a restart), nothing is timed: the executables carry
   the kernels chosen when they were first compiled, and every other program is read back in
   parallel.
2. One padding step per shape through the same programs, called (`StepExecutor.pad`),
   serially: it should compile nothing (`WarmupReport.late_compiles` counts what it did, a
   program the first pass typed differently from a real call). Every row of a padding step is
   padding: it writes only the reserved padding page.
A warm-up given a `stop` event that is set (an engine closed while it warms up) ends at the next
program, raising `WarmupStopped`: a program's compile cannot be cut short, the ones queued can.
A server's warm-up then freezes the objects alive out of the garbage collector's walks
(`freeze_heap`), as vLLM does after its warm-up and SGLang offers (`freeze_gc`), and makes its
young collections rarer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from jhicache.compiles import CompilePhase, CompileWatch
from jhicache.executor import StepExecutor
from jhicache.grid import StepShape

logger = logging.getLogger("jhicache.warmup")


class WarmupStopped(Exception):
    """The warm-up's `stop` event was set: it ended before compiling every program."""


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise WarmupStopped("the warm-up was stopped")


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: the grid's shapes, the programs compiled (or read back from JAX's
    persistent cache) in all and by the padding steps, and each pass's wall seconds."""

    shapes: int
    ahead_tasks: int  # pass 1: one per shape, one per write-back gather size
    alone_tasks: int  # of those, the shapes compiled one at a time (`timing_shapes`, or its
    # first alone when that one's programs were all read back from the persistent cache)
    compiles: int  # new executables in both passes, as JAX reported them
    cache_hits: int  # of those, read back from JAX's persistent compilation cache
    late_compiles: int  # of those, in pass 2: 0 when pass 1 typed every program as a call does
    ahead_s: float
    steps_s: float
    frozen_objects: int = 0  # objects `freeze_heap` took out of the collector's walks

    @property
    def seconds(self) -> float:
        return self.ahead_s + self.steps_s


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def timing_shapes(shapes: tuple[StepShape, ...]) -> tuple[StepShape, ...]:
    """The shapes whose programs XLA must time kernels for: each first to meet a token count
    (the layers' matmul rows) or a request count (the head's)."""
    tokens: set[int] = set()
    requests: set[int] = set()
    chosen = []
    for shape in shapes:
        if shape.tokens not in tokens or shape.requests not in requests:
            chosen.append(shape)
        tokens.add(shape.tokens)
        requests.add(shape.requests)
    return tuple(chosen)


# (label, compile): the compile takes the lock its XLA compiles hold (a real one, or none)
Task = tuple[str, Callable[[contextlib.AbstractContextManager], object]]


def read_back(compiles: int, cache_hits: int) -> bool:
    """Whether a task's programs all came from the persistent cache, so that XLA timed no
    kernel for them (and will time none for the programs compiled with them)."""
    return compiles > 0 and cache_hits == compiles


def _logprob_shapes(shapes: tuple[StepShape, ...]) -> tuple[set[StepShape], set[StepShape]]:
    """The shapes that compile the log-probability programs for the others: the first of each
    request count (the sampled tokens', typed by the logits' rows) and the first prefill of
    each token count (the prompt's, typed by its hidden rows)."""
    by_requests: dict[int, StepShape] = {}
    by_tokens: dict[int, StepShape] = {}
    for shape in shapes:
        by_requests.setdefault(shape.requests, shape)
        if not shape.decode:
            by_tokens.setdefault(shape.tokens, shape)
    return set(by_requests.values()), set(by_tokens.values())


def _ahead_tasks(executor: StepExecutor) -> tuple[list[Task], list[Task]]:
    """A task per shape and per write-back gather size: those that compile one at a time,
    then those that compile in parallel after them."""
    shapes = executor.grid.shapes()
    timing = timing_shapes(shapes)
    by_requests, by_tokens = _logprob_shapes(shapes)

    def task(shape: StepShape) -> Task:
        return (f"step {shape}", functools.partial(
            executor.lower, shape, sampled_logprobs=shape in by_requests,
            prompt_logprobs=shape in by_tokens))

    alone: list[Task] = [task(shape) for shape in timing]
    parallel: list[Task] = [task(shape) for shape in shapes if shape not in timing]
    for size in executor.gather_sizes():  # gathers have no matmuls
        parallel.append((f"gather {size} pages", functools.partial(executor.lower_gather, size)))
    return alone, parallel


def _compile_ahead(executor: StepExecutor, watch: CompileWatch, bar: tqdm,
                   stop: threading.Event | None) -> int:
    """Pass 1: runs the tasks of `_ahead_tasks` on a thread pool, those that time kernels one
    at a time first; returns how many ran one at a time. Once `stop` is set, the tasks not
    started yet raise `WarmupStopped` instead of compiling."""
    alone, parallel = _ahead_tasks(executor)
    serial, free = threading.Lock(), contextlib.nullcontext()

    def run(task: Task, lock: contextlib.AbstractContextManager) -> str:
        _check(stop)
        with watch.watch(CompilePhase.WARMUP):
            task[1](lock)
        return task[0]

    def counts() -> tuple[int, int]:
        return watch.counts[CompilePhase.WARMUP], watch.cache_hits[CompilePhase.WARMUP]

    if alone:  # the first shape tells a restart (its programs read back) from a first start
        first = counts()
        bar.set_postfix_str(run(alone[0], serial), refresh=False)
        bar.update()
        if read_back(*(now - then for now, then in zip(counts(), first))):
            alone, parallel = alone[:1], alone[1:] + parallel
    with concurrent.futures.ThreadPoolExecutor(_workers()) as pool:
        # the first group's timings stand before the second starts
        for tasks, hold in ((alone[1:], serial), (parallel, free)):
            for future in concurrent.futures.as_completed(
                    [pool.submit(run, t, hold) for t in tasks]):
                bar.set_postfix_str(future.result(), refresh=False)
                bar.update()
    return len(alone)


def warm_up(executor: StepExecutor, watch: CompileWatch, lock: contextlib.AbstractContextManager,
            check: Callable[[], None], progress: bool = True, freeze: bool = False,
            stop: threading.Event | None = None) -> WarmupReport:
    """Compiles every program of `executor`'s grid (see the module docstring), counting them
    with `watch`, then runs `check` (the engine's invariant check: its device reads compile);
    with `freeze`, then `freeze_heap`. The first pass touches no engine state (the pages only
    by their types), so it runs without `lock`, and the engine answers `stats()` meanwhile;
    the padding steps and `check` run under it. Raises `WarmupStopped` once `stop` is set."""
    shapes = executor.grid.shapes()
    before, hits = watch.counts[CompilePhase.WARMUP], watch.cache_hits[CompilePhase.WARMUP]
    tasks = sum(map(len, _ahead_tasks(executor)))
    bar = tqdm(total=tasks + len(shapes), desc="warm-up", unit="program", disable=not progress)
    start = time.perf_counter()
    with bar:  # closed however it ends: a stopped warm-up's line ends, not left half drawn
        alone = _compile_ahead(executor, watch, bar, stop)
        ahead, compiled_ahead = time.perf_counter(), watch.counts[CompilePhase.WARMUP]
        with lock, watch.watch(CompilePhase.WARMUP):
            for shape in shapes:
                _check(stop)
                executor.pad(shape)
                bar.update()
            total = watch.counts[CompilePhase.WARMUP]
            check()  # its device reads compile (a check, not a step)
    report = WarmupReport(shapes=len(shapes), ahead_tasks=tasks, alone_tasks=alone,
                          compiles=watch.counts[CompilePhase.WARMUP] - before,
                          cache_hits=watch.cache_hits[CompilePhase.WARMUP] - hits,
                          late_compiles=total - compiled_ahead, ahead_s=ahead - start,
                          steps_s=time.perf_counter() - ahead,
                          frozen_objects=freeze_heap() if freeze else 0)
    logger.info("warm-up: %d shapes, %d programs (%d read back from the compilation cache, %d "
                "by the padding steps), %.1f s (ahead of time %.1f s on %d threads, %d shapes "
                "one at a time; padding steps %.1f s); %d objects frozen", report.shapes,
                report.compiles, report.cache_hits, report.late_compiles, report.seconds,
                report.ahead_s, _workers(), report.alone_tasks, report.steps_s,
                report.frozen_objects)
    return report


# allocations between two collections of the youngest generation in a served process: where
# CPython's 700 runs one every few hundred entries of a scored prompt's body, on a heap whose
# long-lived objects are frozen
SERVED_YOUNG_THRESHOLD = 50_000


def freeze_heap() -> int:
    """Collects what is garbage now, then moves every object still alive (the model's, JAX's
    and XLA's, the compiled programs') into the collector's permanent generation (`gc.freeze`):
    a full collection walks every tracked object, so over a served model's startup heap it
    holds up the step it lands in for as long as that walk takes, and the per-token lists of
    a scored prompt bring one on within a few requests. Objects made later are collected as
    before; frozen ones never are, cycles among them included, so only a process that keeps
    its engine to the end should freeze (a server). The youngest generation's threshold is
    raised to `SERVED_YOUNG_THRESHOLD`: a request's objects (a scored prompt's body makes two
    or three per token) are mostly freed whole by their reference counts, and each young
    collection before that walks them all. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVED_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return gc.get_freeze_count()
