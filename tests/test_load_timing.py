"""LoadTimeline: compute stalls are the gaps between one group's compute and the next group's copies."""

from __future__ import annotations

import time

import jax.numpy as jnp
import pytest

from jhicache.load_timing import LoadTimeline


class _FinishesAt:
    """Stands in for an array whose computation finishes `delay` seconds after `origin`."""

    def __init__(self, origin: float, delay: float) -> None:
        self.at = origin + delay

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.at


def test_stalls_are_copies_landing_after_the_previous_group_finished() -> None:
    t0 = time.perf_counter()
    timeline = LoadTimeline(t0, _FinishesAt(t0, 0.0))
    # group 0 waits 0.10 s for its copy; group 1's copy lands during group 0's compute (no stall);
    # group 2's lands 0.05 s after group 1 finished; group 3 reads nothing loaded.
    timeline.add_group([_FinishesAt(t0, 0.10)], _FinishesAt(t0, 0.15))
    timeline.add_group([_FinishesAt(t0, 0.12), _FinishesAt(t0, 0.13)], _FinishesAt(t0, 0.20))
    timeline.add_group([_FinishesAt(t0, 0.25)], _FinishesAt(t0, 0.30))
    timeline.add_group([], _FinishesAt(t0, 0.40))
    timing = timeline.measure()
    assert timing.load_s == pytest.approx(0.25, abs=0.02)
    assert timing.exposed_s == pytest.approx(0.15, abs=0.02)


def test_copies_done_before_measuring_read_as_hidden() -> None:
    ready = jnp.arange(4.0) + 1
    timeline = LoadTimeline(time.perf_counter(), ready)
    timeline.add_group([ready * 2], ready * 3)
    timing = timeline.measure()
    assert timing.exposed_s < 0.01 and timing.load_s >= 0
