"""EngineStats: cumulative step counters of the engine (tokens computed, steps, forward time)."""

from __future__ import annotations

import dataclasses

from jhicache.batch import Batch
from jhicache.load_timing import LoadTiming
from jhicache.request import Request


@dataclasses.dataclass
class EngineStats:
    """Counters the engine adds to after every step; cache and scheduler counters live with them."""

    computed_prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    layered_steps: int = 0
    finished_requests: int = 0
    prefill_forward_s: float = 0.0
    decode_forward_s: float = 0.0
    layered_forward_s: float = 0.0
    load_wait_s: float = 0.0  # host time in ticket.wait: blocked (pages path) or dispatching (segments)
    load_back_s: float = 0.0  # per layer-split step: first load launched -> last copy landed (segments)
    load_exposed_s: float = 0.0  # compute stream waiting for or placing loaded pages (a lower bound, see LoadTimeline)

    def record_forward(self, batch: Batch, seconds: float, load_wait_s: float, timing: LoadTiming | None) -> None:
        if batch.is_decode:
            self.decode_forward_s += seconds
            self.decode_steps += 1
            self.decode_tokens += batch.num_tokens
            return
        self.prefill_forward_s += seconds
        self.prefill_steps += 1
        self.computed_prompt_tokens += batch.num_tokens
        if batch.tickets:
            self.layered_steps += 1
            self.layered_forward_s += seconds
            self.load_wait_s += load_wait_s
        if timing is not None:
            self.load_back_s += timing.load_s
            self.load_exposed_s += timing.exposed_s

    def record_finished(self, finished: list[Request]) -> None:
        self.finished_requests += len(finished)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
