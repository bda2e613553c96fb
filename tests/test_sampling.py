"""Sampler: greedy rows, top-k / top-p filtering, and seeded determinism."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.sampling import (
    Filters,
    SamplingParams,
    filter_mask,
    greedy,
    sample,
    sampling_arrays,
    step_filters,
)


def _sample(logits: np.ndarray, params: list[SamplingParams], step: int = 0,
            filters: Filters | None = None) -> np.ndarray:
    """`sample` with the cuts `params` ask for, or with `filters`."""
    arrays = map(jnp.asarray, sampling_arrays(params, [step] * len(params), logits.shape[0]))
    rows = logits.shape[0] + 3  # padded past the batch, as the engine pads to its grid
    out = np.asarray(sample(jnp.asarray(logits), *arrays, rows=rows,
                            filters=step_filters(params) if filters is None else filters))
    np.testing.assert_array_equal(out[logits.shape[0]:], 0)
    return out[: logits.shape[0]]


def test_a_row_that_filters_nothing_draws_the_same_token_whatever_cuts_are_taken() -> None:
    """A row that filters nothing draws the same token in a batch that takes no cut as in one
    that takes both; so a seeded row's token does not depend on its neighbours' filters."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 301)).astype(np.float32) * 3
    plain = [SamplingParams(temperature=float(t), seed=int(s))
             for t, s in zip(rng.uniform(0.3, 2.0, 6), rng.integers(0, 2**40, 6))]
    params = [SamplingParams(), *plain, SamplingParams(top_p=1.0, temperature=0.7, seed=5)]
    assert step_filters(params) is Filters.NONE
    for step in (0, 9):
        alone = _sample(logits, params, step)
        for filters in Filters:
            np.testing.assert_array_equal(alone, _sample(logits, params, step, filters))
        # beside rows that filter (the cuts are then taken for the whole batch)
        mixed = [*params[:-1], SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=8)]
        assert step_filters(mixed) is Filters.BOTH
        np.testing.assert_array_equal(_sample(logits, mixed, step)[:-1], alone[:-1])
    assert len(set(alone[1:7].tolist())) > 1  # the rows do sample


def test_greedy_and_filters_that_leave_one_token_pick_the_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 97)).astype(np.float32)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=2.0, top_p=1e-6, seed=2), SamplingParams()]
    np.testing.assert_array_equal(_sample(logits, params), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(greedy(jnp.asarray(logits), rows=6)),
                                  np.concatenate([logits.argmax(-1), [0, 0]]))


def test_top_k_samples_only_among_the_k_largest_and_is_seeded() -> None:
    logits = np.random.default_rng(1).normal(size=(1, 50)).astype(np.float32)
    allowed = set(np.argsort(-logits[0])[:3].tolist())
    seen = {int(_sample(logits, [SamplingParams(temperature=1.0, top_k=3, seed=s)])[0])
            for s in range(40)}
    assert seen <= allowed and len(seen) > 1
    p = [SamplingParams(temperature=1.0, seed=7)]
    assert _sample(logits, p, step=3)[0] == _sample(logits, p, step=3)[0]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_k=0),
                                 dict(top_p=0.0), dict(min_p=-0.1), dict(min_p=1.5),
                                 dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                 dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=True),
                                 dict(min_tokens=-1), dict(max_new_tokens=4, min_tokens=5),
                                 dict(min_tokens=1.0)])
def test_invalid_params_raise(bad: dict) -> None:
    field = next(f for f in bad if f != "max_new_tokens" or len(bad) == 1)
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**bad)


def _draws(probs: list[float], n: int, **params) -> np.ndarray:
    """`n` samples, one seed each, from logits whose softmax is `probs`."""
    logits = np.log(np.asarray([probs] * n, np.float32))
    rows = [SamplingParams(temperature=1.0, seed=s, **params) for s in range(n)]
    return _sample(logits, rows)


def test_top_p_applies_to_the_renormalised_top_k_distribution() -> None:
    """HF and vLLM: top-k first, then the nucleus of what top-k kept. With p = [.35, .25, .2, .2],
    top_k=2 leaves [.58, .42], whose 0.5-nucleus is token 0 alone."""
    draws = _draws([0.35, 0.25, 0.2, 0.2], 2000, top_k=2, top_p=0.5)
    assert set(draws.tolist()) == {0}


def test_joint_top_k_top_p_draws_follow_the_renormalised_distribution() -> None:
    """top_k=3 leaves [.35, .25, .2] / .8 (ties at .2 broken towards the lower id); the 0.8-nucleus
    of that keeps all three (mass before the third is .75), drawn as [.4375, .3125, .25]."""
    n = 4000
    draws = _draws([0.35, 0.25, 0.2, 0.2], n, top_k=3, top_p=0.8)
    freq = np.bincount(draws, minlength=4) / n
    expected = np.array([0.4375, 0.3125, 0.25, 0.0])
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert freq[3] == 0 and np.all(np.abs(freq - expected) <= 4 * sigma + 1e-9), freq


@pytest.mark.parametrize("filters", [Filters.NONE, Filters.BOTH])
def test_temperature_alone_draws_from_the_tempered_softmax(filters: Filters) -> None:
    n, probs = 4000, np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(np.asarray([probs] * n, np.float32))
    draws = _sample(logits, [SamplingParams(temperature=2.0, seed=s) for s in range(n)],
                    filters=filters)
    tempered = probs ** 0.5 / np.sum(probs ** 0.5)
    freq = np.bincount(draws, minlength=4) / n
    assert np.all(np.abs(freq - tempered) <= 4 * np.sqrt(tempered * (1 - tempered) / n)), freq


def test_sampled_rows_need_a_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        sampling_arrays([SamplingParams(temperature=1.0)], [0], 1)


def _reference_mask(row: np.ndarray, k: int, p: float) -> np.ndarray:
    """NumPy, by sorting (stable: ties by the lower id), in float64: the first k tokens by
    value, then the shortest run of those whose renormalised mass reaches p."""
    order = np.argsort(-row, kind="stable")[: k if 0 < k <= row.size else row.size]
    keep = np.zeros(row.size, bool)
    if p >= 1.0:
        keep[order] = True
        return keep
    probs = np.exp(row[order].astype(np.float64) - row[order].max())
    probs /= probs.sum()
    keep[order[np.cumsum(probs) - probs < p]] = True
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_mask_equals_sorting_the_rows(seed: int) -> None:
    """Fresh random rows, some of few distinct values (ties at every cut), with top-k off, small,
    large and past the vocabulary, and top-p from tiny to off: the sort-free cuts keep exactly
    the tokens a stable sort's cuts keep."""
    rng = np.random.default_rng(seed)
    rows, vocab = 24, 517
    scaled = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    scaled[::3] = rng.integers(-4, 3, (8, vocab)).astype(np.float32)  # many ties
    scaled[1, :] = 2.5  # one value throughout
    scaled[2, 100:] = -1e30  # a floor of equal, negligible values
    top_k = rng.choice([0, 1, 2, 7, 50, 516, 517, 600], rows).astype(np.int32)
    top_p = rng.choice([1e-6, 0.1, 0.5, 0.77, 0.9, 0.999, 1.0], rows).astype(np.float32)
    got = np.asarray(filter_mask(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    for r in range(rows):
        want = _reference_mask(scaled[r], int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}: k={top_k[r]} "
                                                            f"p={top_p[r]}")


@pytest.mark.parametrize("filters", list(Filters))
def test_the_sampler_sorts_nothing(filters: Filters) -> None:
    """No program of the sampler holds a sort of any row (the filters are value thresholds)."""
    rows, vocab = 4, 300
    lowered = sample.lower(jnp.zeros((rows, vocab)), jnp.ones(rows), jnp.zeros(rows, jnp.int32),
                           jnp.ones(rows), jnp.zeros(rows), jnp.zeros((rows, 3), jnp.uint32),
                           rows=8, filters=filters)
    assert " sort(" not in lowered.compile().as_text()  # XLA's sort op, as jnp.argsort gives


@pytest.mark.parametrize("filters", [Filters.TOP_K, Filters.TOP_P, Filters.NONE])
def test_filter_mask_takes_only_the_cuts_its_batch_asks_for(filters: Filters) -> None:
    """A batch whose rows ask for top-k alone, top-p alone or neither, its cuts taken by the
    program for those alone: the same tokens kept as the sorting reference, on rows of distinct
    values and on rows full of ties."""
    rng = np.random.default_rng(20 + list(Filters).index(filters))
    rows, vocab = 12, 389
    scaled = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    scaled[::2] = rng.integers(-3, 3, (rows // 2, vocab)).astype(np.float32)  # ties
    top_k = (rng.choice([1, 3, 40, 388, 0], rows) if filters.top_k
             else np.zeros(rows)).astype(np.int32)
    top_p = (rng.choice([0.05, 0.5, 0.9, 1.0], rows) if filters.top_p
             else np.ones(rows)).astype(np.float32)
    got = np.asarray(filter_mask(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p),
                                 filters))
    for r in range(rows):
        want = _reference_mask(scaled[r], int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")


def test_step_filters_names_the_cuts_of_the_sampled_rows() -> None:
    greedy_top_k = SamplingParams(top_k=5)  # greedy: its cut is never taken
    assert step_filters([SamplingParams(), greedy_top_k]) is Filters.NONE
    assert step_filters([SamplingParams(temperature=1.0, seed=1, top_k=5),
                         greedy_top_k]) is Filters.TOP_K
    assert step_filters([SamplingParams(temperature=1.0, seed=1, top_p=0.9),
                         SamplingParams(temperature=1.0, seed=2, top_p=1.0)]) is Filters.TOP_P
    assert step_filters([SamplingParams(temperature=1.0, seed=1, top_p=0.9),
                         SamplingParams(temperature=1.0, seed=2, top_k=3)]) is Filters.BOTH
