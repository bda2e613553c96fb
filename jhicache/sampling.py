"""SamplingParams and the jitted sampler: greedy, temperature, top-k, top-p and min-p on
device."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.logprobs import MAX_LOGPROBS, MAX_TOKEN_IDS

SEED_LIMIT = 2**63  # seeds are ints in [0, SEED_LIMIT), as in vLLM


def _int(field: str, value: object, *, low: int, high: int | None = None) -> int:
    """`value` as a Python int in [low, high); numpy integers count, bools and floats do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"SamplingParams.{field}={value!r}: expected an int")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{field}={value!r}: expected an int {bound}")
    return value


def _real(field: str, value: object) -> float:
    """`value` as a finite float; ints and numpy reals count, bools and strings do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{field}={value!r}: expected a finite number")
    return float(value)


def _token_ids(field: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ValueError(f"SamplingParams.{field}={value!r}: expected a list of token ids")
    return tuple(_int(field, t, low=0) for t in value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token.

    The model's logits are first penalised (`jhicache.penalties`): each token already in the
    prompt or the output has a positive logit divided by `repetition_penalty` and a negative
    one multiplied by it (Hugging Face's and SGLang's rule), then each token generated `c`
    times so far loses `frequency_penalty * c + presence_penalty * (c > 0)` (OpenAI's), and
    before `min_tokens` new tokens no stop token can be drawn.
    `temperature == 0` is then greedy. Otherwise the tempered softmax is cut to the `top_k` most
    likely tokens, then to the smallest set of those whose renormalised mass reaches `top_p`,
    then to the tokens at least `min_p` times as likely as the likeliest (the order Hugging
    Face applies them in), and a token is drawn from what is left. A
    request with a `seed` draws the same tokens however it is batched and whatever the cache
    mode; an unseeded one gets a fresh random seed when it is submitted. Generation stops after
    `max_new_tokens` tokens or at the first of `stop_token_ids`, which is kept in the output.
    With `logprobs` (0 to MAX_LOGPROBS), each generated token comes with its log probability
    and that many of the most likely alternatives (`RequestOutput.logprobs`); with
    `prompt_logprobs`, so does each prompt token from position `prompt_logprobs_start` on
    (`RequestOutput.prompt_logprobs`; the cached prefix is cut there, so they are computed).
    Each of those records also gives the log probabilities of the tokens `token_ids_logprob`
    names (at most MAX_TOKEN_IDS; SGLang's field: a classifier's label tokens).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        fix = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen)
        fix("max_new_tokens", _int("max_new_tokens", self.max_new_tokens, low=1))
        fix("temperature", _real("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: expected >= 0")
        if self.top_k is not None:
            fix("top_k", _int("top_k", self.top_k, low=1))
        if self.top_p is not None:
            fix("top_p", _real("top_p", self.top_p))
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"SamplingParams.top_p={self.top_p!r}: expected None or in (0, 1]")
        fix("min_p", _real("min_p", self.min_p))
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p={self.min_p!r}: expected in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):  # OpenAI's range
            fix(field, _real(field, getattr(self, field)))
            if not -2.0 <= getattr(self, field) <= 2.0:
                raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: expected "
                                 f"in [-2, 2]")
        fix("repetition_penalty", _real("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty!r}: "
                             f"expected > 0 (1: off)")
        fix("min_tokens", _int("min_tokens", self.min_tokens, low=0))
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens}: expected at most "
                             f"max_new_tokens ({self.max_new_tokens})")
        if self.seed is not None:
            fix("seed", _int("seed", self.seed, low=0, high=SEED_LIMIT))
        fix("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if self.logprobs is not None:
            fix("logprobs", _int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS + 1))
        if self.prompt_logprobs is not None:
            fix("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, low=0,
                                        high=MAX_LOGPROBS + 1))
        fix("prompt_logprobs_start", _int("prompt_logprobs_start", self.prompt_logprobs_start,
                                          low=0))
        fix("token_ids_logprob", _token_ids("token_ids_logprob", self.token_ids_logprob))
        if len(self.token_ids_logprob) > MAX_TOKEN_IDS:
            raise ValueError(f"SamplingParams.token_ids_logprob names "
                             f"{len(self.token_ids_logprob)} tokens: at most {MAX_TOKEN_IDS}")
        if self.token_ids_logprob and self.logprobs is None and self.prompt_logprobs is None:
            raise ValueError("SamplingParams.token_ids_logprob: their log probabilities come "
                             "with each token's; set logprobs or prompt_logprobs too")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens before (a penalty, or `min_tokens`): it then
        needs a row of the device's token history (`jhicache.penalties`)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_tokens > 0)


def sampling_arrays(params: list[SamplingParams], steps: list[int],
                    rows: int) -> tuple[np.ndarray, ...]:
    """Per-row temperature, top-k (0 = off), top-p, min-p, and (seed low, seed high, step) words,
    padded to `rows`. Sampled rows must carry a seed (the engine gives unseeded requests
    one)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    min_p = np.zeros(rows, np.float32)
    seeds = np.zeros((rows, 3), np.uint32)
    for i, (p, step) in enumerate(zip(params, steps)):
        if p.is_greedy:
            continue
        if p.seed is None:
            raise ValueError("a sampled row needs a seed: submit requests through the Engine")
        temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k or 0, p.top_p or 1.0
        min_p[i] = p.min_p
        seeds[i] = p.seed & 0xFFFFFFFF, p.seed >> 32, step
    return temperature, top_k, top_p, min_p, seeds


def _padded(ids: jax.Array, rows: int) -> jax.Array:
    """[B] -> [rows] (zeros after B): every step's sampled tokens have one shape, so the next
    step's patch program (`jhicache.batch.patch_tokens`) has one shape per step shape."""
    return jnp.pad(ids, (0, rows - ids.shape[0]))


@functools.partial(jax.jit, static_argnames="rows")
def greedy(logits: jax.Array, *, rows: int) -> jax.Array:  # [B, vocab] -> [rows] int32
    """Argmax rows: the whole batch is greedy, so the noise and filter work of `sample` is
    skipped."""
    return _padded(jnp.argmax(logits, axis=-1).astype(jnp.int32), rows)


def _row_key(words: jax.Array) -> jax.Array:
    """A PRNG key from (seed low, seed high, step): every 64-bit seed and step has its own."""
    key = jax.random.fold_in(jax.random.key(words[0]), words[1])
    return jax.random.fold_in(key, words[2])


def _gumbel(seeds: jax.Array, vocab: int) -> jax.Array:  # [B, 3] -> [B, vocab] float32
    """Each row's Gumbel noise, by token id: a draw is the argmax of the tempered logits plus
    this over the tokens a filter keeps (the Gumbel-max trick, as `jax.random.categorical`),
    so a row that filters nothing draws the same token from either sampler below."""
    return jax.vmap(lambda words: jax.random.gumbel(_row_key(words), (vocab,)))(seeds)


class Filters(enum.Enum):
    """The cuts a step's sampled rows ask for: the sampler takes its passes over the vocabulary
    for these alone (a static argument: one program each)."""

    NONE = "none"
    TOP_K = "top_k"
    TOP_P = "top_p"
    BOTH = "both"

    @property
    def top_k(self) -> bool:
        return self in (Filters.TOP_K, Filters.BOTH)

    @property
    def top_p(self) -> bool:
        return self in (Filters.TOP_P, Filters.BOTH)


def step_filters(params: list[SamplingParams]) -> Filters:
    """The cuts any sampled row of `params` asks for: top-k, top-p < 1, both or neither."""
    sampled = [p for p in params if not p.is_greedy]
    top_k = any(p.top_k is not None for p in sampled)
    top_p = any((p.top_p or 1.0) < 1.0 for p in sampled)
    return {(False, False): Filters.NONE, (True, False): Filters.TOP_K,
            (False, True): Filters.TOP_P, (True, True): Filters.BOTH}[top_k, top_p]


@functools.partial(jax.jit, static_argnames=("rows", "filters"))
def sample(
    logits: jax.Array,  # [B, vocab] float32
    temperature: jax.Array,  # [B]
    top_k: jax.Array,  # [B] int32, 0 = no top-k
    top_p: jax.Array,  # [B] float32, 1 = no top-p
    min_p: jax.Array,  # [B] float32, 0 = no min-p
    seeds: jax.Array,  # [B, 3] uint32: (seed low, seed high, step) per row
    *,
    rows: int,  # >= B: the output is padded to it
    filters: Filters,  # the cuts any row asks for (`step_filters`); the others are not taken
) -> jax.Array:  # [rows] int32
    """Greedy rows take the argmax; the others sample from the filtered, tempered softmax (the
    Gumbel-max over token ids, so a row draws the same token whatever `filters` its batch
    needs). Min-p is always taken: two passes over the row, beside the noise's cost."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    drawn = scaled + _gumbel(seeds, logits.shape[-1])
    keep = min_p_mask(scaled, min_p)
    if filters is not Filters.NONE:
        keep &= filter_mask(scaled, top_k, top_p, filters)
    drawn = jnp.where(keep, drawn, -jnp.inf)
    sampled = jnp.argmax(drawn, axis=-1).astype(jnp.int32)
    return _padded(jnp.where(temperature > 0, sampled, greedy_ids), rows)


def min_p_mask(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Which tokens of each row [B, vocab] are at least `min_p` times as likely as the likeliest
    (0: all): p / p_max = exp(scaled - max), so a comparison of the tempered logits, with no
    softmax. Its mask and top-k's and top-p's together are its cut taken after theirs (Hugging
    Face's order): neither removes the likeliest token, the one it compares with."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    return scaled >= top + jnp.log(min_p)[:, None]  # log(0) = -inf keeps every token


def filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                filters: Filters = Filters.BOTH) -> jax.Array:
    """Which tokens of each row [B, vocab] top-k and then top-p keep: in the order of value,
    ties by the lower id, the first `top_k` (0: all), then of those the shortest run whose
    renormalised mass reaches `top_p` (1: all), as HF and vLLM filter. Found without sorting
    the rows: each cut is a value threshold found digit by digit (`_largest_reaching`), and
    the tokens tied at it are cut by id the same way. A cut `filters` leaves out is not
    taken: every row must then have it off."""
    keys = _order_keys(scaled)
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    in_top_k = (_top_k_mask(keys, ids, top_k) if filters.top_k
                else jnp.ones(scaled.shape, jnp.bool_))
    if not filters.top_p:
        return in_top_k
    nucleus = _nucleus(scaled, keys, ids, in_top_k, top_p)
    return jnp.where((top_p < 1.0)[:, None], nucleus, in_top_k)


def _top_k_mask(keys: jax.Array, ids: jax.Array, top_k: jax.Array) -> jax.Array:
    """The first `top_k` tokens of each row by key, ties by id (0 or past the vocabulary:
    all)."""
    vocab = keys.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)[:, None]  # [B, 1]

    def at_least_k(c: jax.Array) -> jax.Array:  # [B, D] -> [B, D]: k tokens or more >= c
        return _count(keys[:, :, None] >= c[:, None, :]) >= k

    cut = _largest_reaching(at_least_k, keys.shape[0], 32)[:, None]  # the k-th largest
    return _keep_ties(keys > cut, keys == cut,
                      k - jnp.sum(keys > cut, axis=-1, dtype=jnp.int32)[:, None], ids)


def _nucleus(scaled: jax.Array, keys: jax.Array, ids: jax.Array, in_top_k: jax.Array,
             top_p: jax.Array) -> jax.Array:
    """Of each row's `in_top_k` tokens, the shortest run by key (ties by id) whose mass,
    renormalised over them, reaches `top_p`."""
    # in units of the largest token's mass
    mass = jnp.where(in_top_k, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    goal = (top_p * jnp.sum(mass, axis=-1))[:, None]  # [B, 1]

    def reaches_p(c: jax.Array) -> jax.Array:  # [B, D] -> [B, D]: mass of keys >= c >= goal
        above = jnp.where(keys[:, :, None] >= c[:, None, :], mass[:, :, None], 0.0)
        return jnp.sum(above, axis=1) >= goal

    low = _largest_reaching(reaches_p, keys.shape[0], 32)[:, None]  # the last value kept
    above = in_top_k & (keys > low)
    tied = in_top_k & (keys == low)
    before = jnp.sum(jnp.where(above, mass, 0.0), axis=-1, keepdims=True)  # mass ahead of them
    each = jnp.max(jnp.where(tied, mass, 0.0), axis=-1, keepdims=True)  # a tied token's mass
    # a tied token is kept while the mass before it is short of the goal
    ahead = jnp.ceil((goal - before) / jnp.maximum(each, jnp.finfo(jnp.float32).tiny))
    ahead = jnp.where(before + (ahead - 1) * each >= goal, ahead - 1, ahead)
    ahead = jnp.where(before + ahead * each < goal, ahead + 1, ahead)
    return _keep_ties(above, tied, ahead.astype(jnp.int32), ids)


_DIGIT_BITS = 4  # a threshold's bits found per pass: 2**4 candidates compared at once


def _largest_reaching(reaches: Callable[[jax.Array], jax.Array], rows: int,
                      bits: int) -> jax.Array:
    """Per row, the largest t in [0, 2**bits) (uint32) with `reaches(t)`, for a test that holds
    from 0 up to some t and fails above it (`reaches(0)` must hold): `bits / 4` passes, each
    trying the 16 values of the next 4 bits below those already found."""
    digits = jnp.arange(1 << _DIGIT_BITS, dtype=jnp.uint32)[None, :]
    found = jnp.zeros((rows,), jnp.uint32)
    for shift in range(-(-bits // _DIGIT_BITS) * _DIGIT_BITS - _DIGIT_BITS, -1, -_DIGIT_BITS):
        ok = reaches(found[:, None] | (digits << shift))
        digit = jnp.maximum(jnp.sum(ok, axis=-1), 1).astype(jnp.uint32) - 1
        found = found | (digit << shift)
    return found


def _keep_ties(above: jax.Array, tied: jax.Array, room: jax.Array,
               ids: jax.Array) -> jax.Array:
    """`above`, and the first `room` ([B, 1]) of the `tied` tokens by id."""
    def fits(c: jax.Array) -> jax.Array:  # [B, D] -> [B, D]: fewer than `room` tied ids < c
        return _count(tied[:, :, None] & (ids[:, :, None] < c[:, None, :].astype(jnp.int32))) < room

    id_bits = max(int(ids.shape[-1]).bit_length(), 1)
    last = _largest_reaching(fits, ids.shape[0], id_bits)[:, None].astype(jnp.int32)
    return above | (tied & (ids <= last) & (room > 0))


def _count(mask: jax.Array) -> jax.Array:
    """[B, vocab, D] -> [B, D]: the vocabulary the reduced axis and the candidates the minor
    one, so that a reduction reads each token once for all its candidates, where with the
    vocabulary minor it would read the row once per candidate."""
    return jnp.sum(mask, axis=1, dtype=jnp.int32)


def _order_keys(values: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest): the sign bit set for the positive
    values, every bit flipped for the negative ones."""
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))
