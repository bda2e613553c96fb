"""Stepper: the order of one engine step (schedule, launch, prefetch, end a step, commit), the
step left in flight by overlap scheduling, and the count of steps that made no progress."""

from __future__ import annotations

import time
from collections.abc import Callable

from jhicache import scoring
from jhicache.batch import Batch
from jhicache.cache import PrefixCache, TransferStep
from jhicache.executor import Launched, StepExecutor
from jhicache.request import Request
from jhicache.scheduler import Scheduler
from jhicache.stats import StepCounters

_STORAGE_WAIT_S = 0.01  # an idle step waits this long at most for a storage read to move on:
# short, as a request that arrives meanwhile is added only after it

# Told of each ended step: the requests that gained a token (their last), and those whose
# prompt log probabilities it filled further
OnEnd = Callable[[list[Request], list[Request]], None]


class Stepper:
    """Steps the scheduler's batches through the executor, over the cache's transfers."""

    def __init__(self, scheduler: Scheduler, cache: PrefixCache, executor: StepExecutor,
                 counters: StepCounters, overlap: bool, on_end: OnEnd) -> None:
        self.scheduler, self.cache, self.executor = scheduler, cache, executor
        self.counters, self.overlap, self.on_end = counters, overlap, on_end
        self.in_flight: Launched | None = None  # overlap: the dispatched step not yet ended
        self._idle_steps = 0

    def step(self) -> tuple[list[Request], Launched | None]:
        """One step, in the order its transfers need: retire finished copies, schedule, start
        the batch's loads, dispatch its forward (the loads' later layers queued between the
        forward's first program and the next), prefetch the next step's loads; on leaving
        `cache.step()`, the queued write-backs and loads start; then end the step before
        (overlap) or this one, and commit. Returns the requests that gained a token, and the
        step launched."""
        with self.cache.step() as transfers:
            batch, gained, ended_early = self._schedule(transfers)
            previous = None if self.in_flight is None else self.in_flight.sampled
            launched = (None if batch is None
                        else self.executor.launch(batch, transfers, previous))
            self.scheduler.prefetch()  # loads for the next step, started on leaving the block
        if self.overlap:
            ending, self.in_flight = self.take_in_flight(), launched
        else:
            ending = launched
        if ending is not None:
            gained += self.end(ending)
        self._note_progress(launched is not None or ending is not None or ended_early)
        return gained, launched

    def load_alone(self, tokens: list[int]) -> bool:
        """Loads the host-tier run of `tokens`' cached prefix back to the device, with no
        batch, and waits until it has landed; False with no host run to load. Only between
        steps: nothing may be in flight."""
        match = self.cache.match(tokens, leave_last=True)
        with self.cache.step() as transfers:
            ticket = self.cache.load_back(match)
            if ticket is not None:
                transfers.start_loads([ticket])
        if ticket is None:
            return False
        ticket.wait_all()
        self.cache.flush()
        return True

    def _schedule(self, transfers: TransferStep) -> tuple[Batch | None, list[Request], bool]:
        """The step's batch; where there is none while a step is in flight, that step is ended
        first (it may finish requests and free their pages) and the schedule tried again.
        Returns (batch, the requests the ended step gave a token, whether it was ended here)."""
        in_flight = self.in_flight is not None
        batch = self.scheduler.schedule(may_retract=not in_flight)
        if batch is not None or not in_flight:
            return batch, [], False
        ending = self.take_in_flight()
        assert ending is not None  # `in_flight` said so
        gained = self.end(ending)
        transfers.poll()
        return self.scheduler.schedule(may_retract=True), gained, True

    def end(self, step: Launched) -> list[Request]:
        """Reads a step's sampled tokens, and their log probabilities where asked for (waiting
        for that step alone, in one read), and commits them; returns the requests that gained
        one (its last token)."""
        ids, logprobs, prompt = step.read()
        now = time.perf_counter()
        self.counters.record_forward(step.batch, now - step.dispatched_s, step.gated)
        gained = self.scheduler.commit(step.batch, ids, now)
        filled = scoring.on_end(step.batch, step.prompt_spans, gained, logprobs, prompt)
        self.counters.record_finished([r for r in gained if r.finished])
        self.on_end(gained, filled)
        return gained

    def take_in_flight(self) -> Launched | None:
        step, self.in_flight = self.in_flight, None
        return step

    def _note_progress(self, progressed: bool) -> None:
        if progressed:
            self._idle_steps = 0
            return
        if self.cache.fetches.reading():  # waiting on storage: not idle, but nothing to do yet
            self.cache.fetches.wait(_STORAGE_WAIT_S)
            return
        # Loaded pages stay locked until their copy retires: wait for the transfers rather
        # than count a step that only had to wait for the copy engine.
        self.cache.flush()
        self._idle_steps += 1
        if self._idle_steps > 2 * len(self.scheduler.running) + 8:
            raise RuntimeError("scheduler made no progress: device pool too small for the "
                               "running requests")
