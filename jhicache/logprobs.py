"""Log probabilities of tokens: the per-token record, a prompt's records held column by column,
and the device programs that take them from a step's logits so that only [batch, MAX_LOGPROBS]
values reach the host."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's and vLLM's cap)
# most token ids a request may ask the log probabilities of at every position
# (`SamplingParams.token_ids_logprob`): each program that takes them has room for this many
MAX_TOKEN_IDS = 20
# The largest k that XLA's GPU TopK kernel takes (TopkSpecializer): XLA turns a larger k into a
# sort of every row, the whole vocabulary (TopkDecomposer).
TOP_K_PASS = 16


@dataclasses.dataclass(frozen=True, slots=True)  # slots: quicker to build, one per token
class TokenLogprob:
    """A generated token's log probability and the most likely alternatives at its position
    (the log-softmax of the model's logits, before temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log probability), most likely first
    # (token id, log probability) of each id the request named, in its order
    # (SamplingParams.token_ids_logprob)
    asked: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False, slots=True)
class PromptLogprobs(Sequence[TokenLogprob | None]):
    """A prompt's log probabilities, one entry per position from the one asked for on, held as
    NumPy columns: a scored prompt has one per token, and a step's rows fill them in one slice
    assignment each, where lists would take a Python number each (and the engine process's
    wire carries them as raw bytes). Read as a sequence, an entry is its `TokenLogprob`, or
    None where it is not filled: position 0, which nothing precedes, or a row not computed."""

    token_ids: np.ndarray  # [n] int32: the prompt's tokens at those positions
    logprobs: np.ndarray  # [n] float32: each token's log probability
    top_ids: np.ndarray  # [n, alternatives] int32: the most likely tokens, most likely first
    top_values: np.ndarray  # [n, alternatives] float32: and their log probabilities
    filled: np.ndarray  # [n] bool: the entries a step has filled
    asked_ids: np.ndarray  # [m] int32: the token ids the request named (token_ids_logprob)
    asked_values: np.ndarray  # [n, m] float32: their log probabilities at each position
    # entries before this one are final: steps fill a prompt's entries in order, and one
    # left unfilled before it has nothing before it to give it a value (position 0)
    filled_to: int = 0

    @classmethod
    def empty(cls, tokens: Sequence[int], alternatives: int,
              asked: Sequence[int] = ()) -> PromptLogprobs:
        """Entries for the prompt's `tokens` (from the first position asked for), with
        `alternatives` per position and the log probabilities of the `asked` ids, none
        filled."""
        n = len(tokens)
        return cls(np.asarray(tokens, np.int32).reshape(n), np.zeros(n, np.float32),
                   np.zeros((n, alternatives), np.int32),
                   np.zeros((n, alternatives), np.float32), np.zeros(n, bool),
                   np.asarray(asked, np.int32).reshape(len(asked)),
                   np.zeros((n, len(asked)), np.float32))

    def fill(self, first: int, chosen: np.ndarray, top_values: np.ndarray,
             top_ids: np.ndarray, asked: np.ndarray) -> None:
        """Entries `first`.. from rows of `row_logprobs`' outputs, each row's alternatives
        as many as this prompt's (the first columns of `top_values` and `top_ids`), and the
        asked ids' as many as it named (the first columns of `asked`)."""
        end = first + len(chosen)
        alternatives = self.top_ids.shape[1]
        self.logprobs[first:end] = chosen
        self.top_ids[first:end] = top_ids[:, :alternatives]
        self.top_values[first:end] = top_values[:, :alternatives]
        self.asked_values[first:end] = asked[:, :len(self.asked_ids)]
        self.filled[first:end] = True
        self.filled_to = max(self.filled_to, end)

    def rows(self, start: int, stop: int) -> PromptLogprobs:
        """Entries `start` to `stop` alone, as views of these columns (the asked ids whole)."""
        part = slice(start, stop)
        return PromptLogprobs(self.token_ids[part], self.logprobs[part], self.top_ids[part],
                              self.top_values[part], self.filled[part], self.asked_ids,
                              self.asked_values[part],
                              min(max(self.filled_to - start, 0), len(self.token_ids[part])))

    @classmethod
    def concat(cls, parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        """`parts`, consecutive runs of one prompt's entries, as one."""
        ids, logprobs, top_ids, top_values, filled, _, asked = (
            np.concatenate(column) for column in zip(*(p._columns() for p in parts)))
        return cls(ids, logprobs, top_ids, top_values, filled, parts[0].asked_ids, asked,
                   sum(p.filled_to for p in parts))

    def copy(self) -> PromptLogprobs:
        """A copy whose columns a later `fill` of this one leaves as they are."""
        ids, logprobs, top_ids, top_values, filled, named, asked = (
            column.copy() for column in self._columns())
        return PromptLogprobs(ids, logprobs, top_ids, top_values, filled, named, asked,
                              self.filled_to)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptLogprobs):
            return NotImplemented
        return all(np.array_equal(a, b) for a, b in zip(self._columns(), other._columns()))

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.token_ids, self.logprobs, self.top_ids, self.top_values, self.filled,
                self.asked_ids, self.asked_values)

    def __len__(self) -> int:
        return len(self.token_ids)

    @overload
    def __getitem__(self, index: int) -> TokenLogprob | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprob | None]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprob | None | list[TokenLogprob | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not self.filled[index]:
            return None
        return TokenLogprob(int(self.token_ids[index]), float(self.logprobs[index]),
                            list(zip(self.top_ids[index].tolist(),
                                     self.top_values[index].tolist())),
                            list(zip(self.asked_ids.tolist(),
                                     self.asked_values[index].tolist())))


@dataclasses.dataclass(frozen=True, slots=True)
class PromptScores:
    """A prompt's entries scored since a request's last output: `rows`, from entry `start` on
    (entries count from `SamplingParams.prompt_logprobs_start`); each is final."""

    start: int
    rows: PromptLogprobs

    @property
    def stop(self) -> int:
        return self.start + len(self.rows)

    @classmethod
    def join(cls, parts: Sequence[PromptScores]) -> PromptScores | None:
        """Consecutive `parts` as one (None for none)."""
        if len(parts) <= 1:
            return parts[0] if parts else None
        return cls(parts[0].start, PromptLogprobs.concat([part.rows for part in parts]))


def row_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    """For each row of `logits` [B, vocab] f32 and its `targets[row]` ([B, 1 + MAX_TOKEN_IDS]
    int32: the row's token, then the ids asked for, 0 where none): (the token's log
    probability [B], the top MAX_LOGPROBS log probabilities [B, N] and their token ids [B, N],
    most likely first, and the asked ids' log probabilities [B, MAX_TOKEN_IDS]). Traced inside
    programs (the prompt's, `head_rows`)."""
    return _row_logprobs(logits, targets, MAX_LOGPROBS)


def row_logprobs_top1(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    """`row_logprobs` with the most likely alternative alone ([B, 1]): all that a prompt scored
    with at most one alternative a token needs (an evaluation's log-likelihood). One pass over
    each row gives its logsumexp and its top entry together (`logsumexp_and_max`)."""
    logits = logits.astype(jnp.float32)
    lse, top, ids = logsumexp_and_max(logits)
    chosen, asked = _target_logprobs(logits, targets, lse)
    return chosen, (top - lse)[:, None], ids[:, None], asked


def _target_logprobs(logits: jax.Array, targets: jax.Array, lse: jax.Array
                     ) -> tuple[jax.Array, ...]:
    """The log probabilities of each row's targets: its token's [B], the asked ids' [B, m]."""
    picked = jnp.take_along_axis(logits, targets, axis=-1) - lse[:, None]
    return picked[:, 0], picked[:, 1:]


def logsumexp_and_max(values: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Of each row of [B, n] float32: its logsumexp, its largest value and that value's first
    index, in one reduction that reads the row once (an online logsumexp: the running sum of
    exp(x - running max) rescaled whenever the max grows), where logsumexp then argmax would
    read it three times. The rows are a scored prompt's logits, a `head_rows` block at a time."""
    index = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)

    def combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        (a_max, a_sum, a_idx), (b_max, b_sum, b_idx) = a, b
        high = jnp.maximum(a_max, b_max)
        # a side whose max is the new max keeps its sum as is (also when both are -inf, where
        # exp(-inf - -inf) would be nan)
        total = (jnp.where(a_max == high, a_sum, a_sum * jnp.exp(a_max - high))
                 + jnp.where(b_max == high, b_sum, b_sum * jnp.exp(b_max - high)))
        first = jnp.where(a_max == b_max, jnp.minimum(a_idx, b_idx),
                          jnp.where(a_max > b_max, a_idx, b_idx))
        return high, total, first

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(jnp.iinfo(jnp.int32).max))
    high, total, first = jax.lax.reduce((values, jnp.ones_like(values), index), init, combine,
                                        (values.ndim - 1,))
    return high + jnp.log(total), high, first


def prompt_reduction(alternatives: int) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    """The `head_rows` reduction for a step whose prompt rows ask for at most `alternatives`."""
    return row_logprobs_top1 if alternatives <= 1 else row_logprobs


PROMPT_REDUCTIONS = (row_logprobs_top1, row_logprobs)  # every program `prompt_reduction` picks


def _row_logprobs(logits: jax.Array, targets: jax.Array, k: int) -> tuple[jax.Array, ...]:
    # log_softmax is logits - logsumexp: the top entries are the logits' own, so the [B, vocab]
    # log probabilities are never written out, only each row's logsumexp
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen, asked = _target_logprobs(logits, targets, lse)
    top, ids = top_k_in_passes(logits, k)
    return chosen, top - lse[:, None], ids.astype(jnp.int32), asked


def top_k_in_passes(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(values, k)` of each row of [B, n], in passes of at most `TOP_K_PASS`,
    each taking the next values after the passes before have masked theirs to -inf, so that
    every pass is one of XLA's GPU TopK kernel rather than a sort of each row."""
    rows = jnp.arange(values.shape[0])[:, None]
    tops, ids = [], []
    while k > 0:
        top, idx = jax.lax.top_k(values, min(k, TOP_K_PASS))
        tops.append(top)
        ids.append(idx)
        k -= top.shape[-1]
        if k:
            values = values.at[rows, idx].set(-jnp.inf)
    return jnp.concatenate(tops, axis=-1), jnp.concatenate(ids, axis=-1)


@jax.jit
def token_logprobs(logits: jax.Array, sampled: jax.Array, asked: jax.Array
                   ) -> tuple[jax.Array, ...]:
    """`row_logprobs` of a step's logits [B, vocab], its sampled tokens ([rows] int32, rows
    >= B: the padding rows are dropped) and each row's asked ids ([B, MAX_TOKEN_IDS] int32,
    `asked_ids`)."""
    batch = logits.shape[0]
    return row_logprobs(logits, jnp.concatenate([sampled[:batch, None], asked], axis=1))


def prompt_targets(rows: int) -> np.ndarray:
    """`head_rows`' targets for a step of `rows` rows, [rows, 1 + MAX_TOKEN_IDS] int32 zeros,
    for the step to fill where prompt log probabilities are asked: a row's next prompt token,
    then the ids its request names."""
    return np.zeros((rows, 1 + MAX_TOKEN_IDS), np.int32)


def asked_ids(asked: Iterable[Sequence[int]], rows: int) -> np.ndarray:
    """[rows, MAX_TOKEN_IDS] int32: row i holds the ids `asked[i]` names, then zeros (padding
    that no one reads), a row past `asked`'s zeros alone."""
    out = np.zeros((rows, MAX_TOKEN_IDS), np.int32)
    for row, ids in enumerate(asked):
        out[row, :len(ids)] = ids
    return out


def reference_logprobs(logits: np.ndarray, token: int, n: int,
                       asked: Sequence[int] = ()) -> TokenLogprob:
    """The same for one row in NumPy (float64): what the tests hold the program to."""
    shifted = logits.astype(np.float64) - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    order = np.argsort(-logp, kind="stable")[:n]
    return TokenLogprob(token, float(logp[token]), [(int(i), float(logp[i])) for i in order],
                        [(int(i), float(logp[i])) for i in asked])


def records(tokens: Iterable[int], chosen: np.ndarray, top_values: np.ndarray,
            top_ids: np.ndarray, asked_values: np.ndarray, counts: Iterable[int],
            asked: Iterable[Sequence[int]]) -> list[TokenLogprob]:
    """Rows' records at once, from their rows of `row_logprobs`' outputs: each row's token, its
    log probability, `counts[row]` alternatives and the `asked[row]` ids' (a step's generated
    tokens; a prompt's positions fill `PromptLogprobs` instead). Each array becomes Python
    numbers in one `tolist` rather than NumPy scalar by scalar."""
    return [TokenLogprob(token, logprob, list(zip(ids[:n], values[:n])),
                         list(zip(named, asked_row)))
            for token, logprob, ids, values, n, named, asked_row in zip(
                tokens, chosen.tolist(), top_ids.tolist(), top_values.tolist(), counts, asked,
                asked_values.tolist())]
