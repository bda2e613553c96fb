"""A test's wait for something another thread (a storage tier's, a store client's heartbeat)
brings about: polled until true, failing after a bound far past how long it should take."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 60.0,
               what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:.0f} s"
        time.sleep(0.01)
