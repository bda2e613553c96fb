"""The benchmarks' prompts: random ones, and SGLang-style multi-turn chats, seeded."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
    """Each round appends a `request_length`-token user turn to every conversation, answered
    with `output_length` tokens. With `range_ratio` < 1 (SGLang's --range-ratio), each turn's
    lengths are drawn uniformly from [ceil(range_ratio * length), length] instead."""

    num_clients: int = 4
    num_rounds: int = 3
    request_length: int = 48
    output_length: int = 4
    vocab_size: int = 512
    seed: int = 0
    range_ratio: float = 1.0

    def __post_init__(self) -> None:
        for field in ("num_clients", "num_rounds", "request_length", "output_length", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"MultiTurnSpec.{field} must be >= 1")
        if not 0.0 < self.range_ratio <= 1.0:
            raise ValueError(f"MultiTurnSpec.range_ratio={self.range_ratio!r}: expected a "
                             f"number in (0, 1]")

    @property
    def final_context_tokens(self) -> int:
        """Tokens of one conversation after the last round, outputs included (at most, with a
        range ratio)."""
        return self.num_rounds * (self.request_length + self.output_length)

    @property
    def working_set_tokens(self) -> int:
        """KV tokens the cache would need to keep every conversation after the last round."""
        return self.num_clients * self.final_context_tokens


def _lengths(spec: MultiTurnSpec, length: int, stream: int) -> np.ndarray:
    """[round, client] lengths: `length`, or drawn in [ceil(range_ratio * length), length]
    (a stream of their own, so fixed lengths draw the same tokens as ever)."""
    shape = (spec.num_rounds, spec.num_clients)
    if spec.range_ratio == 1.0:
        return np.full(shape, length)
    low = max(1, int(np.ceil(spec.range_ratio * length)))
    return np.random.default_rng([spec.seed, stream]).integers(low, length + 1, shape)


def user_turns(spec: MultiTurnSpec) -> list[list[list[int]]]:
    """Every seeded user turn up front, `[round][client]`, drawn in MultiTurnChats' order, so
    that a client can advance on its own (prompts do not depend on timing)."""
    rng = np.random.default_rng(spec.seed)
    lengths = _lengths(spec, spec.request_length, 1)
    return [[[int(t) for t in rng.integers(0, spec.vocab_size, lengths[r, c])]
             for c in range(spec.num_clients)] for r in range(spec.num_rounds)]


def output_lengths(spec: MultiTurnSpec) -> list[list[int]]:
    """Each turn's answer length, `[round][client]`."""
    return _lengths(spec, spec.output_length, 2).tolist()


class MultiTurnChats:
    """Conversation histories; `prompts()` gives this round's prompts, `extend()` records
    outputs."""

    def __init__(self, spec: MultiTurnSpec) -> None:
        self.spec = spec
        self._turns = user_turns(spec)
        self._round = 0
        self.histories: list[list[int]] = [[] for _ in range(spec.num_clients)]

    def prompts(self) -> list[list[int]]:
        """Appends the next round's user turn to each history and returns the histories as
        prompts; IndexError past the spec's last round."""
        turns, self._round = self._turns[self._round], self._round + 1
        for history, turn in zip(self.histories, turns):
            history.extend(turn)
        return [list(h) for h in self.histories]

    def extend(self, outputs: list[list[int]]) -> None:
        for history, output in zip(self.histories, outputs):
            history.extend(output)


def random_prompts(rng: np.random.Generator, vocab: int, count: int,
                   length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens drawn uniformly from the vocabulary by `rng`."""
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]
