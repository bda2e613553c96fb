"""Log probabilities of generated tokens: the device program against NumPy on random logits;
the engine's against a float64 reference forward of a checkpoint, in every cache mode, with the
prefix on device, on host and not cached, with overlap on and off, beside requests that ask for
none, and across the engine process boundary."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhicache import AsyncEngine, Engine, EngineConfig, SamplingParams
from jhicache.logprobs import (
    MAX_LOGPROBS,
    MAX_TOKEN_IDS,
    PromptLogprobs,
    PromptScores,
    TokenLogprob,
    asked_ids,
    logsumexp_and_max,
    reference_logprobs,
    token_logprobs,
    top_k_in_passes,
)
from tests.delivery import one_at_a_time
from tests.models.numpy_reference import (
    random_hf_weights,
    reference_logits,
    small_hf_config,
    write_hf_checkpoint,
)

CFG = small_hf_config(tied=True, max_position_embeddings=256)
ENGINE = dict(page_size=16, device_kv_tokens=320, host_kv_tokens=1280, dtype="float32",
              max_running_requests=4, chunked_prefill_tokens=64, load_back_threshold=1)
TOLERANCE = 2e-4  # float32 forward against float64, on log probabilities of magnitude ~5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    weights = random_hf_weights(CFG, seed=11)
    return write_hf_checkpoint(tmp_path_factory.mktemp("lp"), CFG, weights), weights


def test_the_program_matches_numpy_on_random_logits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 1000)).astype(np.float32)
    logits[1, 10:14] = logits[1].max() + 1  # ties at the top
    # 20 ranks, four of them tied across the boundary of top_k_in_passes' first pass (16)
    logits[2, 100:120] = np.arange(40, 20, -1)
    logits[2, 113:117] = 27.0
    sampled = np.array([5, 11, 999, 0, 0, 0], np.int32)  # padded rows past the batch
    named = [[3, 999, 3], [], list(range(500, 500 + MAX_TOKEN_IDS))]  # asked ids, repeats too
    chosen, top, ids, asked = (np.asarray(a) for a in token_logprobs(
        jnp.asarray(logits), jnp.asarray(sampled), asked_ids(named, 3)))
    assert top.shape == ids.shape == (3, MAX_LOGPROBS) and asked.shape == (3, MAX_TOKEN_IDS)
    for row in range(3):
        want = reference_logprobs(logits[row], int(sampled[row]), MAX_LOGPROBS, named[row])
        assert chosen[row] == pytest.approx(want.logprob, abs=1e-5)
        assert asked[row, :len(named[row])] == pytest.approx([v for _, v in want.asked],
                                                              abs=1e-5)
        np.testing.assert_allclose(top[row], [v for _, v in want.top], atol=1e-5)
        got_ids = [int(i) for i in ids[row]]
        if row == 1:  # ties come in either order
            assert set(got_ids[:4]) == set(range(10, 14))
            assert got_ids[4:] == [i for i, _ in want.top][4:]
        elif row == 2:
            assert got_ids[:13] == list(range(100, 113))
            assert set(got_ids[13:17]) == set(range(113, 117))
            assert got_ids[17:] == list(range(117, 120))
        else:
            assert got_ids == [i for i, _ in want.top]


def test_prompt_logprobs_fill_read_copy_and_cross_the_engine_process_wire() -> None:
    """A prompt's entries fill from a step's rows (their first columns, as many alternatives as
    the prompt asked for), read back as records (None where unfilled: position 0), and a copy
    stays as it was when the original is filled again. Through the engine process's wire (its
    arrays as raw bytes) it arrives equal."""
    from jhicache.engine_process import Outputs, child_encoder, parent_decoder
    from jhicache.request import RequestOutput

    rng = np.random.default_rng(5)
    table = PromptLogprobs.empty([7, 8, 9, 10, 11], 2, asked=(40, 41, 40))
    chosen = rng.normal(size=3).astype(np.float32)
    values = rng.normal(size=(3, 4)).astype(np.float32)
    ids = rng.integers(0, 100, (3, 4)).astype(np.int32)
    asked = rng.normal(size=(3, MAX_TOKEN_IDS)).astype(np.float32)
    table.fill(1, chosen, values, ids, asked)
    assert table[0] is None and table[4] is None and len(table) == 5
    assert table[2] == TokenLogprob(9, float(chosen[1]),
                                    [(int(ids[1, 0]), float(values[1, 0])),
                                     (int(ids[1, 1]), float(values[1, 1]))],
                                    [(40, float(asked[1, 0])), (41, float(asked[1, 1])),
                                     (40, float(asked[1, 2]))])
    assert table[1:3] == [table[1], table[2]] and list(table)[3] == table[3]
    before = table.copy()
    table.fill(1, chosen + 1, values, ids, asked)
    assert before[1] is not None and before[1].logprob == float(chosen[0])
    assert table[1] is not None and table[1].logprob == float(chosen[0] + 1)
    assert before != table and before == before.copy()
    record = TokenLogprob(1, -0.5, [(2, -1.0)], [(3, -2.0), (1, -0.5)])
    out = RequestOutput("r", [1], False, 5, 0, 0, None, None, logprobs=[record],
                        prompt_scores=PromptScores(0, table))
    wire = parent_decoder().decode(child_encoder().encode(Outputs([out])))
    assert isinstance(wire, Outputs)
    assert wire.items[0].logprobs == [record]
    assert wire.items[0].prompt_scores is not None
    got = wire.items[0].prompt_scores.rows
    assert got == table and list(got) == list(table) and got.filled_to == table.filled_to == 4
    assert got.top_ids.dtype == np.int32 and got.top_values.shape == (5, 2)
    nothing = PromptLogprobs.empty([3, 4], 0)  # the chosen tokens' alone
    nothing.fill(1, chosen[:1], values[:1], ids[:1], asked[:1])
    assert nothing[1] == TokenLogprob(4, float(chosen[0]), [])


@pytest.mark.parametrize("seed", [0, 1])
def test_logsumexp_and_max_in_one_pass_equals_numpy(seed: int) -> None:
    """Fresh random rows (one with ties at its top, one mostly -inf, one all -inf) against
    float64 NumPy: the logsumexp, the largest value, and the first index that holds it."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 4, (6, 3001)).astype(np.float32)
    values[1, [7, 300, 2999]] = values[1].max() + 2  # ties: the first index wins
    values[2, :] = -np.inf
    values[2, [5, 40]] = [1.5, -2.0]
    values[3, :] = -np.inf
    lse, top, first = (np.asarray(a) for a in jax.jit(logsumexp_and_max)(jnp.asarray(values)))
    wide = values.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        high = wide.max(axis=1, keepdims=True)
        want = (high + np.log(np.exp(wide - high).sum(axis=1, keepdims=True)))[:, 0]
    np.testing.assert_allclose(lse[[0, 1, 2, 4, 5]], want[[0, 1, 2, 4, 5]], rtol=1e-6)
    assert lse[3] == -np.inf and top[3] == -np.inf
    np.testing.assert_array_equal(top, values.max(axis=1))
    np.testing.assert_array_equal(first[[0, 1, 2, 4, 5]], values.argmax(axis=1)[[0, 1, 2, 4, 5]])
    assert first[1] == 7


@pytest.mark.parametrize("k", [1, 16, 17, 20, 33])
def test_top_k_in_passes_equals_top_k_on_random_rows(k: int) -> None:
    """Fresh random rows with repeated values, against jax.lax.top_k's values and ids."""
    rng = np.random.default_rng(k)
    values = jnp.asarray(rng.integers(0, 50, (4, 300)).astype(np.float32))  # many ties
    top, ids = top_k_in_passes(values, k)
    want_top, _ = jax.lax.top_k(values, k)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(want_top))
    for row in range(4):  # each id names its value, none twice
        assert len(set(np.asarray(ids[row]).tolist())) == k
        np.testing.assert_array_equal(np.asarray(values[row])[np.asarray(ids[row])],
                                      np.asarray(top[row]))


def expected(weights: dict, prompt: list[int], output: list[int], n: int,
             asked: tuple[int, ...] = ()) -> list[TokenLogprob]:
    """Each generated token's record from the float64 reference forward of what precedes it."""
    tokens = prompt + output
    logits = reference_logits(weights, CFG, tokens)
    return [reference_logprobs(logits[len(prompt) + i - 1], output[i], n, asked)
            for i in range(len(output))]


def assert_close(got: list[TokenLogprob] | None, want: list[TokenLogprob]) -> None:
    assert got is not None and len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=TOLERANCE)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
        np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top], atol=TOLERANCE)
        assert [i for i, _ in g.asked] == [i for i, _ in w.asked]
        np.testing.assert_allclose([v for _, v in g.asked], [v for _, v in w.asked],
                                   atol=TOLERANCE)


PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, CFG["vocab_size"], 100)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["off", "device", "hierarchical"])
def test_logprobs_equal_the_reference_wherever_the_prefix_is(checkpoint, mode: str,
                                                             overlap: bool) -> None:
    """Not cached, then a device hit, then (hierarchical) a host hit: the same records, equal
    to the reference's; a request beside them that asks for none gets None."""
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode=mode,
                                                            overlap_schedule=overlap, **ENGINE))
    params = SamplingParams(max_new_tokens=5, logprobs=3)
    other = SamplingParams(max_new_tokens=5)
    placements = ["none", "device"] + (["host"] if mode == "hierarchical" else [])
    want = None
    for where in placements:
        if where == "host":
            engine.evict()
        out, beside = engine.generate([PROMPT + [7, 8], PROMPT[:40]], [params, other])
        assert beside.logprobs is None
        if want is None:
            want = expected(weights, PROMPT + [7, 8], out.token_ids, 3)
        assert_close(out.logprobs, want)
        hits = {"none": 0, "device": out.device_hit_tokens, "host": out.host_hit_tokens}
        assert where == "none" or mode == "off" or hits[where] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_named_tokens_equal_the_reference_for_generated_and_prompt_tokens(checkpoint,
                                                                          overlap: bool) -> None:
    """`token_ids_logprob`: the named ids' log probabilities (in the order named, a repeat kept)
    with each generated token's record and each prompt entry's, not cached, then a device
    hit, then a host hit; in the same steps as a request that names none and one that asks
    for nothing."""
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(
        cache_mode="hierarchical", overlap_schedule=overlap, **ENGINE))
    named = (5, 60, 5, CFG["vocab_size"] - 1)
    params = SamplingParams(max_new_tokens=4, logprobs=1, prompt_logprobs=0,
                            prompt_logprobs_start=70, token_ids_logprob=named)
    plain_logprobs = SamplingParams(max_new_tokens=4, logprobs=2)
    prompt = PROMPT[:90]
    logits = reference_logits(weights, CFG, prompt)
    want_prompt = [reference_logprobs(logits[p - 1], prompt[p], 0, named)
                   for p in range(70, len(prompt))]
    want = None
    for where in ("none", "device", "host"):
        if where == "host":
            engine.evict()
        out, beside, other = engine.generate([prompt, PROMPT[:50], PROMPT[:30]],
                                             [params, plain_logprobs, SamplingParams()])
        if want is None:
            want = expected(weights, prompt, out.token_ids, 1, named)
        assert_close(out.logprobs, want)
        assert_prompt_close(out.prompt_logprobs, want_prompt)
        assert beside.logprobs is not None and all(r.asked == [] for r in beside.logprobs)
        assert other.logprobs is None and other.prompt_logprobs is None
        assert where != "host" or out.host_hit_tokens > 0
    outside = SamplingParams(logprobs=0, token_ids_logprob=(CFG["vocab_size"],))
    with pytest.raises(ValueError, match="token_ids_logprob"):  # refused; the engine serves on
        engine.generate([prompt], outside)
    assert_close(engine.generate([prompt], params)[0].logprobs, want)


def test_named_tokens_are_checked() -> None:
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logprobs=0, token_ids_logprob=tuple(range(MAX_TOKEN_IDS + 1)))
    with pytest.raises(ValueError, match="set logprobs or prompt_logprobs"):
        SamplingParams(token_ids_logprob=(1,))
    with pytest.raises(ValueError, match="token_ids_logprob"):
        SamplingParams(logprobs=0, token_ids_logprob=(-1,))


def test_zero_asks_for_the_chosen_token_only_and_sampling_keeps_the_raw_values(
        checkpoint) -> None:
    """logprobs=0: no alternatives. A sampled token's value is that of the raw logits (before
    temperature and top-k), as vLLM gives by default."""
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode="device", **ENGINE))
    greedy, hot = engine.generate(
        [PROMPT, PROMPT], [SamplingParams(max_new_tokens=3, logprobs=0),
                           SamplingParams(max_new_tokens=3, logprobs=2, temperature=5.0,
                                          top_k=50, seed=1)])
    assert greedy.logprobs is not None and all(r.top == [] for r in greedy.logprobs)
    assert_close(greedy.logprobs, expected(weights, PROMPT, greedy.token_ids, 0))
    assert_close(hot.logprobs, expected(weights, PROMPT, hot.token_ids, 2))


def test_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


@pytest.mark.parametrize("process", [False, True])
def test_streamed_logprobs_grow_with_the_tokens(checkpoint, process: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Through AsyncEngine (in a thread or an engine process): each streamed output's records
    cover its tokens so far, and the last ones equal the reference's; the prompt's come with
    the first token and the last output, and before the first token, with no token, as each
    chunk fills them (the entries filled so far equal to the reference's, the rest not yet).
    Those before the first token are delivered one at a time: a lagging consumer would get
    them merged into the first token's."""
    path, weights = checkpoint
    taken = one_at_a_time(monkeypatch, lambda out: not out.new_token_ids)
    config = EngineConfig(cache_mode="hierarchical", **ENGINE)
    params = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=1,
                            prompt_logprobs_start=10)

    async def run() -> list:
        async with AsyncEngine.from_pretrained(str(path), config, process=process) as served:
            outs = []
            async for out in served.stream(PROMPT, params):
                outs.append(out)
                taken.set()
            [final] = await served.generate([PROMPT[:50]], params)
        return [*outs, final]

    *outs, final = asyncio.run(run())
    logits = reference_logits(weights, CFG, PROMPT)
    want = [reference_logprobs(logits[p - 1], PROMPT[p], 1) for p in range(10, len(PROMPT))]
    filling = list(itertools.takewhile(lambda out: not out.new_token_ids, outs))
    assert filling  # the prompt spans chunks: the first ones' entries came on their own
    given = 0  # entries in the outputs before
    for out in filling:
        scores = out.prompt_scores
        assert scores is not None and not out.token_ids and not out.finished
        assert scores.start == given and given < scores.stop < len(want)
        assert_prompt_close(list(scores.rows), want[given:scores.stop])
        given = scores.stop
    outs = outs[len(filling):]
    for out in outs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
    tokens = [t for out in outs for t in out.new_token_ids]
    assert_close([r for out in outs for r in out.logprobs or ()],
                 expected(weights, PROMPT, tokens, 2))
    assert_close(final.logprobs, expected(weights, PROMPT[:50], final.token_ids, 2))
    rest = outs[0].prompt_scores  # with the first token: the last chunk's entries
    assert rest is not None and (rest.start, rest.stop) == (given, len(want))
    assert all(out.prompt_scores is None for out in outs[1:])
    joined = PromptScores.join([out.prompt_scores for out in filling + outs[:1]
                                if out.prompt_scores is not None])
    assert joined is not None and joined.start == 0
    assert_prompt_close(list(joined.rows), want)
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == 40


@pytest.mark.parametrize("overlap", [False, True])
def test_only_a_scored_prompt_has_outputs_before_its_first_token(checkpoint,
                                                                 overlap: bool) -> None:
    """Two prompts of several chunks stepped together, one scored: only it has outputs without
    a token, all before its first, each with more of its entries filled than the one before."""
    path, _ = checkpoint
    config = EngineConfig(cache_mode="off", overlap_schedule=overlap, **ENGINE)
    engine = Engine.from_pretrained(str(path), config)
    scored = engine.add_request(PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    plain = engine.add_request(PROMPT[::-1], SamplingParams(max_new_tokens=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    by_request = {rid: [o for o in outputs if o.request_id == rid] for rid in (scored, plain)}
    assert all(o.new_token_ids or o.finished for o in by_request[plain])
    filling = list(itertools.takewhile(lambda o: not o.new_token_ids, by_request[scored]))
    assert filling and all(o.new_token_ids for o in by_request[scored][len(filling):])
    scores = [o.prompt_scores for o in filling if o.prompt_scores is not None]
    assert len(scores) == len(filling) and scores[0].start == 0
    assert all(a.stop == b.start for a, b in zip(scores, scores[1:]))  # each part once, in order
    assert all(s.start < s.stop for s in scores) and scores[-1].stop < len(PROMPT) - 1


def assert_prompt_close(got: list[TokenLogprob | None] | None, want: list) -> None:
    assert got is not None and len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_close([g], [w])  # type: ignore[list-item]


@pytest.mark.parametrize("start", [0, 40])
@pytest.mark.parametrize("mode", ["off", "device", "hierarchical"])
def test_prompt_logprobs_equal_the_reference_whatever_was_cached(checkpoint, mode: str,
                                                                 start: int) -> None:
    """Prompt log probabilities from `start`: the cache is matched only up to the page before
    it, the rest computed (in chunks), with the same records whether the prompt was cached on
    device, on host or not at all."""
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode=mode, **ENGINE))
    logits = reference_logits(weights, CFG, PROMPT)
    want = [None if p == 0 else reference_logprobs(logits[p - 1], PROMPT[p], 2)
            for p in range(start, len(PROMPT))]
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=2, prompt_logprobs_start=start)
    engine.generate([PROMPT], SamplingParams(max_new_tokens=2))  # the prompt cached
    placements = ["device"] + (["host"] if mode == "hierarchical" else [])
    for where in placements:
        if where == "host":
            engine.evict()
        out = engine.generate([PROMPT], params)[0]
        assert_prompt_close(out.prompt_logprobs, want)
        cached = out.device_hit_tokens + out.host_hit_tokens
        assert cached == (0 if mode == "off" else (max(start, 1) - 1) // 16 * 16)
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=1))[0].prompt_logprobs is None


@pytest.mark.parametrize("asked", [(1,), (0, 1), (1, 3), (3,)])
def test_prompt_logprobs_in_one_step_equal_the_reference_whatever_each_asks(checkpoint,
                                                                           asked) -> None:
    """Requests prefilled in one step, each asking for its own number of alternatives per prompt
    token (at most one: the step takes the top-1 program; more: the top-20's)."""
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode="device", **ENGINE))
    prompts = [PROMPT[:20 + 7 * i] for i in range(len(asked))]
    params = [SamplingParams(max_new_tokens=1, prompt_logprobs=n) for n in asked]
    for prompt, n, out in zip(prompts, asked, engine.generate(prompts, params)):
        logits = reference_logits(weights, CFG, prompt)
        want = [None] + [reference_logprobs(logits[p - 1], prompt[p], n)
                         for p in range(1, len(prompt))]
        assert_prompt_close(out.prompt_logprobs, want)
        assert all(len(r.top) == n for r in out.prompt_logprobs[1:])  # type: ignore[union-attr]


def test_prompt_logprobs_start_past_the_prompt_is_refused(checkpoint) -> None:
    path, _ = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode="device", **ENGINE))
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        engine.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=1, prompt_logprobs_start=3))


def test_logprobs_equal_hf_transformers(checkpoint) -> None:
    """Against transformers' own Qwen2 in float32 where torch and transformers are installed
    (the GPU machine; CI's CPU environment has neither, so it skips there)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, _ = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode="device", **ENGINE))
    params = SamplingParams(max_new_tokens=4, logprobs=3, prompt_logprobs=3,
                            token_ids_logprob=(2, 7))
    out = engine.generate([PROMPT], params)[0]
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1).numpy()
    tokens = PROMPT + out.token_ids
    assert out.prompt_logprobs is not None and out.logprobs is not None
    for position, got in list(enumerate(out.prompt_logprobs))[1:] + [
            (len(PROMPT) + i, r) for i, r in enumerate(out.logprobs)]:
        assert got is not None
        row = logp[position - 1]
        assert got.logprob == pytest.approx(row[tokens[position]], abs=TOLERANCE)
        assert [v for _, v in got.top] == pytest.approx(sorted(row)[::-1][:3], abs=TOLERANCE)
        assert [i for i, _ in got.asked] == [2, 7]
        assert [v for _, v in got.asked] == pytest.approx([row[2], row[7]], abs=TOLERANCE)
