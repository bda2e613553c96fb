"""RoPE + paged KV write against its pure-jnp reference and against the model's own RoPE, with
NaN-poisoned pages (untouched slots stay NaN)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.models.config import Llama3Scaling
from jhicache.models.decoder import RMSNorm, rope_inv_freq
from jhicache.pallas_kernels import rope_write as rw
from jhicache.pallas_kernels.rope_write import QKNorm, rope_write, rope_write_reference

from tests.kernels.batches import make_batch
from tests.kernels.helpers import poisoned, rand, same

lens = st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40)), min_size=0, max_size=3)


def _case(seed, pairs, page_size, dtype, pad_tokens, heads=4, kv_heads=2, dim=8, norm=False):
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [p for p, _ in pairs], [n for _, n in pairs], page_size,
                       pad_tokens=pad_tokens, pad_requests=1)
    t = batch.token_req.shape[0]
    pages = poisoned((batch.num_pages, page_size, kv_heads, dim), np.float32)
    qkv = rand(rng, (t, (heads + 2 * kv_heads) * dim), np.float32) - 3.0  # signs both ways
    qk_norm = None
    if norm:
        qk_norm = QKNorm(jnp.asarray(rand(rng, (dim,), np.float32), dtype),
                         jnp.asarray(rand(rng, (dim,), np.float32), dtype), 1e-6)
    args = (jnp.asarray(qkv, dtype), jnp.asarray(pages, dtype), jnp.asarray(pages, dtype),
            *map(jnp.asarray, (batch.page_table, batch.token_req, batch.positions)),
            rope_inv_freq(dim, 10_000.0))
    return args, dict(heads=heads, norm=qk_norm), batch


def _check(seed, pairs, page_size, dtype, pad_tokens, **kw):
    run = {k: kw.pop(k) for k in ("tokens_per_program",) if k in kw}
    args, named, batch = _case(seed, pairs, page_size, dtype, pad_tokens, **kw)
    want = rope_write_reference(*args, **named)
    got = rope_write(args[0], args[1] + 0, args[2] + 0, *args[3:], new_rows=True, **named, **run)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    # float32: a few ulps (FMA, sums in another order); bfloat16: a step of its rounding
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == np.float32 else dict(atol=5e-2, rtol=2e-2)
    # the pages: the same slots written, the rest still NaN, values equal up to rounding
    for g, w in ((got.k_pages, want.k_pages), (got.v_pages, want.v_pages)):
        assert np.array_equal(np.isnan(np.asarray(g, np.float32)),
                              np.isnan(np.asarray(w, np.float32)))
    assert same(got.v_pages, want.v_pages)  # values are copied, not computed
    live = batch.token_req >= 0
    for g, w, rows in ((got.q, want.q, slice(None)), (got.k, want.k, slice(None)),
                       (got.v, want.v, slice(None)), (got.k_pages, want.k_pages, None)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if rows is None:
            g, w = np.nan_to_num(g), np.nan_to_num(w)
        np.testing.assert_allclose(g, w, **tol)
    assert live.sum() == 0 or np.isfinite(np.asarray(got.q, np.float32)).all()


@settings(max_examples=12, deadline=None)
@given(lens, st.sampled_from([1, 16]), st.integers(0, 5), st.integers(0, 1000))
def test_rope_write_matches_reference_f32(pairs, page_size, pad, seed):
    _check(seed, pairs or [(0, 1)], page_size, np.float32, pad)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_norm_and_dtypes(dtype, norm):
    _check(4, [(13, 21), (0, 5), (70, 40)], 16, dtype, 3, heads=6, kv_heads=2, dim=16,
           norm=norm)


@pytest.mark.parametrize("tokens_per_program", [1, 4, 64])
def test_rope_write_program_split(tokens_per_program):
    _check(5, [(13, 21), (0, 5), (16, 16)], 16, np.float32, 2,
           tokens_per_program=tokens_per_program)


def _hf_rope(x, pos, inv_freq):
    """HF's rotate_half RoPE in numpy float64: x * cos + rotate_half(x) * sin."""
    freqs = pos[:, None].astype(np.float64) * np.asarray(inv_freq, np.float64)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def test_reference_is_hf_rope_after_the_models_norm():
    """The reference rotates as HF's rotate_half RoPE (written out here in numpy), after the
    model's own `RMSNorm`, with Llama 3's scaled frequencies: what the kernel is checked against
    is the model's definition, not a copy of the kernel."""
    rng = np.random.default_rng(7)
    heads, kv, dim, t = 4, 2, 16, 9
    scaling = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64)
    inv = rope_inv_freq(dim, 500_000.0, scaling)
    qkv = jnp.asarray(rng.standard_normal((t, (heads + 2 * kv) * dim)), jnp.float32)
    pos = rng.integers(0, 4000, t).astype(np.int32)
    pages = jnp.zeros((4, 16, kv, dim), jnp.float32)
    table = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
    req = jnp.full((t,), -1, jnp.int32)  # nothing written: the rotation is what is compared
    q_norm, k_norm = RMSNorm(dim, 1e-6, jnp.float32), RMSNorm(dim, 1e-6, jnp.float32)
    q_norm.weight[...] = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    k_norm.weight[...] = jnp.asarray(rng.standard_normal(dim), jnp.float32)
    norm = QKNorm(q_norm.weight[...], k_norm.weight[...], 1e-6)
    got = rope_write_reference(qkv, pages, pages, table, req, jnp.asarray(pos), inv,
                               heads=heads, norm=norm)
    q = qkv[:, :heads * dim].reshape(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv) * dim].reshape(t, kv, dim)
    for g, x, n in ((got.q, q, q_norm), (got.k, k, k_norm)):
        want = _hf_rope(np.asarray(n(x), np.float64), pos, inv)
        np.testing.assert_allclose(np.asarray(g), want, rtol=2e-4, atol=2e-4)


def _bad_calls():
    args, named, _ = _case(1, [(3, 5)], 16, np.float32, 1)
    qkv, k, v, table, req, pos, inv = args
    return [
        lambda: rope_write(qkv[:, :-8], k, v, table, req, pos, inv, heads=4),  # columns
        lambda: rope_write(qkv, k, v, table, req, pos, inv, heads=3),  # heads vs kv heads
        lambda: rope_write(qkv, k, v, table, req, pos, inv[:2], heads=4),  # inv_freq shape
        lambda: rope_write(qkv, k, v, table, req, pos.astype(jnp.int16), inv, heads=4),
        lambda: rope_write(qkv, k, v, table, req[:1], pos, inv, heads=4),  # T mismatch
        lambda: rope_write(qkv, k, v, np.array([[99]], np.int32), req, pos, inv, heads=4),
        lambda: rope_write(qkv, k, v, table, req, pos, inv, heads=4,
                           norm=QKNorm(jnp.ones(4), jnp.ones(8), 1e-6)),  # norm weight shape
    ]


@pytest.mark.parametrize("index", range(7))
def test_rope_write_invalid_arguments_raise(index):
    with pytest.raises(ValueError):
        _bad_calls()[index]()


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (28, 4, 128)])
def test_rope_write_lowers_to_triton(heads, kv_heads, dim, monkeypatch):
    """Lowered for CUDA (Pallas -> Triton IR, no GPU needed) at the Qwen2 head shapes, page 64,
    bf16, with and without the norm and the new rows: every operation of the kernel has a Triton
    lowering rule, which the interpreter tests cannot show."""
    monkeypatch.setattr(rw, "use_interpreter", lambda: False)
    spec = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    pages = spec(130, 64, kv_heads, dim, dtype=jnp.bfloat16)
    weight = spec(dim, dtype=jnp.bfloat16)
    for normed, new_rows in ((False, False), (True, True)):
        def run(qkv, k, v, table, req, pos, inv, qw, kw, normed=normed, new_rows=new_rows):
            norm = QKNorm(qw, kw, 1e-6) if normed else None
            return rope_write(qkv, k, v, table, req, pos, inv, heads=heads, norm=norm,
                              new_rows=new_rows)
        text = (jax.jit(run).trace(spec(64, (heads + 2 * kv_heads) * dim, dtype=jnp.bfloat16),
                                   pages, pages, spec(1, 130), spec(64), spec(64),
                                   spec(dim // 2, dtype=jnp.float32), weight, weight)
                .lower(lowering_platforms=("cuda",)).as_text())
        assert text.count("triton") >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gpu_rope_write(page_size, dtype):
    _check(11, [(0, 100), (37, 64), (64, 1), (5, 200)], page_size, dtype, 7, heads=14,
           kv_heads=2, dim=64)
    _check(12, [(3, 30), (130, 70)], page_size, dtype, 2, heads=28, kv_heads=4, dim=128,
           norm=True, tokens_per_program=8)
