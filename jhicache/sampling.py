"""SamplingParams and the jitted sampler: greedy, temperature, top-k and top-p on device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. `temperature == 0` is greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: expected >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: expected None or >= 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: expected None or in (0, 1]")




def sampling_arrays(params: list[SamplingParams], steps: list[int], rows: int) -> tuple[np.ndarray, ...]:
    """Per-row temperature, top-k (0 = off), top-p, and seed/step pairs, padded to `rows`."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seeds = np.zeros((rows, 2), np.uint32)
    for i, (p, step) in enumerate(zip(params, steps)):
        temperature[i] = p.temperature
        top_k[i] = p.top_k or 0
        top_p[i] = p.top_p or 1.0
        seeds[i] = (p.seed if p.seed is not None else i) & 0xFFFFFFFF, step
    return temperature, top_k, top_p, seeds


@jax.jit
def greedy(logits: jax.Array) -> jax.Array:  # [B, vocab] -> [B] int32
    """Argmax rows: the whole batch is greedy, so the sort and mask work of `sample` is skipped."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def sample(
    logits: jax.Array,  # [B, vocab] float32
    temperature: jax.Array,  # [B]
    top_k: jax.Array,  # [B] int32, 0 = no top-k
    top_p: jax.Array,  # [B] float32, 1 = no top-p
    seeds: jax.Array,  # [B, 2] uint32: (seed, step) per row
) -> jax.Array:  # [B] int32
    """Greedy rows take the argmax; the others sample from the filtered, tempered softmax."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix of sorted tokens whose mass reaches top_p (always the first).
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    cutoff_idx = jnp.sum(mass_before < top_p[:, None], axis=-1) - 1
    pth = jnp.take_along_axis(sorted_logits, cutoff_idx[:, None], axis=-1)
    masked = jnp.where((scaled >= kth) & (scaled >= pth), scaled, -jnp.inf)
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s[0]), s[1]))(seeds)
    sampled = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
