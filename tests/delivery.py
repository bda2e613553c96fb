"""A test's hold on AsyncEngine's delivery of outputs: those it picks reach their consumer one at
a time, each taken before the next is posted, so that a consumer lagging the steps (a busy CI
machine) cannot see them merged into one (`AsyncEngine.stream`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import pytest

from jhicache import AsyncEngine
from jhicache.request import RequestOutput

WAIT_S = 60.0  # a consumer that takes nothing for this long: the delivery goes on regardless


def one_at_a_time(monkeypatch: pytest.MonkeyPatch,
                  picked: Callable[[RequestOutput], bool]) -> threading.Event:
    """After each delivery that holds an unfinished output `picked` chooses, the engine's thread
    (or the engine process's receiver) waits until the consumer sets the returned event, which
    it does once it has taken that output."""
    taken = threading.Event()
    deliver = AsyncEngine._deliver

    def paced(self: AsyncEngine, outputs: Iterable[RequestOutput]) -> None:
        outputs = list(outputs)
        deliver(self, outputs)
        if any(picked(out) and not out.finished for out in outputs):
            taken.wait(WAIT_S)
            taken.clear()

    monkeypatch.setattr(AsyncEngine, "_deliver", paced)
    return taken
