"""LoadTimeline: compute stalls are the gaps between one group's compute and the next group's placement."""

from __future__ import annotations

import time

import jax.numpy as jnp
import pytest

from jhicache.cache.ticket import LoadMarks
from jhicache.load_timing import LoadTimeline


class _FinishesAt:
    """Stands in for an array whose computation finishes `delay` seconds after `origin`."""

    def __init__(self, origin: float, delay: float) -> None:
        self.at = origin + delay

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.at

    def is_deleted(self) -> bool:
        return False


def _marks(t0: float, landed: float, placed: float) -> LoadMarks:
    return LoadMarks((_FinishesAt(t0, landed),), _FinishesAt(t0, placed))


def test_stalls_are_placements_after_the_previous_group_finished() -> None:
    t0 = time.perf_counter()
    timeline = LoadTimeline(t0, _FinishesAt(t0, 0.0))
    # group 0 waits 0.10 s for its pages; group 1's copies landed during group 0's compute and are
    # placed 0.01 s after it; group 2's land 0.05 s after group 1 finished; group 3 loads nothing.
    timeline.add_group([_marks(t0, 0.08, 0.10)], _FinishesAt(t0, 0.15))
    timeline.add_group([_marks(t0, 0.11, 0.155), _marks(t0, 0.12, 0.16)], _FinishesAt(t0, 0.20))
    timeline.add_group([LoadMarks((_FinishesAt(t0, 0.25), _FinishesAt(t0, 0.24)), _FinishesAt(t0, 0.26))],
                       _FinishesAt(t0, 0.30))  # two copies, landing out of order
    timeline.add_group([], _FinishesAt(t0, 0.40))
    timing = timeline.measure()
    assert timing.load_s == pytest.approx(0.25, abs=0.02)
    assert timing.exposed_s == pytest.approx(0.10 + 0.01 + 0.06, abs=0.02)
    assert sorted(timeline.landed_at) == sorted(timeline.placed_at) == [0, 1, 2]
    assert len(timeline.computed_at) == 5


def test_events_done_before_measuring_read_as_hidden_and_donated_ones_as_done() -> None:
    ready = jnp.arange(4.0) + 1
    donated = jnp.arange(4.0)
    donated.delete()
    launched = time.perf_counter()
    timeline = LoadTimeline(launched, ready)
    timeline.add_group([LoadMarks((ready * 2, donated), ready * 4)], ready * 3)
    timing = timeline.measure()
    assert timing.exposed_s == 0.0  # all seen done at the first poll, at one instant
    assert timing.load_s == timeline.landed_at[0] - launched > 0
