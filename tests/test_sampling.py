"""Sampler: greedy rows, top-k / top-p filtering, and seeded determinism."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.sampling import SamplingParams, greedy, sample, sampling_arrays


def _sample(logits: np.ndarray, params: list[SamplingParams], step: int = 0) -> np.ndarray:
    arrays = sampling_arrays(params, [step] * len(params), logits.shape[0])
    return np.asarray(sample(jnp.asarray(logits), *map(jnp.asarray, arrays)))


def test_greedy_and_filters_that_leave_one_token_pick_the_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 97)).astype(np.float32)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=2.0, top_p=1e-6, seed=2), SamplingParams()]
    np.testing.assert_array_equal(_sample(logits, params), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(greedy(jnp.asarray(logits))), logits.argmax(-1))


def test_top_k_samples_only_among_the_k_largest_and_is_seeded() -> None:
    logits = np.random.default_rng(1).normal(size=(1, 50)).astype(np.float32)
    allowed = set(np.argsort(-logits[0])[:3].tolist())
    seen = {int(_sample(logits, [SamplingParams(temperature=1.0, top_k=3, seed=s)])[0]) for s in range(40)}
    assert seen <= allowed and len(seen) > 1
    p = [SamplingParams(temperature=1.0, seed=7)]
    assert _sample(logits, p, step=3)[0] == _sample(logits, p, step=3)[0]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0)])
def test_invalid_params_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
