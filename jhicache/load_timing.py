"""LoadTimeline: when a layer-split forward's loads landed and how long its compute waited for
them, timed from completion events once the host has dispatched the whole step."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax

from jhicache.cache.ticket import LoadMarks


class LoadTiming(NamedTuple):
    """One layer-split step's loads, as the engine's counters add them up."""

    load_s: float  # launch -> last host->device copy seen landed (see LoadTimeline)
    exposed_s: float  # compute stream waiting for, or placing, loaded pages (a lower bound)


class LoadTimeline:
    """Per layer group, the marks of its loads (`LoadMarks`) and the array its compute produces.

    `measure()` runs once nothing is left to dispatch (the caller was about to wait for the logits
    anyway). It polls the next unfinished event of each stream (copies landing, pages placed,
    groups computed; each finishes in order) and notes when each is first seen done. Placement
    (the on-device scatter, after its copy landed) runs on the compute stream between two groups'
    computes, so the time from the previous group's compute to this group's placement is load time
    the forward did not hide. An event that finished before measuring began reads as that instant:
    what happened while the host was still dispatching is missed, so the exposure is a lower bound
    and the load time reads long, both exact when the host runs ahead of the device (the isolated
    host-hit bench measures the exposure end to end, against a device hit)."""

    def __init__(self, launched_at: float, start: jax.Array) -> None:
        self.launched_at = launched_at
        self._start = start  # the computation the first group follows (the embedding)
        self._groups: list[tuple[list[LoadMarks], jax.Array]] = []
        # After measure(), for tools: perf_counter() per group (and the start computation first).
        self.landed_at: dict[int, float] = {}
        self.placed_at: dict[int, float] = {}
        self.computed_at: list[float] = []

    def add_group(self, marks: list[LoadMarks], computed: jax.Array) -> None:
        """`marks`: the group's loads (none if nothing loaded); `computed`: the group's output."""
        self._groups.append((marks, computed))

    def measure(self) -> LoadTiming:
        marks = [(g, m) for g, (group_marks, _) in enumerate(self._groups) for m in group_marks]
        copies = [(g, a) for g, m in marks for a in m.landed]
        computes = [self._start] + [computed for _, computed in self._groups]
        landed, placed, self.computed_at = _finish_times([a for _, a in copies], [m.placed for _, m in marks],
                                                         computes)
        self.landed_at = _latest([g for g, _ in copies], landed)
        self.placed_at = _latest([g for g, _ in marks], placed)
        exposed = sum(max(0.0, at - self.computed_at[group]) for group, at in self.placed_at.items())
        last = max(self.landed_at.values(), default=self.launched_at)
        return LoadTiming(last - self.launched_at, exposed)


def _latest(owners: list[int], times: list[float]) -> dict[int, float]:
    """Per group, the latest of its events' times."""
    latest: dict[int, float] = {}
    for group, at in zip(owners, times):
        latest[group] = max(at, latest.get(group, at))
    return latest


def _finish_times(*streams: list[jax.Array]) -> list[list[float]]:
    """When each array of each stream was first seen ready; a stream's arrays are expected to
    finish in order, so only the first unfinished one of each is polled (one finishing earlier
    reads late). The host spins: it has nothing else to do. A deleted (donated) array reads as
    done: its successor is what runs now."""
    times: list[list[float]] = [[] for _ in streams]
    while any(len(t) < len(s) for t, s in zip(times, streams)):
        now = time.perf_counter()
        for t, s in zip(times, streams):
            while len(t) < len(s) and (s[len(t)].is_deleted() or s[len(t)].is_ready()):
                t.append(now)
    return times
