"""Tensor-parallel checks that need several JAX devices, run by tests/test_tensor_parallel.py in
a subprocess whose XLA_FLAGS ask for 4 CPU devices (set before JAX starts, so not in pytest).

Usage: python -m tests.tensor_parallel_checks CHECK (one of CHECKS); exits non-zero on failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jhicache.models import (
    AttentionMetadata,
    ModelPrograms,
    Qwen2Config,
    Qwen2ForCausalLM,
    build_metadata,
    functional,
    init_random,
    load_pretrained,
    pack_tokens,
    preset_config,
    save_checkpoint,
)
from jhicache.models.sharding import TensorParallel, param_names

from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.bench.workload import MultiTurnChats, MultiTurnSpec

DEVICES = 4
# 3 clients x 2 rounds of 40-token turns: 3 x 86 tokens at the end, over a 160-token pool
SPEC = MultiTurnSpec(num_clients=3, num_rounds=2, request_length=40, output_length=3,
                     vocab_size=512, seed=7)
POOL_TOKENS = 160
HOST_TOKENS = 640


@functools.cache
def tp_model() -> Qwen2ForCausalLM:
    """8 query heads, 4 KV heads: split 2 and 4 ways without replication."""
    return init_random(preset_config("tiny-tp"), seed=1)


@functools.cache
def replicated_model() -> Qwen2ForCausalLM:
    """2 KV heads: at tp 4 each KV head is stored on two devices. Untied, so greedy decoding
    does not just echo the prompt."""
    return init_random(dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False),
                       seed=2)


def engine(model: Qwen2ForCausalLM, tp: int, cache_mode: str = "device",
           **overrides: object) -> Engine:
    host = (dict(host_kv_tokens=HOST_TOKENS, load_back_threshold=1)
            if cache_mode == "hierarchical" else {})
    return Engine(model, EngineConfig(**{**dict(page_size=16, device_kv_tokens=POOL_TOKENS,
                                                dtype="float32", cache_mode=cache_mode,
                                                check_invariants_every_step=True,
                                                max_running_requests=8, tensor_parallel_size=tp),
                                         **host, **overrides}))


def hierarchical(model: Qwen2ForCausalLM, tp: int, policy: str = "write_back") -> Engine:
    return engine(model, tp, "hierarchical", write_policy=policy)


@functools.cache
def reference(model: Qwen2ForCausalLM, spec: MultiTurnSpec = SPEC) -> list[list[int]]:
    """Greedy histories on one device with no cache: what every other run must reproduce."""
    return run_chats(engine(model, 1, "off"), spec)


def run_chats(eng: Engine, spec: MultiTurnSpec = SPEC) -> list[list[int]]:
    chats = MultiTurnChats(spec)
    for _ in range(spec.num_rounds):
        outputs = eng.generate(chats.prompts(), SamplingParams(max_new_tokens=spec.output_length))
        chats.extend([o.token_ids for o in outputs])
    return chats.histories


def assert_pool_sharded(eng: Engine, tp: int) -> None:
    """Every layer's K and V split on the head axis: one shard per device, each with its heads."""
    pool, config = eng.device_pool, eng.model_config
    local_heads = max(config.num_key_value_heads, tp) // tp
    for array in (*pool.k, *pool.v):
        shards = array.addressable_shards
        assert len({s.device for s in shards}) == tp, array.sharding
        assert all(s.data.shape == (pool.layout.num_pages, 16, local_heads, config.head_dim)
                   for s in shards)
        assert array.sharding.spec[2] == "tp", array.sharding


# ---- checks --------------------------------------------------------------------------------

def check_engine_tokens() -> None:
    """Greedy histories of tp 2 and 4 equal tp 1's, cache off and on device with eviction (tp
    1 with a cache is every other engine test)."""
    one = engine(tp_model(), 1, "off")
    assert one.tp is None  # one device: no mesh, no shard_map
    reference = run_chats(one)
    for tp, mode in ((2, "off"), (2, "device"), (4, "off"), (4, "device")):
        eng = engine(tp_model(), tp, mode)
        assert run_chats(eng) == reference, (tp, mode)
        eng.check_invariants()
        stats = eng.stats()
        if mode == "device":
            assert stats.evicted_device_tokens > 0 and stats.device_hit_tokens > 0, stats
        assert eng.tp is not None and eng.tp.size == tp
        assert_pool_sharded(eng, tp)


def check_logprobs_equal_one_device() -> None:
    """Log probabilities of generated and prompt tokens at tp 2 (the head's vocabulary split,
    its rows gathered) equal one device's, with two prompt alternatives (the top-20 reduction)
    and with one (the one-pass reduction)."""
    prompt = list(range(3, 90))
    engines = [engine(tp_model(), tp) for tp in (1, 2)]
    for alternatives in (2, 1):
        params = SamplingParams(max_new_tokens=4, logprobs=3, prompt_logprobs=alternatives,
                                prompt_logprobs_start=20)
        one, two = (eng.generate([prompt], params)[0] for eng in engines)
        assert one.token_ids == two.token_ids
        assert one.logprobs is not None and two.logprobs is not None
        assert one.prompt_logprobs is not None and two.prompt_logprobs is not None
        for a, b in zip(one.logprobs + one.prompt_logprobs[1:],
                        two.logprobs + two.prompt_logprobs[1:]):
            assert a is not None and b is not None and a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < 1e-4, (a, b)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert len(two.prompt_logprobs) == len(prompt) - 20
        assert all(len(r.top) == alternatives for r in two.prompt_logprobs[1:] if r is not None)


def check_penalties_equal_one_device() -> None:
    """Penalised requests (every penalty, min_tokens, a sampled one with min-p) at tp 2 draw
    one device's tokens: the token history is replicated over the mesh, as the logits are."""
    prompts = [[5, 6, 7, 5, 6, 7, 9] * 4, list(range(3, 40)), [11] * 20]
    params = [SamplingParams(max_new_tokens=12, repetition_penalty=1.4, frequency_penalty=0.5),
              SamplingParams(max_new_tokens=12, presence_penalty=1.0, min_tokens=6,
                             stop_token_ids=(4, 12)),
              SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, min_p=0.1,
                             presence_penalty=0.5, frequency_penalty=0.5)]
    one, two = (engine(tp_model(), tp) for tp in (1, 2))
    outputs = [[o.token_ids for o in eng.generate(prompts, params)] for eng in (one, two)]
    assert outputs[0] == outputs[1], outputs
    plain = one.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [o.token_ids for o in plain][:2] != outputs[0][:2]  # the penalties acted
    table = two.executor.history.table
    assert len(table.sharding.device_set) == 2 and table.sharding.is_fully_replicated
    two.check_invariants()


def assert_host_tier_used(eng: Engine) -> None:
    """Pages left the device, went to host and came back, every copy retired; both tiers split
    into one shard per device (each device's host block a 1/tp share)."""
    stats = eng.stats()
    assert stats.evicted_device_tokens > 0 and stats.write_back_ops > 0, stats
    assert stats.load_back_ops > 0 and stats.host_hit_tokens > 0, stats
    assert stats.loads_in_flight == 0 and stats.protected_tokens == 0, stats
    eng.check_invariants()
    tp = eng.config.tensor_parallel_size
    host = eng.cache.host_pool
    assert host.shards == tp == len(eng.device_pool.shard_devices)
    assert len({b.address for b in host.blocks}) == tp
    assert all(b.nbytes * tp == host.layout.page_bytes * host.layout.num_pages for b in host.blocks)
    if tp > 1:
        assert_pool_sharded(eng, tp)


def _check_hierarchical_tokens(policy: str, sizes: tuple[int, ...],
                               spec: MultiTurnSpec = SPEC) -> None:
    """Greedy histories with the host tier at each tp equal one device's with no cache, with
    eviction, write-back and load-back happening (invariants checked every step)."""
    for tp in sizes:
        eng = hierarchical(tp_model(), tp, policy)
        assert run_chats(eng, spec) == reference(tp_model(), spec), (tp, policy)
        assert_host_tier_used(eng)


def check_hierarchical_write_back() -> None:
    _check_hierarchical_tokens("write_back", (1, 2, 4))


def check_hierarchical_write_through() -> None:
    # tp 2 shares every shard path with tp 4 (write_back runs both)
    _check_hierarchical_tokens("write_through", (4,))


def check_hierarchical_write_through_selective() -> None:
    # a node is written at its second visit: a third round reads back what the second wrote
    _check_hierarchical_tokens("write_through_selective", (4,),
                               dataclasses.replace(SPEC, num_rounds=3))


def check_hierarchical_replicated_kv_heads() -> None:
    """tp 4 over 2 KV heads: each head is on two devices and in their two host blocks, which
    hold the same bytes for every page the tree keeps on host; tokens as on one device."""
    eng = hierarchical(replicated_model(), 4)
    assert run_chats(eng) == reference(replicated_model())
    assert_host_tier_used(eng)
    view = eng.cache.host_pool.view()  # [layers, K|V, pages, S, heads (4 stored), D]
    pages = sorted({p for node in eng.cache.tree.nodes() for p in node.host_pages or ()})
    assert pages
    stored = view[:, :, pages]
    np.testing.assert_array_equal(stored[..., 0::2, :], stored[..., 1::2, :])
    assert np.abs(stored).sum() > 0


@contextlib.contextmanager
def _deferred_copiers(tp: int) -> Iterator[list]:
    """Engines built inside get one DeferredCopier per device (copies run only when waited
    for); yields the list they are in. The checks share a process: the patch ends with it."""
    import jhicache.cache.cache_tiers as cache_tiers_module
    from jhicache.cache.copier import ShardedCopier
    from tests.cache._helpers import DeferredCopier

    copiers = [DeferredCopier() for _ in range(tp)]
    with mock.patch.object(cache_tiers_module, "make_copier",
                           lambda platform, ordinals: (ShardedCopier(copiers), [])):
        yield copiers


def check_deferred_copies_wait_on_every_shard() -> None:
    """Each device's copies run only when its own mark is waited for: the tokens are still one
    device's, so every shard's wait is made. With a forward that lands shard 0's copies only,
    the other shards' pages are read before they land and the tokens change: so it matters."""
    from jhicache.cache.load_back import Load

    with _deferred_copiers(4) as copiers:
        eng = hierarchical(tp_model(), 4)
        assert run_chats(eng) == reference(tp_model())
    assert_host_tier_used(eng)
    assert eng.stats().host_hit_tokens > 0 and all(c.copies > 0 for c in copiers)

    def first_shard_only(load: Load) -> int:  # lands shard 0's copies before the forward
        landed = load.issue()
        load.loads.copier.copiers[0].wait(landed.parts[0])
        return load.seq

    with _deferred_copiers(4), mock.patch.object(Load, "issued_seq", first_shard_only):
        assert run_chats(hierarchical(tp_model(), 4)) != reference(tp_model())


def check_invariant_catches_moved_shard() -> None:
    """A layer whose shards left the buffers the loads copy into is reported."""
    eng = hierarchical(tp_model(), 2)
    run_chats(eng)
    assert eng.stats().load_back_ops > 0
    eng.check_invariants()
    k, v = eng.device_pool.k[1], eng.device_pool.v[1]
    eng.device_pool.set_layer(1, k + 0, v)  # same sharding, new buffers
    assert not eng.device_pool.misplaced_layers()
    _assert_invariant_error(eng, "moved", "moved shard buffers not reported")


def check_invariant_catches_misplaced_pages() -> None:
    """A layer's pages gathered onto one device is reported by check_invariants."""
    eng = engine(tp_model(), 2)
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    eng.check_invariants()
    k, v = eng.device_pool.k[1], eng.device_pool.v[1]
    eng.device_pool.set_layer(1, jax.device_put(k, jax.devices()[0]), v)
    _assert_invariant_error(eng, "layers [1]", "misplaced pages not reported")


def _assert_invariant_error(eng: Engine, fragment: str, missed: str) -> None:
    """`eng.check_invariants()` raises an InvariantError whose message holds `fragment`."""
    from jhicache.cache import InvariantError

    try:
        eng.check_invariants()
    except InvariantError as e:
        assert fragment in str(e), e
    else:
        raise AssertionError(missed)


def check_checkpoint_loads_sharded() -> None:
    """A written checkpoint loads straight into the sharded layout (each weight's shards are
    its devices' blocks) and serves what the in-memory unsharded model does: at tp 2, and at
    tp 4 over 2 KV heads, each stored on two devices."""
    prompts, params = [[5, 6, 7, 8, 9, 10, 11], [40, 41]], SamplingParams(max_new_tokens=4)
    config = dict(page_size=16, device_kv_tokens=POOL_TOKENS, dtype="float32", cache_mode="device")
    with tempfile.TemporaryDirectory() as tmp:
        for model, tp in ((tp_model(), 2), (replicated_model(), 4)):
            ckpt = save_checkpoint(model, model.config,
                                   Path(tmp) / f"{tp}-{model.config.num_key_value_heads}", shards=2)
            layout = TensorParallel.create(tp, model.config)
            loaded = load_pretrained(ckpt, tp=layout)
            _assert_weights_sharded(loaded, model, layout)
            expected = Engine(model, EngineConfig(**config)).generate(prompts, params)
            got = Engine.from_pretrained(str(ckpt), EngineConfig(**config, tensor_parallel_size=tp))
            assert ([o.token_ids for o in got.generate(prompts, params)]
                    == [o.token_ids for o in expected])
            assert_pool_sharded(got, tp)


def _assert_weights_sharded(loaded: Qwen2ForCausalLM, model: Qwen2ForCausalLM,
                            tp: TensorParallel) -> None:
    """Every loaded weight is the model's in the stored layout (`to_storage`), split as its spec
    says, and each device's block of a merged q/k/v projection holds exactly its own heads."""
    stored = jax.tree_util.tree_flatten_with_path(nnx.state(loaded))[0]
    for (path, got), want in zip(stored, jax.tree.leaves(nnx.state(model)), strict=True):
        names = param_names(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(tp.to_storage(names, want)))
        split = [i for i, axis in enumerate(tp.spec(names)) if axis is not None]
        for shard in got.addressable_shards:
            assert all(shard.data.shape[i] == got.shape[i] // tp.size for i in split), names
    for layer in range(model.config.num_hidden_layers):
        _assert_own_heads(loaded.layers[layer].self_attn.qkv_proj.kernel[...],
                          np.asarray(model.layers[layer].self_attn.qkv_proj.kernel[...]), tp)


def _assert_own_heads(stored: jax.Array, whole: np.ndarray, tp: TensorParallel) -> None:
    """Device i's shard of a stored qkv kernel is [its q heads | its k head(s) | its v head(s)]
    cut from the unsharded kernel `whole` ([q | k | v] over the config's heads)."""
    cfg, n = tp.config, tp.size
    d, kv = cfg.head_dim, cfg.num_key_value_heads
    q, k, v = np.split(whole, [cfg.num_attention_heads * d, (cfg.num_attention_heads + kv) * d],
                       axis=-1)
    devices = list(tp.mesh.devices.flat)
    for shard in stored.addressable_shards:
        i = devices.index(shard.device)
        kv_heads = [i // tp.kv_replicas] if n > kv else range(i * kv // n, (i + 1) * kv // n)
        mine = [np.split(q, n, axis=-1)[i]]
        mine += [np.concatenate([x[:, h * d:(h + 1) * d] for h in kv_heads], axis=-1)
                 for x in (k, v)]
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(mine, axis=-1))


def check_sharded_random_init() -> None:
    """A preset's weights drawn sharded are the ones drawn on one device."""
    config = preset_config("tiny-tp")
    tp = TensorParallel.create(4, config)
    sharded, whole = init_random(config, seed=3, tp=tp), init_random(config, seed=3)
    pairs = zip(jax.tree_util.tree_flatten_with_path(nnx.state(sharded))[0],
                jax.tree.leaves(nnx.state(whole)), strict=True)
    for (path, a), b in pairs:
        assert len(a.addressable_shards) == 4
        np.testing.assert_allclose(np.asarray(a),
                                   np.asarray(tp.to_storage(param_names(path), b)),
                                   rtol=0, atol=1e-7)


def check_gated_forward_matches_ungated() -> None:
    """The sharded forward with load flags (replicated: one per device) already set past
    the step's load gives the logits and pages of the ungated program, also split into three
    programs."""
    tp = TensorParallel.create(2, tp_model().config)
    programs = ModelPrograms(tp_model(), tp)
    meta = build_metadata([0, 0], [5, 3], [[1], [2]], page_size=16, num_tokens=8, num_reqs=2,
                          max_pages=2)
    tokens, rows = pack_tokens([[1, 2, 3, 4, 5], [6, 7, 8]], 8), jnp.array([4, 7], jnp.int32)

    def pages() -> tuple[jax.Array, ...]:
        shape = (4, 16, tp.storage_kv_heads, tp_model().config.head_dim)
        return tuple(jax.device_put(jnp.zeros(shape), tp.kv_pages_sharding) for _ in range(2))

    plain, k, _ = programs.forward(pages(), pages(), tokens, meta, rows)
    replicated = jax.sharding.NamedSharding(tp.mesh, jax.sharding.PartitionSpec())
    flags = jax.device_put(jnp.array([3, 3, 0], jnp.int32), replicated)
    gated_meta = dataclasses.replace(meta, load_flags=flags, load_seq=jnp.array([2], jnp.int32))
    gated, gated_k, _ = programs.forward(pages(), pages(), tokens, gated_meta, rows)
    np.testing.assert_allclose(np.asarray(gated), np.asarray(plain), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gated_k[1]), np.asarray(k[1]), rtol=1e-6, atol=1e-6)
    assert gated_k[0].sharding.is_equivalent_to(tp.kv_pages_sharding, 4)
    split = functional.program_layers  # a program between the first and the last, sharded too
    functional.program_layers = lambda n: (1, n - 1, 0)
    try:
        programs = ModelPrograms(tp_model(), tp)
        assert len(programs.program_layers) == 3
        three, three_k, _ = programs.forward(pages(), pages(), tokens, gated_meta, rows)
    finally:
        functional.program_layers = split
    np.testing.assert_allclose(np.asarray(three), np.asarray(plain), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(three_k[1]), np.asarray(k[1]), rtol=1e-6, atol=1e-6)
    assert three_k[1].sharding.is_equivalent_to(tp.kv_pages_sharding, 4)


def check_bad_sizes_rejected() -> None:
    """tp values that do not fit the devices or the model raise ValueError naming the field."""
    model = tp_model()
    bad = {3: "device count", 8: "device count", 0: "int >= 1"}
    for size, reason in bad.items():
        for mode in ("device", "hierarchical"):
            _expect_value_error(lambda s=size, m=mode: engine(model, s, m), reason)
    odd_heads = Qwen2Config(vocab_size=512, hidden_size=96, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3)
    _expect_value_error(lambda: TensorParallel.create(4, odd_heads), "num_attention_heads")
    _expect_value_error(lambda: TensorParallel.create(2, odd_heads), "num_key_value_heads")
    three_kv = dataclasses.replace(odd_heads, num_attention_heads=12, hidden_size=192,
                                   head_dim=None)
    _expect_value_error(lambda: TensorParallel.create(4, three_kv), "num_key_value_heads")


def _expect_value_error(build: Callable[[], object], reason: str) -> None:
    try:
        build()
    except ValueError as e:
        assert "tensor_parallel_size" in str(e) and reason in str(e), e
    else:
        raise AssertionError(f"no ValueError ({reason})")


def check_dry_run_72b() -> None:
    """Qwen2-72B's widths (two of its layers), bf16, compiled for two CPU devices without a
    weight allocated: each device takes half the weights, with one all-reduce per embed lookup
    and two per layer."""
    config = dataclasses.replace(preset_config("qwen2-72b"), num_hidden_layers=2)
    tp = TensorParallel.create(2, config)
    model = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    programs = ModelPrograms(model, tp)
    pages = jax.ShapeDtypeStruct((9, 64, tp.storage_kv_heads, config.head_dim), jnp.bfloat16,
                                 sharding=tp.kv_pages_sharding)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(i32(128), i32(128), i32(2, 4), i32(2), i32(2), i32(2))
    compiled = [lowered.compile() for lowered in
                programs.lower((pages,) * 2, (pages,) * 2, i32(128), meta, i32(2))]
    reduces = sum(c.as_text().count("all-reduce(") for c in compiled)
    assert reduces == 1 + 2 * config.num_hidden_layers
    weight_bytes = sum(x.size * 2 for x in jax.tree.leaves(nnx.state(model)))
    per_device = sum(c.memory_analysis().argument_size_in_bytes for c in compiled)
    assert weight_bytes / 2 <= per_device < weight_bytes / 2 * 1.01, (per_device, weight_bytes)


def check_hf_families() -> None:
    """Qwen3 and Llama 3 checkpoints made with transformers, read straight into the sharded
    layout, give transformers' greedy tokens: Qwen3 at tp 2 with host hits, Llama 3 (scaled
    RoPE) at tp 4, each of its 2 KV heads stored on two devices."""
    from tests.models import hf_references as hf

    for name, tp, mode in (("qwen3", 2, hf.HOST), ("llama3", 4, dict(cache_mode="device"))):
        config = EngineConfig(**{**hf.ENGINE, **mode, "tensor_parallel_size": tp})
        eng = Engine.from_pretrained(str(hf.ROOT / name), config)
        assert eng.tp is not None and eng.tp.size == tp
        assert hf.replay(eng, name) == hf.reference(name)["replies"], name
        if tp == 2:
            assert eng.stats().host_hit_tokens > 0
        eng.close()


CHECKS: dict[str, Callable[[], None]] = {
    name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}

# The checks run in two subprocesses, one after the other (pytest-xdist gives the module to one
# worker), rather than one each: a process's start and its compiled programs are shared by the
# checks in it (in one process the set costs about half the CPU time of one process per check,
# on a cold compilation cache), and `tiers` reads back from the compilation cache the programs
# `model` compiled (the one-device references among them).
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("bad_sizes_rejected", "checkpoint_loads_sharded", "dry_run_72b", "engine_tokens",
              "gated_forward_matches_ungated", "hf_families", "logprobs_equal_one_device",
              "penalties_equal_one_device", "sharded_random_init"),
    "tiers": ("deferred_copies_wait_on_every_shard", "hierarchical_replicated_kv_heads",
              "hierarchical_write_back", "hierarchical_write_through",
              "hierarchical_write_through_selective", "invariant_catches_misplaced_pages",
              "invariant_catches_moved_shard"),
}


def main(argv: list[str]) -> None:
    """Runs each named check (a group's name stands for its checks), every one even after a
    failure; exits non-zero naming the checks that failed."""
    if jax.device_count() < DEVICES:
        raise SystemExit(f"needs {DEVICES} devices "
                         "(XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{DEVICES}), got {jax.device_count()}")
    names = [n for arg in argv for n in GROUPS.get(arg, (arg,))]
    failed = []
    for name in names:
        started = time.perf_counter()
        try:
            CHECKS[name]()
            print(f"check {name}: passed ({time.perf_counter() - started:.1f} s)", flush=True)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if failed:
        raise SystemExit(f"failed checks: {', '.join(failed)}")


if __name__ == "__main__":
    main(sys.argv[1:])
