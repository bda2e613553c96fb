"""LoadTimeline: how long a layer-split forward's compute waited for its loaded pages, timed from
completion events once the host has dispatched the whole step."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax


class LoadTiming(NamedTuple):
    """One layer-split step's loads, as the engine's counters add them up."""

    load_s: float  # first launch -> last host->device copy landed
    exposed_s: float  # compute waiting for copies to land (a lower bound, see LoadTimeline)


class LoadTimeline:
    """Per layer group, the copies that must land before it and the array its compute produces.

    `measure()` runs once nothing is left to dispatch (the caller was about to wait for the logits
    anyway). It polls the next unfinished copy and the next unfinished compute, which finish in
    order on their own streams, and notes when each is first seen done: compute stalled wherever
    a group's copies landed after the previous group's compute had finished. An event that
    finished before measuring began reads as that instant, so stalls while the host was still
    dispatching are missed: the exposure is a lower bound, exact when the host runs ahead of the
    device (the isolated host-hit bench measures the same thing end to end, against a device hit)."""

    def __init__(self, launched_at: float, start: jax.Array) -> None:
        self.launched_at = launched_at
        self._start = start  # the computation the first group follows (the embedding)
        self._groups: list[tuple[list[jax.Array], jax.Array]] = []
        self.landed_at: dict[int, float] = {}  # after measure(): group -> its copies landed (perf_counter)
        self.computed_at: list[float] = []  # after measure(): the start computation, then each group's

    def add_group(self, landed: list[jax.Array], computed: jax.Array) -> None:
        """`landed`: copies the group reads (none if already on device); `computed`: its output."""
        self._groups.append((landed, computed))

    def measure(self) -> LoadTiming:
        copies = [(g, a) for g, (landed, _) in enumerate(self._groups) for a in landed]
        computes = [self._start] + [computed for _, computed in self._groups]
        copy_done, compute_done = _finish_times([a for _, a in copies], computes)
        landed_at: dict[int, float] = {}
        for (group, _), at in zip(copies, copy_done):
            landed_at[group] = max(at, landed_at.get(group, at))
        exposed = sum(max(0.0, at - compute_done[group]) for group, at in landed_at.items())
        last = max(landed_at.values(), default=self.launched_at)
        self.landed_at, self.computed_at = landed_at, compute_done
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
