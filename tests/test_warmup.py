"""The shape grid and the warm-up: the programs an engine can run follow from its config, are
all compiled by `warmup()`, and serving after it compiles nothing, whatever the traffic."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from jhicache.models import functional, init_random, preset_config

from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.compiles import CompileError
from jhicache.grid import ShapeGrid, StepShape, token_ladder
from jhicache.warmup import read_back, timing_shapes
from tests.logits_processors import greedy_next
from tests.models.numpy_reference import (
    random_hf_weights,
    reference_logits,
    small_hf_config,
    write_hf_checkpoint,
)

# ---- the grid ----------------------------------------------------------------------------


def test_the_7b_defaults_grid_is_bounded_and_pads_little() -> None:
    grid = ShapeGrid.create(chunked_prefill_tokens=4096, max_running_requests=64, page_size=64,
                            max_context_len=32768)
    assert grid.prefill_tokens == (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert grid.prefill_requests == (1, 4, 16, 64)
    assert grid.decode_requests == (4, 8, 16, 32, 64)
    assert grid.page_width == 512 and grid.max_requests == 64
    shapes = grid.shapes()
    assert len(shapes) == 49 == len(set(shapes)) == grid.describe()["shapes"]
    # above 256 tokens, less than a third of a padded step is padding
    for n in range(257, 4097):
        padded = grid.shape_for(n, 1, False).tokens
        assert padded - n < padded / 3


def test_the_shapes_compiled_alone_meet_every_token_and_request_count_once() -> None:
    """Each token count and request count is met first by a shape compiled alone, so XLA times
    every matmul's kernels with no compile beside it; every other shape comes after."""
    grid = ShapeGrid.create(chunked_prefill_tokens=4096, max_running_requests=64, page_size=64,
                            max_context_len=32768)
    alone = timing_shapes(grid.shapes())
    assert len(alone) == 18
    assert {s.tokens for s in alone} == {s.tokens for s in grid.shapes()}
    assert {s.requests for s in alone} == {s.requests for s in grid.shapes()}
    for shape in alone:  # each brings a count no shape before it had
        before = grid.shapes()[:grid.shapes().index(shape)]
        assert (shape.tokens not in {s.tokens for s in before}
                or shape.requests not in {s.requests for s in before})


@pytest.mark.parametrize("limit,want", [(64, (64,)), (100, (64, 112)), (8, (64,)),
                                        (600, (64, 128, 256, 384, 512, 608))])
def test_token_ladder_ends_at_the_chunk_size(limit: int, want: tuple[int, ...]) -> None:
    assert token_ladder(limit) == want


def test_every_step_a_config_allows_maps_to_a_shape_of_its_grid() -> None:
    grid = ShapeGrid.create(chunked_prefill_tokens=100, max_running_requests=6, page_size=16,
                            max_context_len=300)
    assert StepShape(2, 6, False) not in ShapeGrid(  # 5+ requests need 5+ tokens
        (2, 8), (1, 4, 6), (4,), 16, 300).shapes()
    assert grid.prefill_requests == (1, 4, 6) and grid.decode_requests == (4, 6)
    shapes = set(grid.shapes())
    for requests in range(1, 7):
        assert grid.shape_for(requests, requests, True) in shapes
        for tokens in range(requests, 101):
            shape = grid.shape_for(tokens, requests, False)
            assert shape in shapes and shape.tokens >= tokens and shape.requests >= requests
    assert grid.page_width == 19  # 300 tokens in pages of 16
    with pytest.raises(ValueError, match="prefill tokens"):
        grid.shape_for(113, 1, False)
    with pytest.raises(ValueError, match="decoding requests"):
        grid.shape_for(7, 7, True)


def test_the_context_limit_is_the_least_of_model_pool_and_config() -> None:
    model = init_random(preset_config("tiny"), seed=0)  # context 4096
    small = Engine(model, EngineConfig(page_size=16, device_kv_tokens=512, dtype="float32"))
    assert small.grid.max_context_len == 512
    capped = Engine(model, EngineConfig(page_size=16, device_kv_tokens=512, dtype="float32",
                                        max_context_len=200, cache_mode="device"))
    assert capped.grid.max_context_len == 200 and capped.grid.page_width == 13
    with pytest.raises(ValueError, match="context limit"):
        capped.add_request([1] * 190, SamplingParams(max_new_tokens=11))
    assert not capped.has_unfinished()
    capped.add_request([1] * 190, SamplingParams(max_new_tokens=10))  # exactly at the limit
    with pytest.raises(ValueError, match="max_context_len"):
        EngineConfig(max_context_len=0)


# ---- the warm-up and serving after it ----------------------------------------------------

CFG = small_hf_config(tied=False, max_position_embeddings=256)
ENGINE = dict(page_size=16, device_kv_tokens=320, host_kv_tokens=1280, dtype="float32",
              max_running_requests=6, chunked_prefill_tokens=128, load_back_threshold=1,
              fail_on_compile=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    weights = random_hf_weights(CFG, seed=5)
    return write_hf_checkpoint(tmp_path_factory.mktemp("warm"), CFG, weights), weights


def reference_greedy(weights: dict, prompt: list[int], n: int,
                     params: SamplingParams = SamplingParams()) -> list[int]:
    """`n` greedy tokens of the numpy model, with `params`'s penalties."""
    out: list[int] = []
    for _ in range(n):
        logits = reference_logits(weights, CFG, [*prompt, *out])[-1]
        out.append(greedy_next(logits, params, prompt, out))
    return out


def _penalties(n: int) -> dict:
    """Every penalty, and min_tokens (at most `n`) holding a stop token back."""
    return dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                min_tokens=min(n, 2), stop_token_ids=(3,))


Finished = tuple[list[int], SamplingParams, list[int]]


def random_traffic(engine: Engine, rng: np.random.Generator) -> list[Finished]:
    """Conversations that grow to the context limit (device and host hits, chunked prefills),
    then an online burst of any lengths with aborts, sampled rows, penalties and log
    probabilities. Returns (prompt, params, greedy output) of every greedy request that
    finished."""
    limit, vocab, done = engine.grid.max_context_len, CFG["vocab_size"], []
    chats: list[list[int]] = [[] for _ in range(3)]
    while min(len(c) for c in chats) < limit - 60:
        live = [c for c in chats if len(c) < limit - 60]
        prompts = [c + rng.integers(0, vocab, int(rng.integers(1, 50))).tolist() for c in live]
        lengths = [int(rng.integers(1, 8)) for _ in prompts]
        params = [SamplingParams(max_new_tokens=n, **(_penalties(n) if k % 2 else {}))
                  for k, n in enumerate(lengths)]
        for chat, prompt, p, out in zip(live, prompts, params, engine.generate(prompts, params)):
            done.append((prompt, p, out.token_ids))
            chat[:] = prompt + out.token_ids
    ids = {}
    for i in range(7):  # 1 token up to the limit, some reusing a conversation's prefix
        n = int(rng.integers(1, 8))
        length = [1, limit - n, int(rng.integers(1, limit - n))][i % 3]
        prefix = chats[i % 3][:length] if i % 2 else []
        prompt = prefix + rng.integers(0, vocab, length - len(prefix)).tolist()
        sampled = i in (3, 5)  # with top-k (the sorting sampler), and without
        params = SamplingParams(max_new_tokens=n, temperature=1.0 if sampled else 0.0,
                                top_k=5 if i != 5 else None, min_p=0.1 if i == 3 else 0.0,
                                seed=i, logprobs=2 if i % 2 else None,  # their programs too
                                prompt_logprobs=(1 + 2 * (i % 2)) if i % 3 == 1 else None,
                                **(_penalties(n) if i in (1, 3, 4) else {}))
        ids[engine.add_request(prompt, params)] = (prompt, params)
        if i % 2:
            engine.step()
    outputs, tokens = {}, {rid: [] for rid in ids}
    for steps in range(1000):
        if steps == 3:
            for rid in list(ids)[::3]:  # aborted at once, while prefilling or decoding
                engine.abort(rid)
        for out in engine.step():
            outputs[out.request_id] = out
            tokens[out.request_id] += out.new_token_ids
        if not engine.has_unfinished():
            break
    engine.step()
    engine.step()
    for rid, (prompt, params) in ids.items():
        out = outputs.get(rid)
        if out is not None and out.finish_reason == "length" and params.is_greedy:
            done.append((prompt, params, tokens[rid]))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("mode,programs", [("hierarchical", None), ("device", None),
                                           ("off", None), ("hierarchical", (1, 1, 0))],
                         ids=["hierarchical", "device", "off", "hierarchical-3-programs"])
def test_after_warmup_random_traffic_compiles_nothing_and_matches_the_reference(
        checkpoint: tuple[Path, dict], mode: str, programs: tuple[int, ...] | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with the forward split into three programs (a middle one, and a last one of only the
    head): warm-up compiles every one of them."""
    if programs is not None:
        monkeypatch.setattr(functional, "program_layers", lambda n: programs)
    path, weights = checkpoint
    engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode=mode, **ENGINE))
    report = engine.warmup(progress=False)
    assert report.shapes == len(engine.grid.shapes()) == 8  # (64, 128) x (1, 4, 6), (4, 6)
    assert report.late_compiles == 0  # the first pass typed every program as a step calls it
    assert engine.warmed_up and engine.stats().compiles_warmup == report.compiles
    finished = random_traffic(engine, np.random.default_rng(11))
    stats = engine.stats()
    assert stats.compiles_serving == 0  # fail_on_compile would have raised already
    assert len(finished) > 20 and sum(p.penalized for _, p, _ in finished) >= 8
    for prompt, params, output in finished:
        assert output == reference_greedy(weights, prompt, len(output), params)
    assert max(len(p) + len(o) for p, _, o in finished) == engine.grid.max_context_len
    if mode != "off":
        assert stats.device_hit_tokens > 0
    if mode == "hierarchical":
        assert stats.host_hit_tokens > 0 and stats.write_back_ops > 0
    engine.check_invariants()


def test_a_compile_while_serving_raises_naming_the_program_and_shape() -> None:
    """Under fail_on_compile, an engine that was not warmed up fails its first step, and the
    compile is counted as a serving one; the engine stays consistent."""
    config = dataclasses.replace(preset_config("tiny"), vocab_size=211)  # programs of its own
    engine = Engine(init_random(config, seed=0),
                    EngineConfig(page_size=16, device_kv_tokens=256, dtype="float32",
                                 fail_on_compile=True, chunked_prefill_tokens=32,
                                 cache_mode="device"))  # its invariant check reads no device
    compiled_first = r"prefill\(tokens=64, requests=1\) step: .*jit\(first\)"
    with pytest.raises(CompileError, match=compiled_first):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert engine.stats().compiles_serving > 0 and not engine.has_unfinished()
    engine.check_invariants()


def test_warmup_shows_progress_and_logs_its_phases(checkpoint: tuple[Path, dict],
                                                    capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path, _ = checkpoint
    with caplog.at_level(logging.INFO):
        engine = Engine.from_pretrained(str(path), EngineConfig(cache_mode="device", **ENGINE))
        report = engine.warmup()
    assert "warm-up" in capsys.readouterr().err  # tqdm's bar
    built = [r.message for r in caplog.records if r.name == "jhicache.engine"]
    warmed = [r.message for r in caplog.records if r.name == "jhicache.warmup"]
    assert len(built) == 1 and "weights" in built[0] and "pools" in built[0]
    assert len(warmed) == 1 and f"{report.shapes} shapes" in warmed[0]
    assert engine.startup.weights_s is not None and engine.startup.warmup == report
    assert report.frozen_objects == 0  # a library's warm-up leaves the collector as it is
    assert report.ahead_tasks == len(engine.grid.shapes())  # no gathers: no host tier
    timing = len(timing_shapes(engine.grid.shapes()))  # 1 alone: the suite's cache was warm
    assert report.alone_tasks == timing or (report.alone_tasks == 1 and report.cache_hits > 0)
    with pytest.raises(ValueError, match="idle"):
        engine.add_request([1, 2], SamplingParams())
        engine.warmup()


def test_a_restart_reads_its_programs_back_in_parallel(checkpoint: tuple[Path, dict]) -> None:
    """With JAX's persistent compilation cache on (the suite's conftest turns it on), a second
    engine of the same config reads every program back, so only its first shape runs alone:
    nothing is left for XLA to time."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("JAX's persistent compilation cache is off")
    path, _ = checkpoint
    config = EngineConfig(cache_mode="device", **ENGINE)
    first = Engine.from_pretrained(str(path), config)
    first.warmup(progress=False)
    jax.clear_caches()  # a restart: JAX's in-process caches are empty
    again = Engine.from_pretrained(str(path), config).warmup(progress=False)
    assert again.compiles == again.cache_hits > 0 and again.alone_tasks == 1
    assert again.ahead_tasks == len(first.grid.shapes())  # every shape still read back


def test_a_task_is_read_back_when_every_program_it_compiled_was_a_cache_hit() -> None:
    assert read_back(compiles=6, cache_hits=6)
    assert not read_back(compiles=6, cache_hits=5)  # one compiled: XLA timed its kernels
    assert not read_back(compiles=0, cache_hits=0)  # nothing compiled: nothing known
