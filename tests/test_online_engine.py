"""The online engine: add_request / step / abort, overlap scheduling against the lock-step loop."""

from __future__ import annotations

import pytest

from jhicache import Engine, RequestOutput, SamplingParams
from jhicache.bench.workload import MultiTurnChats, MultiTurnSpec
from jhicache.request import RequestStatus
from tests.test_engine import (
    assert_idle_and_consistent,
    deferred_copies,
    make_engine,
    reference_histories,
)

GREEDY = SamplingParams(max_new_tokens=5)


def settle(engine: Engine) -> list[RequestOutput]:
    """Steps until every request finished, then twice more: the step still in flight ends, and a
    step with nothing to run waits for the copies."""
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.step()
    engine.step()
    return outputs


def tokens_of(outputs: list[RequestOutput], request_id: str) -> list[int]:
    """A request's tokens, from its outputs' deltas."""
    return [t for o in outputs if o.request_id == request_id for t in o.new_token_ids]


def run_chats_sampled(engine: Engine, spec: MultiTurnSpec) -> list[list[int]]:
    """Multi-turn chats where each client samples with its own seed (and a stop token)."""
    chats = MultiTurnChats(spec)
    for r in range(spec.num_rounds):
        params = [SamplingParams(max_new_tokens=spec.output_length + 3, temperature=1.0, top_k=50,
                                 top_p=0.9, seed=1000 * r + c, stop_token_ids=[7, 11, 13])
                  for c in range(spec.num_clients)]
        outputs = engine.generate(chats.prompts(), params)
        chats.extend([o.token_ids for o in outputs])
    return chats.histories


# ---- overlap on and off ------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode,policy", [("off", "write_back"), ("device", "write_back"),
                                         ("hierarchical", "write_back"),
                                         ("hierarchical", "write_through_selective")])
def test_lock_step_loop_matches_the_overlapped_reference(mode: str, policy: str,
                                                         page_size: int) -> None:
    """reference_histories() run with overlap on (the default); the lock-step loop agrees."""
    from tests.test_engine import run_chats

    engine = make_engine(cache_mode=mode, write_policy=policy, page_size=page_size,
                         overlap_schedule=False)
    assert run_chats(engine) == reference_histories()
    if mode == "hierarchical":
        stats = engine.stats()
        assert stats.write_back_ops > 0 and stats.load_back_ops > 0
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("mode", ["off", "device", "hierarchical"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_seeded_sampling_with_stops_is_identical_with_overlap_on_and_off(mode: str,
                                                                         page_size: int) -> None:
    spec = MultiTurnSpec(num_clients=3, num_rounds=3, request_length=60, output_length=6,
                         vocab_size=512, seed=5)
    runs = [run_chats_sampled(make_engine(cache_mode=mode, page_size=page_size,
                                          overlap_schedule=overlap), spec)
            for overlap in (False, True)]
    assert runs[0] == runs[1]


def test_stop_token_ends_output_under_overlap_and_frees_what_was_computed_beyond() -> None:
    reference = make_engine(overlap_schedule=False).generate([[3, 1, 4, 1, 5]],
                                                             SamplingParams(max_new_tokens=8))[0]
    stop = reference.token_ids[2]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[stop])
    for overlap in (False, True):
        engine = make_engine(overlap_schedule=overlap)
        out = engine.generate([[3, 1, 4, 1, 5], list(range(40, 90))], params)[0]
        assert out.token_ids == reference.token_ids[: reference.token_ids.index(stop) + 1]
        assert out.finish_reason == "stop"
        assert_idle_and_consistent(engine)


# ---- add_request / step ------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_step_streams_what_generate_returns(overlap: bool) -> None:
    prompts = [[(3 * i + j) % 500 for j in range(20 + 7 * i)] for i in range(4)]
    params = [SamplingParams(max_new_tokens=3 + i) for i in range(4)]
    expected = make_engine().generate(prompts, params)
    engine = make_engine(overlap_schedule=overlap)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert len(set(ids)) == 4 and engine.has_unfinished()
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    finals: dict[str, RequestOutput] = {}
    for out in settle(engine):
        streamed[out.request_id] += out.new_token_ids
        assert out.token_ids == []  # deltas: the tokens so far are the caller's to keep
        assert out.finished == (out.finish_reason is not None)
        if out.finished:
            finals[out.request_id] = out
    assert [streamed[i] for i in ids] == [e.token_ids for e in expected]
    assert set(finals) == set(ids)
    assert all(finals[i].finish_reason == "length" and finals[i].ttft_s > 0 for i in ids)
    assert_idle_and_consistent(engine)


def test_request_ids_are_the_callers_and_unique() -> None:
    engine = make_engine()
    assert engine.add_request([1, 2, 3], GREEDY, request_id="chat-1") == "chat-1"
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request([4, 5, 6], GREEDY, request_id="chat-1")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([4, 5, 6], GREEDY, request_id=7)
    outs = settle(engine)
    assert {o.request_id for o in outs} == {"chat-1"}
    # finished: free again
    assert engine.add_request([4, 5, 6], GREEDY, request_id="chat-1") == "chat-1"
    settle(engine)


@pytest.mark.parametrize("prompt,params,message", [
    ([1, 2, 3], SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
    ([], GREEDY, "empty"),
    ([[1, 2, 3]], GREEDY, "flat list of integer token ids"),
    ("abc", GREEDY, "string"),
    ([1, 512], GREEDY, "out of range"),
    ([1] * 400, GREEDY, "device pool"),
    ([1, 2], {"max_new_tokens": 2}, "SamplingParams"),
])
def test_add_request_refuses_what_generate_refuses(prompt, params, message: str) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    with pytest.raises(ValueError, match=message):
        engine.generate([prompt], params)
    assert not engine.has_unfinished()
    assert (engine.generate([[1, 2, 3]], GREEDY)[0].token_ids
            == make_engine().generate([[1, 2, 3]], GREEDY)[0].token_ids)


# ---- abort -------------------------------------------------------------------------------

def _step_until(engine: Engine, request_id: str, condition) -> None:
    req = engine._requests[request_id]
    for _ in range(200):
        if condition(req):
            return
        engine.step()
    raise AssertionError("condition never held")


def _host_hit_engine(overlap: bool, **overrides: object) -> tuple[Engine, list[int]]:
    """An engine whose 64-token prefix lives only on host."""
    engine = make_engine(page_size=16, device_kv_tokens=128, host_kv_tokens=1024,
                         overlap_schedule=overlap, **overrides)
    prefix = list(range(100, 164))
    engine.generate([prefix], SamplingParams(max_new_tokens=1))
    # pushes the prefix out
    engine.generate([list(range(200, 290))], SamplingParams(max_new_tokens=1))
    assert engine.stats().evicted_device_tokens >= 48
    return engine, prefix


STAGES = ["waiting", "loading", "prefilling", "decoding"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", STAGES)
def test_abort_at_every_stage_leaks_nothing_and_the_engine_serves_on(stage: str,
                                                                     overlap: bool) -> None:
    if stage == "loading":
        engine, prefix = _host_hit_engine(overlap)
        rid = engine.add_request(prefix + [1, 2, 3], SamplingParams(max_new_tokens=20))
        engine.step()  # admitted: its load-back launched with this step
        assert engine.stats().load_back_ops >= 1
    else:
        engine = make_engine(chunked_prefill_tokens=32, overlap_schedule=overlap)
        rid = engine.add_request(list(range(10, 110)), SamplingParams(max_new_tokens=20))
        if stage == "prefilling":
            _step_until(engine, rid,
                        lambda r: r.status is RequestStatus.PREFILLING and r.cached_len > 0)
        elif stage == "decoding":
            _step_until(engine, rid, lambda r: len(r.output) >= 2)
    other = engine.add_request([7, 8, 9, 10], GREEDY)
    engine.check_invariants()
    assert engine.abort(rid) is True
    engine.check_invariants()
    assert engine.abort(rid) is False  # already gone
    settled = settle(engine)
    outs = {o.request_id: o for o in settled if o.finished}
    assert outs[rid].finish_reason == "abort" and outs[other].finish_reason == "length" and (
        tokens_of(settled, other) == make_engine().generate([[7, 8, 9, 10]], GREEDY)[0].token_ids)
    assert_idle_and_consistent(engine)
    after = engine.generate([list(range(10, 60))], GREEDY)[0]
    assert after.token_ids == make_engine().generate([list(range(10, 60))], GREEDY)[0].token_ids
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_its_copies_are_still_in_flight(overlap: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's copies run only when waited for: aborting its request leaves them in flight,
    and they finish safely (its pages stay locked until they do)."""
    deferred_copies(monkeypatch)
    _abort_mid_load(overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_abort_mid_load(overlap: bool) -> None:
    _abort_mid_load(overlap)


def _abort_mid_load(overlap: bool) -> None:
    engine, prefix = _host_hit_engine(overlap)
    rid = engine.add_request(prefix + [1, 2, 3], SamplingParams(max_new_tokens=20))
    with engine.cache.step():
        engine.scheduler.schedule(may_retract=True)  # admitted: its load queued ...
    # ... and launched on leaving the step, no forward yet
    assert engine.stats().load_back_ops >= 1 and engine.stats().loads_in_flight >= 1
    assert engine.abort(rid) is True
    engine.check_invariants()
    settle(engine)
    assert_idle_and_consistent(engine)
    again = engine.generate([prefix + [1, 2, 3]], GREEDY)[0]
    assert again.token_ids == make_engine().generate([prefix + [1, 2, 3]], GREEDY)[0].token_ids
    assert_idle_and_consistent(engine)


def test_abort_of_unknown_or_finished_ids_says_so() -> None:
    engine = make_engine()
    assert engine.abort("nope") is False
    rid = engine.add_request([1, 2, 3], GREEDY)
    settle(engine)
    assert engine.abort(rid) is False


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_request_ends_with_a_final_abort_output_in_the_next_step(
        overlap: bool) -> None:
    """As AsyncEngine's streams end: the next step gives the aborted request's final output,
    with nothing new in it (its tokens were in the outputs before), once; nothing of it
    follows."""
    engine = make_engine(overlap_schedule=overlap)
    rid = engine.add_request(list(range(10, 40)), SamplingParams(max_new_tokens=30))
    other = engine.add_request(list(range(50, 70)), GREEDY)
    seen: list[int] = []
    while len(seen) < 3:
        seen += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert engine.abort(rid) is True
    first = engine.step()
    [final] = [o for o in first if o.request_id == rid]
    assert (final.finished, final.finish_reason, final.new_token_ids) == (True, "abort", [])
    assert final.token_ids == [] and final.logprobs is None and len(seen) >= 3
    assert all(o.request_id == other for o in settle(engine))
    waiting = engine.add_request([1, 2, 3], GREEDY)  # aborted before any step: no tokens
    assert engine.abort(waiting) is True
    [ended] = engine.drain()
    assert (ended.request_id, ended.token_ids, ended.finish_reason) == (waiting, [], "abort")
    assert_idle_and_consistent(engine)


def test_aborted_decode_keeps_its_computed_pages_in_the_cache() -> None:
    engine = make_engine()
    prompt = list(range(10, 60))  # 50 tokens: three full pages of 16
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=30))
    _step_until(engine, rid, lambda r: len(r.output) >= 3)
    engine.abort(rid)
    settle(engine)
    again = engine.generate([prompt + [1]], GREEDY)[0]
    assert again.device_hit_tokens == 48
    assert_idle_and_consistent(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_feeds_decode_tokens_from_the_device(overlap: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap on, decode steps are planned before the previous step's tokens are read:
    their input tokens come from its sampled array on the device."""
    import jhicache.executor as executor_module

    calls = []
    patch = executor_module.patch_tokens
    monkeypatch.setattr(executor_module, "patch_tokens", lambda *a: calls.append(1) or patch(*a))
    engine = make_engine(overlap_schedule=overlap)
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=6))
    assert (len(calls) > 0) == overlap


@pytest.mark.parametrize("overlap", [False, True])
def test_loads_of_waiting_requests_start_a_step_ahead(overlap: bool) -> None:
    """A host-hit request that must wait (the running limit is reached) has its load started
    while it waits; admitted a step later, its prefix is on device: no layer-split step, and its
    loaded tokens still count as host hits."""
    # One running slot: the second request waits while the first decodes.
    engine, prefix = _host_hit_engine(overlap, max_running_requests=1)
    first = engine.add_request([7, 8, 9], SamplingParams(max_new_tokens=4))
    engine.step()
    before = engine.stats()
    second = engine.add_request(prefix + [1, 2, 3], GREEDY)
    settled = settle(engine)
    outs = {o.request_id: o for o in settled if o.finished}
    after = engine.stats()
    assert outs[second].host_hit_tokens == 64 and outs[second].device_hit_tokens == 0
    assert after.load_back_ops - before.load_back_ops == 1
    # the prefetched load had landed: its forward did not have to wait on the device
    assert after.load_gated_steps == before.load_gated_steps
    expected = make_engine().generate([prefix + [1, 2, 3]], GREEDY)[0].token_ids
    assert tokens_of(settled, second) == expected and outs[first].finished
    assert_idle_and_consistent(engine)
