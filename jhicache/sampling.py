"""SamplingParams and the jitted sampler: greedy, temperature, top-k and top-p on device."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

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

    `temperature == 0` is greedy. Otherwise the tempered softmax is cut to the `top_k` most
    likely tokens, then to the smallest set of those whose renormalised mass reaches `top_p`
    (the order Hugging Face and vLLM apply them in), and a token is drawn from what is left. A
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


def sampling_arrays(params: list[SamplingParams], steps: list[int],
                    rows: int) -> tuple[np.ndarray, ...]:
    """Per-row temperature, top-k (0 = off), top-p, and (seed low, seed high, step) words, padded
    to `rows`. Sampled rows must carry a seed (the engine gives unseeded requests one)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seeds = np.zeros((rows, 3), np.uint32)
    for i, (p, step) in enumerate(zip(params, steps)):
        if p.is_greedy:
            continue
        if p.seed is None:
            raise ValueError("a sampled row needs a seed: submit requests through the Engine")
        temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k or 0, p.top_p or 1.0
        seeds[i] = p.seed & 0xFFFFFFFF, p.seed >> 32, step
    return temperature, top_k, top_p, seeds


def _padded(ids: jax.Array, rows: int) -> jax.Array:
    """[B] -> [rows] (zeros after B): every step's sampled tokens have one shape, so the next
    step's patch program (`jhicache.batch.patch_tokens`) has one shape per step shape."""
    return jnp.pad(ids, (0, rows - ids.shape[0]))


@functools.partial(jax.jit, static_argnames="rows")
def greedy(logits: jax.Array, *, rows: int) -> jax.Array:  # [B, vocab] -> [rows] int32
    """Argmax rows: the whole batch is greedy, so the sort and mask work of `sample` is skipped."""
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


def has_filters(params: list[SamplingParams]) -> bool:
    """Whether a sampled row asks for top-k or top-p < 1 (then `sample`, which sorts, is
    needed)."""
    return any(not p.is_greedy and (p.top_k is not None or (p.top_p or 1.0) < 1.0)
               for p in params)


@functools.partial(jax.jit, static_argnames="rows")
def sample(
    logits: jax.Array,  # [B, vocab] float32
    temperature: jax.Array,  # [B]
    top_k: jax.Array,  # [B] int32, 0 = no top-k
    top_p: jax.Array,  # [B] float32, 1 = no top-p
    seeds: jax.Array,  # [B, 3] uint32: (seed low, seed high, step) per row
    *,
    rows: int,  # >= B: the output is padded to it
) -> jax.Array:  # [rows] int32
    """Greedy rows take the argmax; the others sample from the filtered, tempered softmax."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    # Filter by rank in sorted order, so exactly k tokens survive top-k even among ties.
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    in_top_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # top-p over the renormalised top-k distribution: the smallest prefix whose mass reaches p.
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    noise = jnp.take_along_axis(_gumbel(seeds, logits.shape[-1]), order, axis=-1)
    picked = jnp.argmax(jnp.where(keep, sorted_logits + noise, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return _padded(jnp.where(temperature > 0, sampled, greedy_ids), rows)


@functools.partial(jax.jit, static_argnames="rows")
def sample_unfiltered(
    logits: jax.Array,  # [B, vocab] float32
    temperature: jax.Array,  # [B]
    seeds: jax.Array,  # [B, 3] uint32
    *,
    rows: int,
) -> jax.Array:  # [rows] int32
    """`sample` for a batch where no row asks for top-k or top-p: the same token for each row,
    without sorting the vocabulary."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sampled = jnp.argmax(scaled + _gumbel(seeds, logits.shape[-1]), axis=-1).astype(jnp.int32)
    return _padded(jnp.where(temperature > 0, sampled, greedy_ids), rows)
