"""Multi-turn bench clients on a Backend: ready queue, Poisson sends, in-flight cap, barrier."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from jhicache.bench.backends import Backend, Chunk
from jhicache.sampling import SamplingParams

POLICIES = ("fifo", "random")


@dataclasses.dataclass(frozen=True)
class ClientsConfig:
    """How turns are sent, as SGLang's benchmark/hicache/bench_multiturn.py sends them."""

    request_rate: float = math.inf  # Poisson arrivals, requests/s; inf: no gap between sends
    max_parallel: int | None = None  # most requests in flight; None: one per client
    ready_queue_policy: str = "fifo"  # which ready client goes next: the oldest, or any at random
    round_barrier: bool = True  # every client ends round r before any starts round r + 1
    seed: int = 0  # of the random picks and the gaps

    def __post_init__(self) -> None:
        if not (self.request_rate > 0):  # also refuses nan
            raise ValueError(f"request_rate={self.request_rate}: expected > 0 (or inf)")
        if self.max_parallel is not None and self.max_parallel < 1:
            raise ValueError(f"max_parallel={self.max_parallel}: expected >= 1")
        if self.ready_queue_policy not in POLICIES:
            raise ValueError(f"ready_queue_policy={self.ready_queue_policy!r}: not in {POLICIES}")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request as its client saw it; times are seconds from the start of the run."""

    client: int
    round: int
    sent_s: float  # handed to the backend's stream
    first_token_s: float  # the first output carrying tokens arrived
    done_s: float  # the finished output arrived
    itl_s: tuple[float, ...]  # per later output with tokens: gap since the one before / its tokens
    max_gap_s: float  # the longest wait between two outputs carrying tokens (0: fewer than two)
    token_ids: tuple[int, ...]
    prompt_len: int
    device_hit_tokens: int
    host_hit_tokens: int
    engine_ttft_s: float | None  # the engine's own (submission to first token on the host);
    # None where the backend cannot see it (a server that does not say it)
    storage_hit_tokens: int = 0
    server_ttft_s: float | None = None  # a server's own (its route to its first event)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s


@dataclasses.dataclass(frozen=True)
class ClientsRun:
    turns: tuple[Turn, ...]  # in the order sent
    elapsed_s: float  # first send to last answer
    max_in_flight: int
    histories: tuple[tuple[int, ...], ...]  # per client, after its last turn


async def run_clients(backend: Backend, turns: Sequence[Sequence[Sequence[int]]],
                      params: Sequence[Sequence[SamplingParams]], config: ClientsConfig,
                      on_turn: Callable[[Turn], None] | None = None,
                      histories: Sequence[Sequence[int]] | None = None) -> ClientsRun:
    """Runs every client's conversation on `backend` (in this process or over HTTP);
    `turns[round][client]` is a user turn, appended with the answers before it to form the
    prompt, so prompts do not depend on timing; `params[round][client]` asks for its answer.
    `histories` continues conversations held so far (a run's `histories`)."""
    return await _Clients(backend, turns, params, config, on_turn, histories).run()


class _Clients:
    """One run's state (histories, ready queue, requests in flight), on one event loop."""

    def __init__(self, backend: Backend, turns: Sequence[Sequence[Sequence[int]]],
                 params: Sequence[Sequence[SamplingParams]], config: ClientsConfig,
                 on_turn: Callable[[Turn], None] | None,
                 histories: Sequence[Sequence[int]] | None = None) -> None:
        self.backend, self.turns, self.params, self.config = backend, turns, params, config
        self.on_turn = on_turn or (lambda turn: None)
        clients = len(turns[0])
        self.limit = config.max_parallel or clients
        self.histories = [list(h) for h in histories or [[]] * clients]
        assert len(self.histories) == clients, "one history per client"
        self.next_round = [0] * clients
        self.ready = list(range(clients))  # round 0: every client, in order
        self.done_in_round = [0] * len(turns)
        # Two streams, so that the clients picked do not depend on the rate.
        self.pick_rng = np.random.default_rng([config.seed, 0])
        self.gap_rng = np.random.default_rng([config.seed, 1])
        self.in_flight = self.max_in_flight = 0
        self.records: list[Turn] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def run(self) -> ClientsRun:
        sent, total = 0, len(self.turns) * len(self.histories)
        while sent < total:
            await self._sendable()
            burst = self._take()
            await self._send(burst)
            sent += len(burst)
            if math.isfinite(self.config.request_rate) and sent < total:
                await asyncio.sleep(self.gap_rng.exponential(1 / self.config.request_rate))
        await asyncio.gather(*self.tasks)
        elapsed = max(t.done_s for t in self.records)
        return ClientsRun(tuple(sorted(self.records, key=lambda t: t.sent_s)), elapsed,
                          self.max_in_flight, tuple(tuple(h) for h in self.histories))

    async def _sendable(self) -> None:
        """Waits for a ready client and room in flight (or raises what a turn raised)."""
        while not (self.ready and self.in_flight < self.limit) and self.error is None:
            self.changed.clear()
            await self.changed.wait()
        if self.error is not None:
            await asyncio.gather(*self.tasks)  # raises it, after every turn has ended

    def _take(self) -> list[int]:
        """The clients to send now: one, or with no gap between sends all that may go."""
        room = self.limit - self.in_flight
        count = min(room, len(self.ready)) if math.isinf(self.config.request_rate) else 1
        return [self._pick() for _ in range(count)]

    def _pick(self) -> int:
        if self.config.ready_queue_policy == "fifo":
            return self.ready.pop(0)
        return self.ready.pop(int(self.pick_rng.integers(len(self.ready))))

    async def _send(self, clients: list[int]) -> None:
        """Starts the clients' turns; requests sent at one moment reach the engine together
        (in this process; a server gets them one by one, as from separate clients)."""
        with self.backend.together():
            for client in clients:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                self.tasks.append(asyncio.create_task(self._turn(client)))
            await asyncio.sleep(0)  # each task runs to its submission

    async def _turn(self, client: int) -> None:
        index = self.next_round[client]
        self.next_round[client] += 1
        prompt = self.histories[client] + list(self.turns[index][client])
        try:
            turn = await self._request(client, index, prompt)
        except BaseException as e:
            self.error = self.error or e
            raise
        finally:
            self.in_flight -= 1
            self.changed.set()
        self.histories[client] = prompt + list(turn.token_ids)
        self.records.append(turn)
        self.on_turn(turn)
        self._answered(client, index)

    async def _request(self, client: int, index: int, prompt: list[int]) -> Turn:
        sent = arrived = self.now()
        first = last = None
        itl: list[float] = []
        max_gap = 0.0
        final: Chunk | None = None
        params = self.params[index][client]
        async for out in self.backend.stream(prompt, params, f"c{client}-r{index}"):
            arrived = self.now()
            if out.new_token_ids:
                if last is not None:
                    itl.append((arrived - last) / len(out.new_token_ids))
                    max_gap = max(max_gap, arrived - last)
                first, last = first if first is not None else arrived, arrived
            final = out
        assert final is not None and first is not None, "a stream ended without tokens"
        return Turn(client, index, sent, first, arrived, tuple(itl), max_gap, final.token_ids,
                    final.prompt_len, final.device_hit_tokens, final.host_hit_tokens,
                    final.engine_ttft_s, final.storage_hit_tokens, final.server_ttft_s)

    def _answered(self, client: int, index: int) -> None:
        """The client's answer arrived: its next turn is ready (with the barrier, once every
        client has answered this round)."""
        if index + 1 == len(self.turns):
            return
        if not self.config.round_barrier:
            self.ready.append(client)
            return
        self.done_in_round[index] += 1
        if self.done_in_round[index] == len(self.histories):
            self.ready.extend(range(len(self.histories)))


def median_index(values: Sequence[float]) -> int:
    """Where the median of `values` is (the lower of the middle two for an even count): the
    trial a bench reports, beside the range over all of them."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def percentiles(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    """`{"p50_s": ...}` for each q, by np.percentile (None with no values)."""
    if not values:
        return {f"p{q}_s": None for q in qs}
    return {f"p{q}_s": float(v) for q, v in zip(qs, np.percentile(values, qs))}


def round_summary(turns: Sequence[Turn]) -> dict:
    """One round's requests (by turn number, whenever they ran): TTFT and hit rates."""
    prompt_tokens = sum(t.prompt_len for t in turns)
    ttfts = [t.ttft_s for t in turns]
    spread = percentiles(ttfts, (50, 90, 99))
    return {
        "mean_ttft_s": float(np.mean(ttfts)),
        **{f"ttft_{key}": value for key, value in spread.items()},
        "engine_mean_ttft_s": _mean_or_none([t.engine_ttft_s for t in turns]),
        "device_hit_rate": sum(t.device_hit_tokens for t in turns) / prompt_tokens,
        "host_hit_rate": sum(t.host_hit_tokens for t in turns) / prompt_tokens,
        "storage_hit_rate": sum(t.storage_hit_tokens for t in turns) / prompt_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(len(t.token_ids) for t in turns),
        "requests": len(turns),
    }


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean, or None where a backend could not see some of the values."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if len(known) == len(values) else None


def latency_summary(turns: Sequence[Turn]) -> dict:
    """TTFT and end-to-end latency over every request, inter-token latency over every gap."""
    ttfts, e2es = [t.ttft_s for t in turns], [t.e2e_s for t in turns]
    gaps = [gap for t in turns for gap in t.itl_s]
    return {"ttft": {"mean_s": float(np.mean(ttfts)), **percentiles(ttfts, (50, 90, 99))},
            "e2e": {"mean_s": float(np.mean(e2es)), **percentiles(e2es, (50, 99))},
            "itl": percentiles(gaps, (50, 99)),
            "max_token_gap_s": max((t.max_gap_s for t in turns), default=0.0),
            "requests": len(turns)}
