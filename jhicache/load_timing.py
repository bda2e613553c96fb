"""LoadTimeline: how long a layer-split forward's compute waited for its loaded pages, timed from
completion events once the host has dispatched the whole step."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax


class LoadTiming(NamedTuple):
    """One layer-split step's loads, as the engine's counters add them up."""

    load_s: float  # first launch -> last loaded page placed in the pool
    exposed_s: float  # compute stream busy with loads or waiting for them (a lower bound, see LoadTimeline)


class LoadTimeline:
    """Per layer group, what marks its loaded pages placed and the array its compute produces.

    `measure()` runs once nothing is left to dispatch (the caller was about to wait for the logits
    anyway). It polls the next unplaced group and the next unfinished compute and notes when each
    is first seen done. Placement (DMA landed, then the on-device scatter) runs on the compute
    stream between two groups' computes, so the time from the previous group's compute to this
    group's placement is load time the forward did not hide. An event that finished before
    measuring began reads as that instant, so what happened while the host was still dispatching
    is missed: the exposure is a lower bound, exact when the host runs ahead of the device (the
    isolated host-hit bench measures the same thing end to end, against a device hit)."""

    def __init__(self, launched_at: float, start: jax.Array) -> None:
        self.launched_at = launched_at
        self._start = start  # the computation the first group follows (the embedding)
        self._groups: list[tuple[list[jax.Array], jax.Array]] = []
        self.placed_at: dict[int, float] = {}  # after measure(): group -> its loaded pages placed (perf_counter)
        self.computed_at: list[float] = []  # after measure(): the start computation, then each group's

    def add_group(self, placed: list[jax.Array], computed: jax.Array) -> None:
        """`placed`: arrays done once the group's loaded pages are placed (none if nothing loaded);
        `computed`: the group's output."""
        self._groups.append((placed, computed))

    def measure(self) -> LoadTiming:
        marks = [(g, a) for g, (placed, _) in enumerate(self._groups) for a in placed]
        computes = [self._start] + [computed for _, computed in self._groups]
        placed_done, compute_done = _finish_times([a for _, a in marks], computes)
        placed_at: dict[int, float] = {}
        for (group, _), at in zip(marks, placed_done):
            placed_at[group] = max(at, placed_at.get(group, at))
        exposed = sum(max(0.0, at - compute_done[group]) for group, at in placed_at.items())
        last = max(placed_at.values(), default=self.launched_at)
        self.placed_at, self.computed_at = placed_at, compute_done
        return LoadTiming(last - self.launched_at, exposed)


def _finish_times(*streams: list[jax.Array]) -> list[list[float]]:
    """When each array of each stream was first seen ready; a stream's arrays finish in order, so
    only the first unfinished one of each is polled (the host spins: it has nothing else to do)."""
    times: list[list[float]] = [[] for _ in streams]
    while any(len(t) < len(s) for t, s in zip(times, streams)):
        now = time.perf_counter()
        for t, s in zip(times, streams):
            while len(t) < len(s) and s[len(t)].is_ready():
                t.append(now)
    return times
