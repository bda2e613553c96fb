"""Penalties, min_tokens and min-p: the device's processed logits and draws against reference
processors written from Hugging Face's and OpenAI's definitions (tests/logits_processors.py),
and an engine's greedy tokens against the numpy model with those processors, batched, under
overlap scheduling and through retractions."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.batch import Chunk
from jhicache.penalties import TokenHistory, count_sampled, penalize, write_row
from jhicache.request import Request, RequestStatus
from jhicache.sampling import filter_mask, min_p_mask, sample, sampling_arrays, step_filters
from tests import logits_processors as ref
from tests.models.numpy_reference import (
    random_hf_weights,
    reference_logits,
    small_hf_config,
    write_hf_checkpoint,
)

VOCAB = 61


def _request(prompt: list[int], generated: list[int], params: SamplingParams) -> Request:
    """A request whose step is launched: decoding, its sampled token pending."""
    req = Request("r", list(prompt), params, 0.0, pending=1, status=RequestStatus.DECODING)
    for token in generated:
        req.add_output(token)
    return req


def _penalized(history: TokenHistory, logits: np.ndarray, chunks: list[Chunk],
               rows: int) -> np.ndarray:
    """`penalize` over a step of `chunks`, the history's row writes first; the table kept."""
    step = history.step_rows(chunks, logits.shape[0], rows)
    assert step is not None
    for slot, entries in step.writes:
        history.table = write_row(history.table, slot, entries)
    out = penalize(jnp.asarray(logits), history.table, jnp.asarray(step.packed()))
    return np.asarray(out)


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.2),
    SamplingParams(min_tokens=3, stop_token_ids=(4, 9)),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                   min_tokens=2, stop_token_ids=(5,)),
]


def test_penalties_match_the_reference_processors_and_count_the_token_in_flight() -> None:
    """Each row's penalised logits equal the reference's, for prompts and outputs with repeats
    and logits of both signs; the next step's, planned before its token is read, count the
    token the step before sampled (on the device alone); rows without penalties and padding
    rows are left as they are."""
    rng = np.random.default_rng(4)
    history = TokenHistory(slots=10, vocab=VOCAB,
                           placement=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    requests = []
    for i, params in enumerate(CASES):
        prompt = rng.integers(0, VOCAB, 12).tolist() + [5, 5, 9]
        generated = rng.integers(0, VOCAB, i % 4).tolist() + ([7, 7] if i % 2 else [])
        requests.append(_request(prompt, generated, params))
    plain = _request([1, 2, 3], [4], SamplingParams())
    everyone = [*requests, plain]
    chunks = [Chunk(r, r.known_len - 1, 1, r.num_output) for r in everyone]
    logits = (rng.normal(size=(len(chunks) + 2, VOCAB)) * 3).astype(np.float32)
    rows = len(chunks) + 5
    out = _penalized(history, logits, chunks, rows)
    for i, r in enumerate(requests):
        want = ref.processed(logits[i], r.params, r.tokens[:r.prompt_len], r.output)
        np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(out[len(requests):], logits[len(requests):])
    assert history.held() == len(requests)
    assert any((out[i] != logits[i]).any() for i in range(len(requests)))

    # the step samples: each row's token is counted in on the device, the host not told
    sampled = rng.integers(0, VOCAB, rows).astype(np.int32)
    step = history.step_rows(chunks, logits.shape[0], rows)
    assert step is not None and not step.writes  # the rows are held: nothing written again
    history.table = count_sampled(history.table, jnp.asarray(step.packed()),
                                   jnp.asarray(sampled))
    chunks = [Chunk(r, r.known_len, 1, r.num_output + 1) for r in everyone]
    out = _penalized(history, logits, chunks, rows)
    for i, r in enumerate(requests):
        want = ref.processed(logits[i], r.params, r.tokens[:r.prompt_len],
                             [*r.output, int(sampled[i])])
        np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-5)


def test_rows_of_ended_requests_are_freed_and_written_again_for_the_next() -> None:
    history = TokenHistory(slots=2, vocab=VOCAB,
                           placement=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    params = SamplingParams(frequency_penalty=1.0)
    first = [_request([1], [2, 2], params), _request([3], [4], params)]
    step = history.step_rows([Chunk(r, 2, 1, r.num_output) for r in first], 2, 4)
    assert step is not None and len(step.writes) == 2 and history.held() == 2
    with pytest.raises(RuntimeError, match="token-history rows"):
        history.step_rows([Chunk(_request([5], [], params), 0, 1, 0)], 1, 4)
    first[0].status = RequestStatus.FINISHED
    later = _request([5], [6, 6, 6], params)
    step = history.step_rows([Chunk(later, 3, 1, 3)], 1, 4)
    assert step is not None and [int(s) for s, _ in step.writes] == [int(step.slots[0])]
    np.testing.assert_array_equal(step.writes[0][1] >> 2, np.bincount([6] * 3, minlength=VOCAB))
    first[1].status = later.status = RequestStatus.FINISHED
    # a step with no penalised request runs nothing, and lets the ended requests go
    assert history.step_rows([Chunk(_request([1], [], SamplingParams()), 0, 1, 0)], 1, 4) is None
    assert history.held() == 0


SAMPLED = [
    SamplingParams(temperature=0.8, seed=1, min_p=0.1),
    SamplingParams(temperature=1.3, seed=1, top_k=20, min_p=0.05),
    SamplingParams(temperature=1.0, seed=1, top_p=0.8, min_p=0.2),
    SamplingParams(temperature=0.7, seed=1, top_k=30, top_p=0.9, min_p=0.02,
                   repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.5),
]


@pytest.mark.parametrize("params", SAMPLED, ids=lambda p: f"t{p.temperature}")
def test_the_processed_distribution_equals_the_reference_s(params: SamplingParams) -> None:
    """The device's penalties, then the sampler's temperature and its masks (top-k, top-p,
    min-p) give the reference's probability vector, elementwise."""
    rng = np.random.default_rng(8)
    logits = (rng.normal(size=(1, VOCAB)) * 2.5).astype(np.float32)
    prompt, generated = rng.integers(0, VOCAB, 10).tolist(), [3, 3, 8]
    req = _request(prompt, generated, params)
    history = TokenHistory(4, VOCAB, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    penalized = (_penalized(history, logits, [Chunk(req, req.known_len - 1, 1, 3)], 4)
                 if params.penalized else logits)
    temperature, top_k, top_p, min_p, _ = map(jnp.asarray, sampling_arrays([params], [0], 1))
    scaled = jnp.asarray(penalized) / temperature[:, None]
    keep = min_p_mask(scaled, min_p) & filter_mask(scaled, top_k, top_p)
    ours = np.asarray(jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1))[0]
    want = ref.probabilities(logits[0], params, prompt, generated)
    np.testing.assert_array_equal(ours > 0, want > 0)
    np.testing.assert_allclose(ours, want, atol=1e-6)
    assert 1 < (want > 0).sum() < VOCAB  # the cuts cut, and leave a choice


def test_min_p_draws_follow_the_reference_distribution() -> None:
    """4,000 seeded draws of one row with min-p and top-k: their frequencies are the
    reference's probabilities (to sampling error), and no removed token is drawn."""
    draws, vocab = 4000, 12
    logits = np.tile(np.linspace(-2, 2, vocab, dtype=np.float32), (draws, 1))
    params = [SamplingParams(temperature=0.9, top_k=8, min_p=0.15, seed=s) for s in range(draws)]
    arrays = map(jnp.asarray, sampling_arrays(params, [0] * draws, draws))
    out = np.asarray(sample(jnp.asarray(logits), *arrays, rows=draws,
                            filters=step_filters(params)))
    want = ref.probabilities(logits[0], params[0], [], [])
    seen = np.bincount(out, minlength=vocab) / draws
    assert (seen[want == 0] == 0).all() and (want > 0).sum() > 2
    error = np.abs(seen - want)
    assert (error <= 4 * np.sqrt(want * (1 - want) / draws) + 1e-3).all(), (seen, want)


# ---- an engine's greedy tokens against the numpy model -----------------------------------

CFG = small_hf_config(tied=False, vocab_size=97, max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    weights = random_hf_weights(CFG, seed=5)
    return write_hf_checkpoint(tmp_path_factory.mktemp("penalties"), CFG, weights), weights


def reference_run(weights: dict, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens of the numpy model with the reference processors, to a stop token or
    max_new_tokens."""
    out: list[int] = []
    while len(out) < params.max_new_tokens:
        logits = reference_logits(weights, CFG, [*prompt, *out])[-1]
        out.append(ref.greedy_next(logits, params, prompt, out))
        if out[-1] in params.stop_token_ids:
            break
    return out


def _engine(path: Path, **overrides: object) -> Engine:
    config = dict(page_size=16, device_kv_tokens=512, dtype="float32", max_running_requests=8,
                  chunked_prefill_tokens=64, check_invariants_every_step=True)
    return Engine.from_pretrained(str(path), EngineConfig(**{**config, **overrides}))


def _greedy_cases(weights: dict, prompts: list[list[int]]) -> list[SamplingParams]:
    """A request per field (and one with all), each on its own prompt; min_tokens's stop ids
    are the plain run's first tokens, so that it would stop at once without them."""
    plain = reference_run(weights, prompts[5], SamplingParams(max_new_tokens=3))
    n = 10
    return [SamplingParams(max_new_tokens=n),
            SamplingParams(max_new_tokens=n, repetition_penalty=1.8),
            SamplingParams(max_new_tokens=n, repetition_penalty=0.5),
            SamplingParams(max_new_tokens=n, presence_penalty=2.0),
            SamplingParams(max_new_tokens=n, frequency_penalty=1.5),
            SamplingParams(max_new_tokens=n, min_tokens=4, stop_token_ids=tuple(plain[:2])),
            SamplingParams(max_new_tokens=n, repetition_penalty=1.2, presence_penalty=0.7,
                           frequency_penalty=0.6, min_tokens=6, stop_token_ids=(plain[0],),
                           min_p=0.3, top_k=3)]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_tokens_with_each_field_equal_the_reference(checkpoint: tuple[Path, dict],
                                                           overlap: bool) -> None:
    """One batch, each request with another field (a plain one beside them), a prompt whose
    tokens repeat, chunked prefills: every request's greedy tokens are the reference's, with
    and without overlap scheduling; the penalties change the plain run's tokens."""
    path, weights = checkpoint
    rng = np.random.default_rng(2)
    motif = rng.integers(0, CFG["vocab_size"], 6).tolist()
    prompts = [motif * 3 + rng.integers(0, CFG["vocab_size"], 5 + 9 * i).tolist()
               for i in range(7)]
    prompts[4] = prompts[3]  # whose plain run repeats a token: the penalties have work
    params = _greedy_cases(weights, prompts)
    engine = _engine(path, overlap_schedule=overlap)
    outputs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == reference_run(weights, prompt, p), p
        plain = reference_run(weights, prompt, SamplingParams(max_new_tokens=p.max_new_tokens))
        assert p == params[0] or out.token_ids != plain, p  # the field does something
    assert len(outputs[5].token_ids) > params[5].min_tokens  # its stop ids came first plain
    engine.check_invariants()


@pytest.mark.slow
def test_penalised_requests_through_retractions_equal_the_reference(
        checkpoint: tuple[Path, dict]) -> None:
    """A pool too small for the batch's decodes: requests are retracted and run again (their
    history rows given up, then written again from the tokens the host knows); their greedy
    tokens are still the reference's."""
    path, weights = checkpoint
    engine = _engine(path, device_kv_tokens=96, cache_mode="hierarchical", host_kv_tokens=512,
                     load_back_threshold=1)
    prompts = [[(7 * i + j) % 97 for j in range(30)] for i in range(3)]
    params = [SamplingParams(max_new_tokens=25, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(max_new_tokens=25, presence_penalty=0.8),
              SamplingParams(max_new_tokens=25, frequency_penalty=0.5, min_tokens=20,
                             stop_token_ids=(11,))]
    outputs = engine.generate(prompts, params)
    assert engine.stats().retracted_requests > 0
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == reference_run(weights, prompt, p)
    engine.check_invariants()


def test_the_penalties_sort_nothing() -> None:
    """The penalties' program holds no sort (elementwise over each row's table entries)."""
    rows, vocab = 4, 300
    lowered = penalize.lower(jnp.zeros((rows, vocab)), jnp.zeros((6, vocab), jnp.int32),
                             jnp.zeros(8 + 4 * rows, jnp.int32))
    assert " sort(" not in lowered.compile().as_text()


def test_the_warm_up_s_padding_changes_nothing() -> None:
    """The warm-up's inputs (a row write and counts past the table, neutral penalties) leave
    the table and the logits as they are."""
    history = TokenHistory(3, VOCAB, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    history.table = write_row(history.table, np.asarray(1, np.int32),
                              np.arange(VOCAB, dtype=np.int32))
    before = np.asarray(history.table)
    step = history.padding(2, 4, write=True)
    table = history.table
    for slot, entries in step.writes:
        table = write_row(table, slot, entries + 7)
    logits = np.random.default_rng(1).normal(size=(2, VOCAB)).astype(np.float32)
    packed = jnp.asarray(step.packed())
    np.testing.assert_array_equal(np.asarray(penalize(jnp.asarray(logits), table, packed)),
                                  logits)
    table = count_sampled(table, packed, jnp.arange(4, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(table), before)
