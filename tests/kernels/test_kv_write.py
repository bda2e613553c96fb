"""Paged KV write against the scatter reference, with NaN-poisoned pages."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels.kv_write import write_kv, write_kv_reference

from tests.kernels.batches import make_batch
from tests.kernels.helpers import poisoned, rand, same

lens = st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40)), min_size=0, max_size=3)


def _run(seed, pairs, page_size, dtype, pad_tokens, heads=2, dim=8, **kw):
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [p for p, _ in pairs], [n for _, n in pairs], page_size,
                       pad_tokens=pad_tokens, pad_requests=1)
    t = batch.token_req.shape[0]
    k_pages, v_pages = (poisoned((batch.num_pages, page_size, heads, dim), np.float32).astype(dtype)
                        for _ in "kv")
    k_new, v_new = (rand(rng, (t, heads, dim), np.float32) for _ in "kv")
    args = (k_new, v_new, batch.page_table, batch.token_req, batch.positions)
    want = write_kv_reference(jnp.asarray(k_pages), jnp.asarray(v_pages), *map(jnp.asarray, args))
    got = write_kv(jnp.asarray(k_pages), jnp.asarray(v_pages), *map(jnp.asarray, args), **kw)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    assert same(got[0], want[0]) and same(got[1], want[1])


@settings(max_examples=10, deadline=None)
@given(pairs=lens, page_size=st.sampled_from([1, 16, 64]),
       dtype=st.sampled_from([np.float32, jnp.bfloat16]), pad_tokens=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_write_kv_matches_reference(pairs, page_size, dtype, pad_tokens, seed):
    _run(seed, pairs, page_size, dtype, pad_tokens)


@pytest.mark.parametrize("tokens_per_program", [1, 3, 8])
def test_write_kv_program_split(tokens_per_program):
    _run(5, [(13, 21), (0, 5), (16, 16)], 16, np.float32, 2, tokens_per_program=tokens_per_program)


@pytest.mark.parametrize("heads,dim", [(2, 64), (4, 128), (1, 16)])
def test_write_kv_row_shapes(heads, dim):
    """Qwen2-like rows (2x64, 4x128) and a narrow one."""
    _run(8, [(13, 21), (0, 5), (70, 40)], 16, jnp.bfloat16, 3, heads=heads, dim=dim,
         tokens_per_program=16)


def test_write_kv_padding_only_blocks():
    """Blocks holding only padding tokens (before, between and after live ones) write nothing."""
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [3], [5], 16, pad_tokens=20)
    order = np.r_[5:13, 0:5, 13:25]  # 8 padding tokens first: a whole padding block, then live ones
    k = v = jnp.asarray(poisoned((batch.num_pages, 16, 2, 8), np.float32))
    new = rand(rng, (25, 2, 8), np.float32)[order]
    args = [jnp.asarray(x)
            for x in (new, new, batch.page_table, batch.token_req[order], batch.positions[order])]
    want = write_kv_reference(k, v, *args)
    got = write_kv(k, v + 0, *args, tokens_per_program=4)
    assert same(got[0], want[0]) and same(got[1], want[1])


def test_write_kv_every_slot_written_exactly():
    """Prefix ending mid-page, no prefix, and a full page: the written slots are exactly the new
    ones."""
    rng = np.random.default_rng(0)
    batch = make_batch(rng, [5, 0, 16], [14, 3, 16], 16, pad_tokens=3)
    k = v = jnp.asarray(poisoned((batch.num_pages, 16, 1, 4), np.float32))
    new = jnp.asarray(rand(rng, (batch.token_req.shape[0], 1, 4), np.float32))
    out_k, _ = write_kv(k, v + 0, new, new,
                        *map(jnp.asarray, (batch.page_table, batch.token_req, batch.positions)))
    flat = np.asarray(out_k).reshape(-1, 4)
    live = batch.token_req >= 0
    slots = (batch.page_table[batch.token_req[live], batch.positions[live] // 16] * 16
             + batch.positions[live] % 16)
    assert np.array_equal(flat[slots], np.asarray(new)[live].reshape(-1, 4))
    assert np.isnan(np.delete(flat, slots, axis=0)).all()


def _bad_calls():
    rng = np.random.default_rng(1)
    pages = jnp.asarray(rand(rng, (4, 16, 2, 8), np.float32))
    new = jnp.asarray(rand(rng, (3, 2, 8), np.float32))
    table = np.array([[0, 1], [2, 3]], np.int32)
    req, pos = np.array([0, 1, -1], np.int32), np.array([3, 17, 0], np.int32)
    return [
        # bad page
        lambda: write_kv(pages, pages, new, new, np.array([[9, 1], [2, 3]], np.int32), req, pos),
        # beyond table
        lambda: write_kv(pages, pages, new, new, table, req, np.array([3, 40, 0], np.int32)),
        lambda: write_kv(pages, pages, new[:, :1], new, table, req, pos),  # head mismatch
        lambda: write_kv(pages, pages, new, new, table, req[:2], pos),  # T mismatch
        # K/V dtypes
        lambda: write_kv(pages, pages.astype(jnp.bfloat16), new, new, table, req, pos),
        lambda: write_kv(pages, pages, new, new, table.astype(np.int64), req, pos),  # table dtype
        # req beyond B
        lambda: write_kv(pages, pages, new, new, table, np.array([0, 2, -1], np.int32), pos),
    ]


@pytest.mark.parametrize("index", range(7))
def test_write_kv_invalid_arguments_raise(index):
    with pytest.raises(ValueError):
        _bad_calls()[index]()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gpu_write_kv(page_size, dtype):
    _run(11, [(0, 100), (37, 64), (64, 1), (5, 200)], page_size, dtype, 7, heads=2, dim=64)
    _run(12, [(3, 30), (130, 70)], page_size, dtype, 2, heads=4, dim=128, tokens_per_program=8)
