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

    `measure()` blocks on them in stream order once nothing is left to dispatch (the caller was about
    to wait for the logits anyway) and notes when each finished: compute stalled wherever a group's
    copies landed after the previous group's compute had finished. An event that finished before
    measuring began reads as that instant, so stalls while the host was still dispatching are
    missed: the exposure is a lower bound, exact when the host runs ahead of the device (the
    isolated host-hit bench measures the same thing end to end, against a device hit)."""

    def __init__(self, launched_at: float, start: jax.Array) -> None:
        self.launched_at = launched_at
        self._start = start  # the computation the first group follows (the embedding)
        self._groups: list[tuple[list[jax.Array], jax.Array]] = []

    def add_group(self, landed: list[jax.Array], computed: jax.Array) -> None:
        """`landed`: copies the group reads (none if already on device); `computed`: its output."""
        self._groups.append((landed, computed))

    def measure(self) -> LoadTiming:
        previous = _finished_at(self._start)
        last_landed, exposed = self.launched_at, 0.0
        for landed, computed in self._groups:
            if landed:
                landed_at = max(_finished_at(array) for array in landed)
                exposed += max(0.0, landed_at - previous)
                last_landed = max(last_landed, landed_at)
            previous = _finished_at(computed)
        return LoadTiming(last_landed - self.launched_at, exposed)


def _finished_at(array: jax.Array) -> float:
    array.block_until_ready()
    return time.perf_counter()
