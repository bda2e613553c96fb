"""Qwen2 model numerics on CPU: against an independent float64 numpy Qwen2, through the paged KV
cache."""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jhicache.models import (
    ModelPrograms,
    build_metadata,
    forward_apply,
    init_kv_pages,
    load_pretrained,
    pack_tokens,
)

from tests.models.numpy_reference import (
    random_hf_weights,
    reference_logits,
    small_hf_config,
    write_hf_checkpoint,
)

PAGE_SIZE = 4
NUM_PAGES = 12


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, dict, dict]:
    cfg = small_hf_config(tied=request.param)
    weights = random_hf_weights(cfg, seed=1 if request.param else 2)
    path = write_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, weights)
    return path, cfg, weights


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_pretrained(checkpoint[0], dtype=jnp.float32)


def assert_close(ours, ref, rel: float = 1e-4) -> None:
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=rel, atol=rel * np.abs(ref).max())


def step(model, kv, reqs, *, num_tokens=12, num_reqs=4, decode_only=False):
    """One jitted forward of requests given as (prefix_len, new_tokens, page_ids), padded to one
    bucket so that the tests share a compiled step."""
    meta = build_metadata(
        [r[0] for r in reqs], [len(r[1]) for r in reqs], [r[2] for r in reqs], page_size=PAGE_SIZE,
        num_tokens=num_tokens, num_reqs=num_reqs, max_pages=4, decode_only=decode_only,
    )
    graphdef, state = nnx.split(model)
    return forward_apply(graphdef, state, pack_tokens([r[1] for r in reqs], meta.num_tokens),
                         kv, meta)


def tokens_of(n: int, seed: int, vocab: int = 97) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_prefill_matches_numpy_reference(model, checkpoint):
    _, cfg, weights = checkpoint
    toks = tokens_of(7, seed=3)
    logits, kv = step(model, init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE), [(0, toks, [5, 2])])
    chex.assert_shape(logits, (12, cfg["vocab_size"]))
    logits = logits[:7]
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape(kv[0][0], (NUM_PAGES, PAGE_SIZE, 2, 16))
    assert_close(logits, reference_logits(weights, cfg, toks))


def test_prefill_then_decode_matches_full_forward(model, checkpoint):
    _, cfg, weights = checkpoint
    toks = tokens_of(7, seed=4)
    kv = init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE)
    _, kv = step(model, kv, [(0, toks[:6], [7, 1])])
    # request row 1 is padding: decode batches are bucketed too
    logits, kv = step(model, kv, [(6, toks[6:], [7, 1])], num_tokens=None, num_reqs=2,
                      decode_only=True)
    chex.assert_shape(logits, (2, cfg["vocab_size"]))
    full, _ = step(model, init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE), [(0, toks, [3, 4])])
    assert_close(logits[0], full[6], rel=1e-5)
    assert_close(logits[0], reference_logits(weights, cfg, toks)[-1])


def test_ragged_extend_batch_matches_per_request_runs(model, checkpoint):
    _, cfg, weights = checkpoint
    seqs = [tokens_of(5, 5), tokens_of(9, 6), tokens_of(3, 7)]
    prefix = [3, 5, 0]
    pages = [[1, 2], [3, 4, 5], [6]]
    kv = init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE)
    _, kv = step(model, kv, [(0, s[:p], pg) for s, p, pg in zip(seqs, prefix, pages) if p])
    reqs = [(p, s[p:], pg) for s, p, pg in zip(seqs, prefix, pages)]
    logits, _ = step(model, kv, reqs)  # padded: 9 real tokens of 3 requests in a bucket of 12 / 4
    start = 0
    for seq, p in zip(seqs, prefix):
        rows = logits[start : start + len(seq) - p]
        alone, _ = step(model, init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE),
                        [(0, seq, [9, 10, 11])])
        assert_close(rows, alone[p : len(seq)], rel=1e-5)
        assert_close(rows, reference_logits(weights, cfg, seq)[p:])
        start += len(seq) - p


def test_eager_jit_and_fused_paths_agree_and_donate(model):
    toks = tokens_of(5, seed=8)
    meta = build_metadata([0], [5], [[0, 1]], page_size=PAGE_SIZE)
    tokens = pack_tokens([toks])
    eager, _ = model.forward(tokens, init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE), meta)
    kv = init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE)
    jitted, _ = forward_apply(*nnx.split(model), tokens, kv, meta)
    assert kv[0][0].is_deleted(), "forward_apply must donate the KV pages"
    programs = ModelPrograms(model)
    rows = jnp.arange(tokens.shape[0])
    kv = init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE)
    fused, _, _ = programs.forward(tuple(k for k, _ in kv), tuple(v for _, v in kv),
                                   tokens, meta, rows)
    assert all(k.is_deleted() for k, _ in kv), "both programs must donate their KV pages"
    assert_close(fused, eager, rel=1e-6)
    assert_close(jitted, eager, rel=1e-6)


@pytest.mark.parametrize("counts", [(1, 1, 1, 1), (2, 1, 1), (1, 3), (4, 0)])
def test_programs_split_any_way_agree(counts, monkeypatch):
    """However the layers are split into programs (middle ones included, a last one of only the
    head), the forward gives the eager model's logits, returns and donates every layer's pages,
    and lowers as one program per part."""
    import dataclasses

    from jhicache.models import Qwen2ForCausalLM, functional, init_random, preset_config

    monkeypatch.setattr(functional, "program_layers", lambda n: counts)
    config = dataclasses.replace(preset_config("tiny"), num_hidden_layers=4)
    model: Qwen2ForCausalLM = init_random(config, seed=3)
    programs = ModelPrograms(model)
    assert programs.program_layers == counts and programs.first_layers == counts[0]
    toks = tokens_of(5, seed=2)
    meta = build_metadata([0], [5], [[0, 1]], page_size=PAGE_SIZE)
    tokens = pack_tokens([toks])
    eager, _ = model.forward(tokens, init_kv_pages(config, NUM_PAGES, PAGE_SIZE), meta)
    kv = init_kv_pages(config, NUM_PAGES, PAGE_SIZE)
    rows = jnp.arange(tokens.shape[0])
    logits, new_k, new_v = programs.forward(tuple(k for k, _ in kv), tuple(v for _, v in kv),
                                            tokens, meta, rows)
    assert all(k.is_deleted() and v.is_deleted() for k, v in kv)
    assert len(new_k) == len(new_v) == 4
    assert_close(logits, eager, rel=1e-6)
    lowered = programs.lower(new_k, new_v, tokens, meta, rows)
    assert len(lowered) == len(counts)


def test_bfloat16_model_tracks_float32(checkpoint):
    path, cfg, weights = checkpoint
    model = load_pretrained(path, dtype=jnp.bfloat16)
    chex.assert_type(model.embed_tokens.embedding[...], jnp.bfloat16)
    toks = tokens_of(6, seed=9)
    logits, kv = step(model, init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE, jnp.bfloat16),
                      [(0, toks, [0, 1])])
    logits = logits[:6]
    chex.assert_type(logits, jnp.float32)
    chex.assert_type(kv[0][0], jnp.bfloat16)
    ref = reference_logits(weights, cfg, toks)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=0.05 * np.abs(ref).max())


def test_bfloat16_few_rows_take_o_proj_through_the_skinny_kernel(checkpoint, monkeypatch):
    """A 16-bit batch of a few rows projects o_proj by `skinny_matmul` (once a layer), and the
    layers' output matches the one through XLA's matmul within bf16 tolerance. Eager layers,
    so each run traces its own calls."""
    from jhicache.models import decoder as decoder_module

    model = load_pretrained(checkpoint[0], dtype=jnp.bfloat16)
    meta = build_metadata([0], [6], [[0, 1]], page_size=PAGE_SIZE, num_tokens=8, num_reqs=1,
                          max_pages=4)
    embedded = model.embed(pack_tokens([tokens_of(6, seed=4)], meta.num_tokens))

    def layers() -> np.ndarray:
        hidden = embedded
        for i, (k, v) in enumerate(init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE,
                                                 jnp.bfloat16)):
            hidden, _, _ = model.layer(i, hidden, k, v, meta)
        return np.asarray(hidden[:6], np.float32)

    calls, real = [], decoder_module.skinny_matmul
    monkeypatch.setattr(decoder_module, "skinny_matmul",
                        lambda x, w: calls.append(x.shape) or real(x, w))
    skinny = layers()
    assert calls == [(8, 64)] * model.config.num_hidden_layers
    monkeypatch.setattr(decoder_module, "skinny_applies", lambda x, w: False)
    xla = layers()
    assert len(calls) == model.config.num_hidden_layers
    np.testing.assert_allclose(skinny, xla, atol=0.02 * np.abs(xla).max())


def test_metadata_layout_and_padding():
    meta = build_metadata([2, 0], [3, 1], [[4, 5], [7]], page_size=4, num_tokens=6, num_reqs=3,
                          max_pages=3)
    np.testing.assert_array_equal(meta.positions, [2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(meta.token_req, [0, 0, 0, 1, -1, -1])
    np.testing.assert_array_equal(meta.page_table, [[4, 5, 0], [7, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(meta.seq_lens, [5, 1, 0])
    np.testing.assert_array_equal(meta.query_start, [0, 3, 4])
    np.testing.assert_array_equal(meta.query_lens, [3, 1, 0])
    chex.assert_type([meta.positions, meta.token_req, meta.page_table, meta.seq_lens], jnp.int32)
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    assert len(leaves) == 6 and not meta.decode_only
    assert jax.tree_util.tree_unflatten(treedef, leaves).decode_only is False


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prefix_lens=[0], new_lens=[9], page_ids=[[0, 1]]),  # pages too few
        dict(prefix_lens=[0], new_lens=[5], page_ids=[[0, 1]], num_tokens=4),  # bucket too small
        dict(prefix_lens=[3], new_lens=[2], page_ids=[[0, 1]], decode_only=True),  # not one token
    ],
)
def test_metadata_rejects_bad_layouts(kwargs):
    with pytest.raises(ValueError):
        build_metadata(page_size=4, **kwargs)


@pytest.mark.parametrize(
    "overrides", [dict(head_dim=32), dict(hidden_size=80, head_dim=16)],
    ids=["wider", "hidden-not-heads-x-d"],
)
def test_explicit_head_dim_matches_numpy_reference(tmp_path: Path, overrides: dict):
    """transformers' Qwen2 sizes q/k/v/o by an explicit head_dim when config.json has one."""
    cfg = small_hf_config(tied=False, **overrides)
    hid, d = cfg["hidden_size"], cfg["head_dim"]
    assert d != hid // cfg["num_attention_heads"]
    weights = random_hf_weights(cfg, seed=11)
    model = load_pretrained(write_hf_checkpoint(tmp_path, cfg, weights))
    attn = model.layers[0].self_attn
    chex.assert_shape(attn.qkv_proj.kernel[...], (hid, (4 + 2 * 2) * d))  # q, k, v heads
    chex.assert_shape(attn.o_proj.kernel[...], (4 * d, hid))
    toks = tokens_of(7, seed=12)
    ref = reference_logits(weights, cfg, toks)
    kv = init_kv_pages(model.config, NUM_PAGES, PAGE_SIZE)
    chex.assert_shape(kv[0][0], (NUM_PAGES, PAGE_SIZE, 2, d))
    logits, kv = step(model, kv, [(0, toks[:6], [5, 2])])
    assert_close(logits[:6], ref[:6])
    logits, _ = step(model, kv, [(6, toks[6:], [5, 2])], num_tokens=None, num_reqs=2,
                     decode_only=True)
    assert_close(logits[0], ref[6])


@pytest.mark.gpu
@pytest.mark.parametrize("landed", [(1, 1), (1, 0), (0, 1)])
def test_gpu_each_program_gates_on_its_own_layers(monkeypatch, landed):
    """The forward's two programs (one layer each here) wait on their own layers' flags: a
    layer whose flag is short of the step's load runs out of spins (limit shortened) and reports
    it in the flags' last slot; with both flags set nothing does."""
    import dataclasses

    from jhicache.models import Qwen2ForCausalLM, init_random, preset_config
    from jhicache.pallas_kernels import _attention

    monkeypatch.setattr(_attention, "GATE_SPIN_LIMIT", 64)  # read when the kernels are traced
    config = dataclasses.replace(preset_config("tiny"), num_hidden_layers=2, vocab_size=384,
                                 num_attention_heads=2, num_key_value_heads=1)
    model: Qwen2ForCausalLM = init_random(config, seed=4)  # a shape no other test traces
    programs = ModelPrograms(model)
    meta = build_metadata([0], [5], [[0, 1]], page_size=PAGE_SIZE)
    flags = jnp.array([*landed, 0], jnp.int32)
    meta = dataclasses.replace(meta, load_flags=flags, load_seq=jnp.array([1], jnp.int32))
    kv = init_kv_pages(config, NUM_PAGES, PAGE_SIZE)
    programs.forward(tuple(k for k, _ in kv), tuple(v for _, v in kv), pack_tokens([[1] * 5]),
                     meta, jnp.array([4], jnp.int32))[0].block_until_ready()
    assert int(np.asarray(jnp.copy(flags))[-1]) == (0 if landed == (1, 1) else 1)


@pytest.mark.gpu
def test_gpu_long_batch_with_new_tokens_apart_matches_one_kernel(monkeypatch) -> None:
    """A bf16 batch of 1100 new tokens over a 300-token cached prefix (and a fresh 200-token
    request): the model's logits with the new tokens' attention on cuDNN (`attend_fresh_apart`)
    match those with the one extend kernel, within bf16 tolerance. Eager layers, so each run
    traces its own attention calls."""
    import dataclasses

    from jhicache.models import Qwen2ForCausalLM, init_random, preset_config
    from jhicache.models import decoder as decoder_module
    from jhicache.pallas_kernels import fresh_attention

    if not fresh_attention.cudnn_available():
        pytest.skip("no cuDNN flash attention on this GPU")
    config = dataclasses.replace(preset_config("tiny"), num_attention_heads=8,
                                 num_key_value_heads=2, hidden_size=512, vocab_size=384)
    model: Qwen2ForCausalLM = init_random(config, seed=6, dtype=jnp.bfloat16)
    page, rng = 64, np.random.default_rng(6)
    prefix, new, fresh = (rng.integers(0, 384, n).tolist() for n in (300, 1100, 200))
    pages = [list(range(1, 23)), list(range(23, 27))]  # 1400 and 200 tokens' worth, distinct
    kv = init_kv_pages(config, 32, page, jnp.bfloat16)
    meta = build_metadata([0], [300], [pages[0][:5]], page_size=page)
    hidden = model.embed(pack_tokens([prefix], meta.num_tokens))
    cached = []
    for i, (k, v) in enumerate(kv):  # the prefix's pages
        hidden, k, v = model.layer(i, hidden, k, v, meta)
        cached.append((k, v))
    meta = build_metadata([300, 0], [1100, 200], pages, page_size=page, num_tokens=1408)

    def logits(apart: bool) -> np.ndarray:
        monkeypatch.setattr(decoder_module, "attend_fresh_apart", lambda *_: apart)
        h = model.embed(pack_tokens([new, fresh], meta.num_tokens))
        for i, (k, v) in enumerate(cached):
            h, _, _ = model.layer(i, h, jnp.copy(k), jnp.copy(v), meta)
        return np.asarray(model.head(h[jnp.array([1099, 1299])]), np.float32)

    together, apart = logits(False), logits(True)
    np.testing.assert_allclose(apart, together, rtol=5e-2, atol=5e-2 * np.abs(together).max())


@pytest.mark.parametrize("rows,block", [(7, 1024), (24, 8), (20, 8)])
def test_head_rows_in_blocks_equals_one_reduction_of_every_row(model, rows: int, block: int):
    """The head over every row, `block` rows at a time (the last block padded where `rows` is
    not a multiple of it; one block of `rows` where they are fewer), reduced block by block:
    the same as the reduction of the head's logits of all rows at once."""
    from jhicache.logprobs import MAX_TOKEN_IDS, row_logprobs

    rng = np.random.default_rng(rows)
    hidden = jnp.asarray(rng.standard_normal((rows, model.config.hidden_size)), jnp.float32)
    # each row's next token, then the ids its request names (MAX_TOKEN_IDS columns)
    targets = jnp.asarray(rng.integers(0, model.config.vocab_size, (rows, 1 + MAX_TOKEN_IDS)),
                          jnp.int32)
    got = ModelPrograms(model).head_rows(hidden, targets, row_logprobs, block=block)
    want = row_logprobs(model.head(hidden), targets)
    for ours, ref in zip(got, want, strict=True):
        chex.assert_shape(ours, ref.shape)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)
