"""Bad input refused at the boundary; failed, interrupted and concurrent calls leave the engine
serving with its cache intact; seeds."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from jhicache import Engine, EngineConfig, SamplingParams
from tests.test_engine import assert_idle_and_consistent, make_engine

PREFIX = [5, 6, 7, 8] * 10  # 40 tokens: two full pages of 16 stay cached after a call
GREEDY = SamplingParams(max_new_tokens=3)


def _fresh_output(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return make_engine().generate([prompt], params)[0].token_ids


def assert_serves_with_cache_intact(engine: Engine) -> None:
    """The engine answers like a fresh one and still hits the prefix it cached before."""
    assert_idle_and_consistent(engine)
    prompt = PREFIX + [9, 10]
    out = engine.generate([prompt], GREEDY)[0]
    assert out.token_ids == _fresh_output(prompt)
    assert out.device_hit_tokens + out.host_hit_tokens == 32
    assert_idle_and_consistent(engine)


def warm_engine() -> Engine:
    engine = make_engine()
    engine.generate([PREFIX], GREEDY)
    return engine


# ---- SamplingParams ----------------------------------------------------------------------

BAD_PARAMS = [
    ("stop_token_ids", dict(stop_token_ids="151645")),
    ("stop_token_ids", dict(stop_token_ids=[1.9])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=7)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="1.0")),
    ("temperature", dict(temperature=-0.5)),
    ("top_k", dict(top_k=2.7)),
    ("top_k", dict(top_k=0)),
    ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p=1.5)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("max_new_tokens", dict(max_new_tokens=3.0)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("seed", dict(temperature=1.0, seed=1.5)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed="3")),
]


@pytest.mark.parametrize("field,kwargs", BAD_PARAMS, ids=[str(k) for _, k in BAD_PARAMS])
def test_sampling_params_refuse_bad_values_by_name(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_values_as_python_ones() -> None:
    p = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4),
                       seed=np.uint64(2**62), stop_token_ids=np.array([7, 8]))
    assert (p.max_new_tokens, p.top_k, p.seed, p.stop_token_ids) == (3, 4, 2**62, (7, 8))
    assert all(type(v) is int for v in (p.max_new_tokens, p.top_k, p.seed, *p.stop_token_ids))
    assert make_engine().generate([[1, 2, 3]],
                                  SamplingParams(max_new_tokens=np.int64(3)))[0].token_ids


def test_stop_token_beyond_the_vocabulary_is_refused() -> None:
    engine = warm_engine()
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[1, 2, 3]], SamplingParams(stop_token_ids=[512]))
    assert_serves_with_cache_intact(engine)


# ---- generate() arguments ----------------------------------------------------------------

BAD_PROMPTS = {
    "flat list": ([1, 2, 3], "for one prompt, pass \\[prompt\\]"),
    "flat numpy list": ([np.int64(1), np.int64(2)], "for one prompt"),
    "1-D array": (np.array([1, 2, 3]), "for one prompt"),
    "None": (None, "NoneType"),
    "a string": ("hello", "list of token-id lists"),
    "a string prompt": (["hello"], "tokenize first"),
    "float ids": ([[1.0, 2.0]], "integer token ids"),
    "bool ids": ([[True, False]], "integer token ids"),
    "a float after ints": ([[1, 2, 3.5]], "integer token ids"),
    "an id past int64": ([[1, 2**70]], "integer token ids"),
    "numpy float ids": ([[np.float64(1.0)]], "integer token ids"),
    "ragged nesting": ([[1, [2, 3]]], "integer token ids"),
    "nested prompt": ([[[1, 2]]], "integer token ids"),
    "an int": (5, "int"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_generate_refuses_what_is_not_a_list_of_prompts(case: str) -> None:
    engine = warm_engine()
    prompts, message = BAD_PROMPTS[case]
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, GREEDY)
    assert_serves_with_cache_intact(engine)


def test_add_requests_queues_every_prompt_or_none() -> None:
    """All or none: a bad prompt among good ones is named and nothing is queued; good ones are
    queued under the ids given and step to the same tokens as `generate`."""
    engine = warm_engine()
    with pytest.raises(ValueError, match="prompt 1: token id out of range"):
        engine.add_requests([[1, 2, 3], [1, 10**9]], GREEDY)
    with pytest.raises(ValueError, match="request ids repeat"):
        engine.add_requests([[1, 2], [3, 4]], GREEDY, request_ids=["x", "x"])
    with pytest.raises(ValueError, match="2 request ids for 1 prompts"):
        engine.add_requests([[1, 2]], GREEDY, request_ids=["x", "y"])
    assert not engine.has_unfinished() and engine.occupancy().waiting_requests == 0
    ids = engine.add_requests([[1, 2, 3], (4, 5, 6)], GREEDY, request_ids=["a", "b"])
    assert ids == ["a", "b"]
    with pytest.raises(ValueError, match="already queued"):
        engine.add_requests([[7]], GREEDY, request_ids=["a"])
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": _fresh_output([1, 2, 3]), "b": _fresh_output([4, 5, 6])}
    assert_serves_with_cache_intact(engine)


def test_generate_takes_numpy_prompts_and_an_empty_list() -> None:
    engine = make_engine()
    assert engine.generate([], GREEDY) == []
    rows = engine.generate(np.array([[1, 2, 3], [4, 5, 6]], np.int32), GREEDY)
    assert [r.token_ids for r in rows] == [_fresh_output([1, 2, 3]), _fresh_output([4, 5, 6])]
    # a tuple, numpy ints in a list, and a 1-D array: the same prompt as the list of ints
    forms = [(4, 5, 6), [np.int64(4), np.int32(5), np.uint8(6)], np.array([4, 5, 6], np.uint16)]
    rows = engine.generate(forms, GREEDY)
    assert [r.token_ids for r in rows] == [_fresh_output([4, 5, 6])] * 3


def test_generate_refuses_params_that_are_not_sampling_params() -> None:
    engine = warm_engine()
    for params in ({"max_new_tokens": 3}, [GREEDY, {"max_new_tokens": 3}], "greedy"):
        with pytest.raises(ValueError, match="SamplingParams"):
            engine.generate([[1, 2], [3, 4]], params)
    assert_serves_with_cache_intact(engine)


# ---- failed and interrupted calls --------------------------------------------------------

class _FailOnce:
    """Stands in for a step function: raises `error` on call number `at`, then delegates."""

    def __init__(self, inner, at: int, error: BaseException) -> None:
        self.inner, self.calls, self.at, self.error = inner, 0, at, error

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("error", [RuntimeError("forward failed"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
@pytest.mark.parametrize("where", ["runner", "scheduler", "commit"])
@pytest.mark.parametrize("mode", ["device", "hierarchical"])
def test_a_failed_call_drops_its_requests_and_keeps_the_cache(where: str, error: BaseException,
                                                             mode: str) -> None:
    engine = make_engine(cache_mode=mode)
    engine.generate([PREFIX], GREEDY)
    owner = {"runner": engine.runner, "scheduler": engine.scheduler,
             "commit": engine.scheduler}[where]
    name = {"runner": "start", "scheduler": "schedule", "commit": "commit"}[where]
    setattr(owner, name, _FailOnce(getattr(owner, name), at=3, error=error))
    prompts = [PREFIX + [11, 12, 13], list(range(100, 150)), list(range(200, 230))]
    with pytest.raises(type(error)):
        engine.generate(prompts, SamplingParams(max_new_tokens=40))
    assert not engine.scheduler.has_work()
    before = engine.stats()
    assert_serves_with_cache_intact(engine)
    # Only the new call's tokens were computed: nothing of the failed call was left to finish.
    after = engine.stats()
    assert after.decode_tokens - before.decode_tokens == GREEDY.max_new_tokens - 1


def test_threads_share_one_engine_one_call_at_a_time() -> None:
    engine = make_engine()
    prompts = [[[(7 * t + j) % 500 for j in range(30 + t)]] for t in range(4)]
    expected = [_fresh_output(p[0], SamplingParams(max_new_tokens=8)) for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            for _ in range(3):
                results[t] = engine.generate(prompts[t],
                                             SamplingParams(max_new_tokens=8))[0].token_ids
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert [results[t] for t in range(4)] == expected
    assert_idle_and_consistent(engine)


# ---- EngineConfig ------------------------------------------------------------------------

BAD_CONFIGS = [
    ("device_memory_fraction", dict(device_memory_fraction="0.5")),
    ("device_memory_fraction", dict(device_memory_fraction=math.nan)),
    ("device_memory_fraction", dict(device_memory_fraction=0.99)),
    ("check_invariants_every_step", dict(check_invariants_every_step="no")),
    ("check_invariants_every_step", dict(check_invariants_every_step=1)),
    ("host_to_device_ratio", dict(host_to_device_ratio=1)),
    ("host_to_device_ratio", dict(host_to_device_ratio=0.5)),
    ("host_to_device_ratio", dict(host_to_device_ratio="4")),
    ("device_kv_tokens", dict(page_size=16, device_kv_tokens=410)),
    ("host_kv_tokens", dict(page_size=16, device_kv_tokens=400, host_kv_tokens=1000)),
    ("page_size", dict(page_size=16.0)),
    ("page_size", dict(page_size=True)),
    ("max_running_requests", dict(max_running_requests="8")),
    ("load_back_threshold", dict(load_back_threshold=-1)),
    ("chunked_prefill_tokens", dict(chunked_prefill_tokens=2.5)),
    ("cache_mode", dict(cache_mode=["device"])),
    ("storage_dir", dict(storage_dir="")),
    ("storage_dir", dict(storage_dir="/tmp/x", cache_mode="device")),
    ("storage_capacity_bytes", dict(storage_capacity_bytes=0)),
    ("storage_write_policy", dict(storage_write_policy="sometimes")),
    ("storage_model_name", dict(storage_model_name=7)),
    ("fetch_policy", dict(fetch_policy="eventually")),
    ("fetch_threshold", dict(fetch_threshold=-1)),
    ("fetch_timeout_s", dict(fetch_timeout_s=-1.0)),
    ("fetch_timeout_per_ki_token_s", dict(fetch_timeout_per_ki_token_s=math.inf)),
    ("storage_io_threads", dict(storage_io_threads=0)),
    ("storage_backend", dict(storage_backend="s3")),
    ("storage_backend_config", dict(storage_backend="mooncake", storage_backend_config="{")),
    ("storage_backend_config", dict(storage_backend="mooncake", storage_backend_config="[]")),
    ("storage_backend_config", dict(storage_backend="mooncake",
                                    storage_backend_config='{"master": "h:1"}')),
    ("storage_backend_config", dict(storage_dir="/tmp/x", storage_backend_config='{"a": 1}')),
    ("storage_dir", dict(storage_backend="mooncake", storage_dir="/tmp/x")),
    ("storage_capacity_bytes", dict(storage_backend="mooncake", storage_capacity_bytes=1 << 30)),
    ("transfer_tuning", dict(transfer_tuning={"load_head_bytes": 1})),
]


@pytest.mark.parametrize("field,kwargs", BAD_CONFIGS, ids=[str(k) for _, k in BAD_CONFIGS])
def test_engine_config_refuses_bad_values_by_name(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**kwargs)


def test_engine_config_page_rounding_is_refused_with_the_nearest_sizes() -> None:
    with pytest.raises(ValueError, match="use 400 or 416"):
        EngineConfig(page_size=16, device_kv_tokens=410)


def test_engine_config_takes_numpy_ints_and_a_fractional_ratio() -> None:
    config = EngineConfig(page_size=np.int64(16), device_kv_tokens=np.int32(64),
                          host_to_device_ratio=1.5)
    assert type(config.page_size) is int and type(config.device_kv_tokens) is int
    assert config.host_tokens_for(64) == 96


def test_device_mode_does_not_check_a_host_pool_it_never_builds() -> None:
    EngineConfig(cache_mode="device", device_kv_tokens=1024, host_kv_tokens=512)
    with pytest.raises(ValueError, match="host_kv_tokens"):
        EngineConfig(cache_mode="hierarchical", device_kv_tokens=1024, host_kv_tokens=512)


# ---- seeds -------------------------------------------------------------------------------

SAMPLED = dict(max_new_tokens=12, temperature=1.5)


def test_unseeded_requests_draw_fresh_seeds() -> None:
    engine = make_engine()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outs = [engine.generate([prompt], SamplingParams(**SAMPLED))[0].token_ids for _ in range(3)]
    assert len({tuple(o) for o in outs}) == 3  # 12 tokens at temperature 1.5: no repeats by chance
    batched = engine.generate([prompt] * 3, SamplingParams(**SAMPLED))
    assert len({tuple(o.token_ids) for o in batched}) == 3


@pytest.mark.parametrize("mode", ["off", "device", "hierarchical"])
def test_a_seeded_request_samples_the_same_at_any_row_and_in_any_cache_mode(mode: str) -> None:
    prompt, other = PREFIX + [1, 2], list(range(60, 90))
    seeded = SamplingParams(seed=2**40 + 5, **SAMPLED)
    alone = make_engine(cache_mode="off").generate([prompt], seeded)[0].token_ids
    engine = make_engine(cache_mode=mode)
    engine.generate([PREFIX], GREEDY)  # cached prefix for the modes that keep one
    rows = engine.generate([other, other, prompt], [GREEDY, SamplingParams(**SAMPLED), seeded])
    assert rows[2].token_ids == alone


def test_seeds_differ_beyond_32_bits() -> None:
    engine = make_engine()
    prompt = [3, 1, 4, 1, 5]
    low, high = (engine.generate([prompt], SamplingParams(seed=s, **SAMPLED))[0].token_ids
                 for s in (7, 7 + 2**32))
    assert low != high
