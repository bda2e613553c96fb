"""CompileCounter: the XLA compiles this process does while a block runs (any thread), by name."""

from __future__ import annotations

import threading

import jax

from jhicache.compiles import BACKEND_COMPILE_EVENT


class CompileCounter:
    """Counts this process's XLA compiles (any thread) while the `with` block runs, and names
    the programs compiled (the event's `fun_name`, where JAX gives one): a bench's view of
    every compile its block caused, where an engine's `CompileWatch` counts its own thread's."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self.programs: list[str] = []
        self._lock = threading.Lock()

    def _heard(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration_secs
                self.programs.append(f"{kwargs.get('fun_name', '?')} ({duration_secs:.2f} s)")

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._heard)
        return self

    def __exit__(self, *exc_info: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._heard)
