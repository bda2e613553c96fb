"""Engine: greedy output independent of cache mode, write policy, page size and batching; bad
input."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from jhicache.models import init_random, preset_config

import jhicache.cache.cache_tiers as cache_tiers_module
from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.bench.workload import MultiTurnChats, MultiTurnSpec
from jhicache.config import TransferTuning
from tests.cache._helpers import DeferredCopier

SPEC = MultiTurnSpec(num_clients=3, num_rounds=3, request_length=70, output_length=3,
                     vocab_size=512, seed=7)
POOL_TOKENS = 384  # working set is 657 tokens: eviction, write-back and load-back must all happen


@functools.cache
def _model():
    # Untied head: with a tied random head, greedy decoding just echoes the last token. Three
    # layers: the layer-split forward and segment loads then run a one-layer and a two-layer group.
    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False,
                                 num_hidden_layers=3)
    return init_random(config, seed=1)


def make_engine(**overrides) -> Engine:
    config = dict(page_size=16, device_kv_tokens=POOL_TOKENS, dtype="float32",
                  load_back_threshold=1, check_invariants_every_step=True, max_running_requests=8)
    return Engine(_model(), EngineConfig(**{**config, **overrides}))


def run_chats(engine: Engine, spec: MultiTurnSpec = SPEC) -> list[list[int]]:
    chats = MultiTurnChats(spec)
    for _ in range(spec.num_rounds):
        outputs = engine.generate(chats.prompts(),
                                  SamplingParams(max_new_tokens=spec.output_length))
        chats.extend([o.token_ids for o in outputs])
    return chats.histories


@functools.cache
def reference_histories() -> list[list[int]]:
    return run_chats(make_engine(cache_mode="off"))


def assert_idle_and_consistent(engine: Engine) -> None:
    engine.check_invariants()
    stats = engine.stats()
    assert stats.protected_tokens == 0 and stats.loads_in_flight == 0
    capacity = engine.device_pool.layout.num_pages - 1
    assert stats.device_free_pages + stats.evictable_tokens // engine.config.page_size == capacity


def assert_matches_no_cache_with_transfers(engine: Engine) -> None:
    """Greedy histories equal cache-off ones, and eviction, write-back and load-back all
    happened."""
    assert run_chats(engine) == reference_histories()
    stats = engine.stats()
    assert stats.evicted_device_tokens > 0
    assert stats.write_back_ops > 0 and stats.load_back_ops > 0 and stats.host_hit_tokens > 0
    assert stats.write_back_s > 0 and stats.load_back_s > 0  # the copies, timed by their marks
    assert_idle_and_consistent(engine)


def test_the_config_s_transfer_tuning_reaches_the_transfers() -> None:
    """EngineConfig.transfer_tuning is what the host tier's copies queue by: with every piece
    one byte (each write-back gathered and copied a page at a time, each load queued a layer
    at a time), the histories still equal cache-off ones."""
    tuning = TransferTuning(write_piece_bytes=1, gather_head_bytes=1, load_head_bytes=1)
    engine = make_engine(transfer_tuning=tuning)
    assert engine.cache.transfers is not None and engine.cache.transfers.tuning == tuning
    assert_matches_no_cache_with_transfers(engine)


def deferred_copies(monkeypatch: pytest.MonkeyPatch) -> DeferredCopier:
    """Engines built from now on copy between the tiers as late as they may (tests/cache)."""
    copier = DeferredCopier()
    monkeypatch.setattr(cache_tiers_module, "make_copier",
                        lambda platform, ordinals=(0,): (copier, []))
    return copier


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_hierarchical_matches_no_cache(page_size: int, policy: str) -> None:
    assert_matches_no_cache_with_transfers(make_engine(page_size=page_size, write_policy=policy))


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_copies_that_land_late_are_waited_for(page_size: int, policy: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies run only when waited for: a forward that read a loaded page before its layer
    landed, or a load that overtook a write-back, would change the tokens."""
    copier = deferred_copies(monkeypatch)
    engine = make_engine(page_size=page_size, write_policy=policy)
    assert_matches_no_cache_with_transfers(engine)
    assert engine.stats().host_hit_tokens > 0 and copier.copies > 0


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_device_cache_matches_no_cache(page_size: int) -> None:
    engine = make_engine(page_size=page_size, cache_mode="device")
    assert run_chats(engine) == reference_histories()
    stats = engine.stats()
    assert stats.device_hit_tokens > 0 and stats.evicted_device_tokens > 0
    assert stats.host_hit_tokens == 0 and stats.write_back_ops == 0
    assert_idle_and_consistent(engine)


def test_batching_does_not_change_greedy_tokens() -> None:
    one_at_a_time = make_engine(max_running_requests=1, chunked_prefill_tokens=32)
    assert run_chats(one_at_a_time) == reference_histories()


def test_decode_pressure_retracts_and_requeues() -> None:
    engine = make_engine(device_kv_tokens=96, page_size=16, cache_mode="hierarchical")
    prompts = [[(7 * i + j) % 500 for j in range(40)] for i in range(3)]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=30))
    alone = [make_engine(device_kv_tokens=96).generate([p], SamplingParams(max_new_tokens=30))[0]
             for p in prompts]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert engine.stats().retracted_requests > 0
    assert_idle_and_consistent(engine)


BAD_PROMPTS = {
    "empty": ([], SamplingParams()),
    "negative id": ([1, -2, 3], SamplingParams()),
    "id past vocab": ([1, 512], SamplingParams()),
    "max_new_tokens": ([1, 2], None),
    "longer than context": ([1] * 4096, SamplingParams(max_new_tokens=1)),
    "longer than the pool": ([1] * 400, SamplingParams(max_new_tokens=1)),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_input_raises_and_engine_keeps_serving(case: str) -> None:
    engine = make_engine()
    before = engine.generate([[5, 6, 7, 8] * 10], SamplingParams(max_new_tokens=3))[0].token_ids
    prompt, params = BAD_PROMPTS[case]
    with pytest.raises(ValueError):
        engine.generate([[9, 9, 9], prompt], params if params else SamplingParams(max_new_tokens=0))
    again = engine.generate([[5, 6, 7, 8] * 10], SamplingParams(max_new_tokens=3))[0]
    assert again.token_ids == before and again.device_hit_tokens > 0
    assert_idle_and_consistent(engine)


def test_outputs_report_prompt_and_finish() -> None:
    engine = make_engine()
    out = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=4))[0]
    assert out.prompt_len == 5 and len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.ttft_s > 0
    stop_id = out.token_ids[1]
    stop = engine.generate([[3, 1, 4, 1, 5]],
                           SamplingParams(max_new_tokens=4, stop_token_ids=(stop_id,)))[0]
    assert (stop.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
            and stop.finish_reason == "stop")


@pytest.mark.parametrize("overlap", [True, False])
def test_step_outputs_are_deltas_that_add_up_to_generate_s_results(overlap: bool) -> None:
    """`step()`'s outputs carry each step's new tokens and their log probabilities alone, never
    the tokens so far (not even the final one); added up, they are `generate`'s results."""
    prompts = [[3, 1, 4, 1, 5], list(range(7, 30))]
    params = [SamplingParams(max_new_tokens=5, logprobs=2), SamplingParams(max_new_tokens=3)]
    wholes = make_engine(overlap_schedule=overlap).generate(prompts, params)
    engine = make_engine(overlap_schedule=overlap)
    ids = [engine.add_request(p, q, f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    outputs += engine.drain()
    for rid, whole in zip(ids, wholes):
        deltas = [o for o in outputs if o.request_id == rid]
        assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
        assert all(o.new_token_ids and o.token_ids == [] for o in deltas)
        assert sum((o.new_token_ids for o in deltas), []) == whole.token_ids
        assert whole.new_token_ids == whole.token_ids
        if whole.logprobs is None:
            assert all(o.logprobs is None for o in deltas)
        else:
            assert all(len(o.logprobs or ()) == len(o.new_token_ids) for o in deltas)
            assert sum((o.logprobs or [] for o in deltas), []) == whole.logprobs
    assert any(o.logprobs for o in outputs if o.request_id == ids[0] and not o.finished)


def test_config_rejects_invalid_values() -> None:
    for field, value in [("page_size", 0), ("cache_mode", "disk"), ("write_policy", "sometimes"),
                         ("dtype", "int8"), ("max_running_requests", 0)]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})
    with pytest.raises(ValueError, match="host_kv_tokens"):
        EngineConfig(device_kv_tokens=1024, host_kv_tokens=512)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_gpu_hierarchical_matches_no_cache(policy: str) -> None:
    assert_matches_no_cache_with_transfers(make_engine(write_policy=policy))


@pytest.mark.gpu
def test_gpu_bfloat16_engine_serves_with_all_transfers() -> None:
    engine = make_engine(dtype="bfloat16", page_size=64)
    histories = run_chats(engine)
    assert all(len(h) == SPEC.final_context_tokens for h in histories)
    stats = engine.stats()
    assert stats.write_back_ops > 0 and stats.load_back_ops > 0
    assert_idle_and_consistent(engine)


def test_hierarchical_serves_every_reusable_page_under_pressure() -> None:
    """With a host tier big enough for the working set, each round hits every full page of the
    previous turn's KV (prompt + output but the last token), however small the device pool."""
    spec = MultiTurnSpec(num_clients=4, num_rounds=3, request_length=48, output_length=4,
                         vocab_size=512, seed=3)
    engine = make_engine(device_kv_tokens=368, host_kv_tokens=4096)
    chats, page = MultiTurnChats(spec), engine.config.page_size
    for round_index in range(spec.num_rounds):
        previous = [len(h) for h in chats.histories]
        prompts = chats.prompts()
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=spec.output_length))
        chats.extend([o.token_ids for o in outputs])
        reusable = [max(n - 1, 0) // page * page for n in previous]
        assert [o.device_hit_tokens + o.host_hit_tokens for o in outputs] == reusable, round_index
    stats = engine.stats()
    assert stats.host_hit_tokens > 0 and stats.load_back_over_quota == 0


def test_slow_write_back_copies_do_not_stall_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's pages stay locked until its copy retires behind earlier write-backs; an engine step
    with nothing to run must wait for the copies, not give up (copies that run only when waited
    for stand in for slow ones)."""
    deferred_copies(monkeypatch)
    engine = make_engine(page_size=4, device_kv_tokens=32, host_kv_tokens=128)
    first, other, third = list(range(1, 25)), list(range(100, 124)), list(range(300, 324))
    engine.generate([first], SamplingParams(max_new_tokens=1))
    engine.generate([other], SamplingParams(max_new_tokens=1))  # evicts `first` to host
    outs = engine.generate([first + [7, 7, 7, 7], third],
                           [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=4)])
    assert outs[0].host_hit_tokens == 24
    assert_idle_and_consistent(engine)


def test_load_back_never_strands_its_own_first_chunk() -> None:
    """The quota is computed with the request's device prefix locked, so a load that passes it
    leaves room for the first chunk: the admission that loaded is the one that runs."""
    engine = make_engine(page_size=4, device_kv_tokens=64, host_kv_tokens=256,
                         max_running_requests=4)
    x, y, z = list(range(1, 17)), list(range(20, 36)), list(range(40, 56))
    for prompt in (x + y + [9], x + z + [9], list(range(100, 124))):  # the last pushes y to host
        engine.generate([prompt], SamplingParams(max_new_tokens=1))
    outs = engine.generate([list(range(200, 212)), x + y + list(range(60, 82))],
                           SamplingParams(max_new_tokens=1))
    assert (outs[1].device_hit_tokens, outs[1].host_hit_tokens) == (16, 16)
    assert engine.stats().load_back_ops == 1
    assert_idle_and_consistent(engine)


def test_host_pool_size_checks_agree_between_config_and_engine() -> None:
    engine = make_engine(page_size=16, device_kv_tokens=64, host_kv_tokens=80)
    assert engine.cache.host_pool.layout.num_pages == 5


def test_from_pretrained_and_from_preset_serve(tmp_path) -> None:
    """An engine over a written Hugging Face checkpoint generates what the in-memory model does."""
    from jhicache.models import save_checkpoint

    save_checkpoint(_model(), _model().config, tmp_path / "ckpt", shards=2)
    config = EngineConfig(page_size=16, device_kv_tokens=POOL_TOKENS, dtype="float32")
    prompt, params = [[11, 22, 33, 44, 55, 66]], SamplingParams(max_new_tokens=5)
    loaded = Engine.from_pretrained(str(tmp_path / "ckpt"), config).generate(prompt, params)
    assert loaded[0].token_ids == make_engine().generate(prompt, params)[0].token_ids
    preset = Engine.from_preset("tiny", config, seed=3).generate(prompt, params)[0]
    assert len(preset.token_ids) == 5 and preset.finish_reason == "length"


def test_drain_ends_the_step_in_flight_and_keeps_unfinished_requests() -> None:
    """`drain` returns the outputs of the step in flight (with overlap scheduling, the step's
    token is read one call later) and leaves unfinished requests queued: stepping on gives the
    tokens `generate` gives. Drained with nothing unfinished, the engine is idle."""
    prompt, params = list(range(1, 40)), SamplingParams(max_new_tokens=3)
    want = make_engine().generate([prompt], params)[0].token_ids
    engine = make_engine()
    rid = engine.add_request(prompt, params)
    outputs = engine.step()  # the prefill is dispatched; its token is read by the next call
    assert outputs == [] and engine.config.overlap_schedule
    outputs = engine.drain()
    assert [o.request_id for o in outputs] == [rid] and len(outputs[0].new_token_ids) == 1
    assert engine.drain() == [] and engine.has_unfinished()
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and sum((o.new_token_ids for o in outputs), []) == want
    assert engine.drain() == []
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("cache_mode", ["hierarchical", "device"])
def test_evict_moves_the_cache_to_host_or_drops_it(cache_mode: str) -> None:
    """`evict()` frees every unlocked device page: with a host tier, written back first, so the
    same prompt then hits on host and gives the same tokens; without one, the prefix is gone."""
    prompt, params = list(range(1, 70)), SamplingParams(max_new_tokens=2)
    engine = make_engine(cache_mode=cache_mode)
    first = engine.generate([prompt], params)[0]
    cached = engine.stats().evictable_tokens
    assert cached >= 64 and engine.evict() == cached // engine.config.page_size
    assert engine.stats().evictable_tokens == 0
    again = engine.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids and again.device_hit_tokens == 0
    assert again.host_hit_tokens == (64 if cache_mode == "hierarchical" else 0)
    assert engine.evict(1, wait=False) >= 1
    engine.drain()
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_is_hit_while_the_request_that_computed_it_still_decodes(overlap: bool) -> None:
    """The first request's prompt pages are cached once its prefill step ends: a second request
    with that prompt, added while the first decodes, hits them, and both answer as each would
    alone."""
    prompt = list(range(7, 7 + 40))  # 2 full pages of 16, and 8 tokens
    alone = make_engine(overlap_schedule=overlap).generate(
        [prompt], SamplingParams(max_new_tokens=12))[0].token_ids
    engine = make_engine(overlap_schedule=overlap)
    first = engine.add_request(prompt, SamplingParams(max_new_tokens=12), "first")
    outputs = []
    while not any(o.request_id == first for o in outputs):  # its first token: it decodes now
        outputs += engine.step()
    assert not any(o.finished for o in outputs)
    second = engine.add_request(prompt, SamplingParams(max_new_tokens=12), "second")
    while engine.has_unfinished():
        outputs += engine.step()
    outputs += engine.drain()
    done = {o.request_id: o for o in outputs if o.finished}
    assert done[second].device_hit_tokens == 32
    tokens = {rid: sum((o.new_token_ids for o in outputs if o.request_id == rid), [])
              for rid in (first, second)}
    assert tokens[first] == tokens[second] == alone
    assert engine.stats().device_hit_tokens == 32
    assert_idle_and_consistent(engine)
