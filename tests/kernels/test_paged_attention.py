"""Paged extend and decode attention against the pure-jnp references."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels import decode_attention as da
from jhicache.pallas_kernels import extend_attention as ea
from jhicache.pallas_kernels._attention import NEG, LayerGate

from tests.kernels.batches import make_batch
from tests.kernels.helpers import rand

TOL = {np.dtype(np.float32): 2e-5, np.dtype(jnp.bfloat16): 2e-2}


def _pages(rng, num_pages, page_size, kv_heads, dim, dtype):
    return [jnp.asarray(rand(rng, (num_pages, page_size, kv_heads, dim), np.float32) - 3.0)
            .astype(dtype) for _ in "kv"]


def _close(got, want, dtype):
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=TOL[np.dtype(dtype)], rtol=TOL[np.dtype(dtype)])


def new_kv_of(batch, k, v):
    """The new tokens' K and V rows [T, KV, D], read out of the pages where they were written
    (padding rows: the first slot's, never used)."""
    req = np.maximum(batch.token_req, 0)
    page_size = k.shape[1]
    pages = batch.page_table[req, batch.positions // page_size]
    return tuple(x[pages, batch.positions % page_size] for x in (k, v))


def run_extend(seed, pairs, page_size, dtype, *, heads=4, kv_heads=2, dim=16, pad_tokens=2,
               apart=False, **kw):
    """Extend attention on a random ragged batch against the reference; `apart`: the new tokens'
    attention among themselves computed apart (`new_kv`), the kernel reading only the prefix."""
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [p for p, _ in pairs], [n for _, n in pairs], page_size,
                       pad_tokens=pad_tokens, pad_requests=1)
    k, v = _pages(rng, batch.num_pages, page_size, kv_heads, dim, dtype)
    q = (jnp.asarray(rand(rng, (batch.token_req.shape[0], heads, dim), np.float32) - 3.0)
         .astype(dtype))
    meta = [jnp.asarray(x)
            for x in (batch.page_table, batch.seq_lens, batch.query_start, batch.query_lens)]
    if apart:
        kw["new_kv"] = new_kv_of(batch, k, v)
    got = ea.paged_attention(q, k, v, *meta, sm_scale=dim**-0.5, **kw)
    live = batch.token_req >= 0  # apart, padding rows may hold anything
    want = ea.paged_attention_reference(q, k, v, *meta, sm_scale=dim**-0.5)
    _close(got[live], want[live], dtype)
    if not apart:
        assert not np.asarray(got, np.float32)[~live].any()  # zeros at padding rows


def run_decode(seed, seq_lens, page_size, dtype, *, heads=4, kv_heads=2, dim=16, extra_columns=0,
               **kw):
    """`extra_columns`: unused page-table columns past the longest request's (the engine's
    tables are as wide as its longest admissible request)."""
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [max(s - 1, 0) for s in seq_lens], [1 if s else 0 for s in seq_lens],
                       page_size)
    k, v = _pages(rng, batch.num_pages, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rand(rng, (len(seq_lens), heads, dim), np.float32) - 3.0).astype(dtype)
    table = jnp.asarray(np.pad(batch.page_table, ((0, 0), (0, extra_columns))))
    lens = jnp.asarray(batch.seq_lens)
    got = da.paged_decode_attention(q, k, v, table, lens, sm_scale=dim**-0.5, **kw)
    if not seq_lens:
        return chex.assert_shape(got, (0, heads, dim))
    _close(got, da.paged_decode_attention_reference(q, k, v, table, lens, sm_scale=dim**-0.5),
           dtype)
    assert not np.asarray(got, np.float32)[np.asarray(seq_lens) == 0].any()


lens = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 24)), min_size=0, max_size=3)


@settings(max_examples=5, deadline=None)
@given(pairs=lens, page_size=st.sampled_from([1, 16, 64]),
       dtype=st.sampled_from([np.float32, jnp.bfloat16]), splits=st.sampled_from([None, 1, 2, 5]),
       seed=st.integers(0, 2**31 - 1))
def test_extend_matches_reference(pairs, page_size, dtype, splits, seed):
    run_extend(seed, pairs, page_size, dtype, block_q=16, block_k=16, splits=splits)


@settings(max_examples=5, deadline=None)
@given(pairs=lens, page_size=st.sampled_from([1, 16, 64]),
       dtype=st.sampled_from([np.float32, jnp.bfloat16]), splits=st.sampled_from([None, 1, 2, 5]),
       seed=st.integers(0, 2**31 - 1))
def test_extend_with_new_tokens_apart_matches_reference(pairs, page_size, dtype, splits, seed):
    """The new tokens' causal part computed apart (the CPU's reference stands in for cuDNN), the
    kernel continuing over the prefix: one split from that state, several merged with it; requests
    without a prefix, with no new tokens (mid-batch), prefixes ending mid-block."""
    run_extend(seed, pairs, page_size, dtype, block_q=16, block_k=16, splits=splits, apart=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_extend_apart_gqa_prefix_free_and_gated(splits):
    """Apart, GQA group 7 with tiles ending mid-group, a prefix-free request (its rows are the new
    tokens' state alone), a one-token turn, a gate."""
    run_extend(5, [(37, 20), (0, 9), (70, 1)], 16, np.float32, heads=14, kv_heads=2, pad_tokens=3,
               block_q=16, block_k=8, splits=splits, apart=True, gate=_open_gate())


def test_extend_mid_page_prefix_no_prefix_and_gqa():
    run_extend(0, [(5, 14), (0, 3), (16, 16), (40, 1)], 16, np.float32, heads=6, kv_heads=2,
               block_q=8, block_k=16)


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (28, 4, 16), (4, 2, 128), (3, 3, 16)])
@pytest.mark.parametrize("block_q", [16, 32])
def test_extend_group_packing(heads, kv_heads, dim, block_q):
    """GQA-packed tiles: groups of 7/7/2/1 heads, tiles that end mid-group and mid-token, a tile's
    rows spanning the causal diagonal and the request's end, prefixes ending mid-page."""
    run_extend(7, [(5, 19), (0, 3), (33, 9)], 16, np.float32, heads=heads, kv_heads=kv_heads,
               dim=dim, block_q=block_q, block_k=16)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("heads,dtype", [(2, np.float32), (14, jnp.bfloat16)])
def test_extend_split_k(splits, heads, dtype):
    """Forced key-range splits against the reference, GQA groups 1 and 7: a 2-token turn over a
    70-token prefix (10 key blocks), a 40-token turn over 3 keys whose tiles' causal diagonals span
    several blocks, so split ends fall inside them (group 1), a 1-token turn; 7 splits of 1..5-block
    ranges leave some empty; padding rows."""
    run_extend(11 + splits, [(70, 2), (3, 40), (20, 1)], 16, dtype, heads=heads, kv_heads=2, dim=16,
               pad_tokens=3, block_q=16, block_k=8, splits=splits)


def test_choose_extend_splits():
    """Automatic splits: many for a short turn over a long prefix, one where the grid fills the
    GPU."""
    choose = functools.partial(ea.choose_extend_splits, block_q=128, block_k=64)
    # Qwen2-0.5B, 64 new tokens over 8k: 8 programs; 16 splits (>= 8 key blocks each) -> 128
    assert choose(64, 1, 8256, 14, 2, 64) == 16
    assert choose(64, 1, 8256, 28, 4, 128) == 16  # Qwen2-7B: 16 programs -> 256, two per SM
    assert choose(64, 1, 8256, 28, 4, 128, block_k=128) == 8  # 8 blocks of 128 a split
    assert choose(64, 8, 8256, 14, 2, 64) == 11  # padding requests: 24 programs at most
    assert choose(64, 1, 1024, 14, 2, 64) == 2  # short prefix: >= 8 key blocks per split
    assert choose(64, 1, 512, 14, 2, 64) == 1
    assert choose(8192, 1, 16384, 14, 2, 64) == 1  # a prefill chunk: 896 programs already
    assert choose(2048, 1, 8192, 28, 4, 128) == 1
    # The partials [splits, T * H, D + 1] stay under 64 MiB at 4 bytes an element: 8.1 MiB a
    # split here, so at most 7 (the grid would allow 8).
    assert choose(4096, 1, 1 << 20, 4, 4, 128, block_q=512) == 7


@pytest.mark.parametrize("page_size,block_k", [(16, 16), (64, 32), (16, 32), (1, 16)])
def test_extend_short_turn_over_long_prefix_splits_itself(page_size, block_k):
    """The long-prefix path as the model calls it: automatic splits (asserted > 1), a gate, a
    ragged batch (a long prefix ending mid-page, a short one, a prefix-free request, a padding
    request and padding tokens), last pages partly filled; key blocks inside one page (page-table
    read once per block) and spanning pages."""
    pairs = [(601, 8), (37, 5), (0, 3)]
    tokens, heads, kv_heads = sum(n for _, n in pairs) + 3, 14, 2
    max_tokens = -(-max(p + n for p, n in pairs) // page_size) * page_size
    splits = ea.choose_extend_splits(tokens, len(pairs) + 1, max_tokens, heads, kv_heads, 16,
                                     block_q=16, block_k=block_k)
    assert splits > 1
    run_extend(21, pairs, page_size, np.float32, heads=heads, kv_heads=kv_heads, pad_tokens=3,
               block_q=16, block_k=block_k, gate=_open_gate())


@pytest.mark.parametrize("group,block_q", [(7, 128), (7, 16), (2, 16), (1, 16)])
def test_extend_tiles_write_only_their_own_rows(group, block_q):
    """Every row of a request (for one kv head) belongs to exactly one tile, and a tile's rows past
    the request's end repeat its own last row: where a token straddles two tiles, the later tile
    must not store into the earlier one's rows (apart, the output starts as the new tokens' state,
    which the earlier tile reads; the interpreter, which copies aliased buffers, cannot show it)."""
    kv_heads, hk, start = 3, 1, 5
    heads = group * kv_heads
    for qlen in range(1, 60):
        arrays = [jnp.asarray([x], jnp.int32) for x in (qlen + 100, start, qlen)]
        owned: list[set[int]] = []
        for tile in range(-(-qlen * group // block_q)):
            rows = np.asarray(ea._tile(*arrays, 0, hk, tile, group=group, heads=heads,
                                       block_q=block_q)[0])
            owned.append(set(rows.tolist()))
        want = {(start + t) * heads + hk * group + r for t in range(qlen) for r in range(group)}
        assert set().union(*owned) == want
        assert sum(len(o) for o in owned) == len(want), f"tiles share rows at qlen {qlen}"


@pytest.mark.parametrize("junk", [np.nan, 7.0])
def test_merge_zeroes_unwritten_padding_rows(junk):
    """No program writes the partials of padding tokens (on the GPU they hold whatever was there;
    the interpreter zero-fills), so poison them here: the merge kernel must still write zeros
    there, and the exact merge elsewhere, also in its last program, which runs past the rows."""
    rng = np.random.default_rng(3)
    splits, tokens, heads, dim = 3, 5, 2, 16
    out = rand(rng, (splits, tokens, heads, dim), np.float32)
    lse = rand(rng, (splits, tokens, heads), np.float32)
    lse[1, :, 0], out[1, :, 0] = NEG, 0.0  # a split that saw no key for head 0
    # tokens 2 and 4: padding
    start, lens = np.array([0, 3, 0], np.int32), np.array([2, 1, 0], np.int32)
    pad = np.array([False, False, True, False, True])
    for x in (out, lse):
        x[:, pad] = junk
    # the new tokens' own state, computed apart: the merge's last part where given
    o0, lse0 = out[0] + 1.0, lse[0] - 0.5
    for fresh in (None, (o0, lse0)):
        parts = (out, lse) if fresh is None else (np.concatenate([out, o0[None]]),
                                                  np.concatenate([lse, lse0[None]]))
        got = ea._merge_call(jnp.asarray(out.reshape(-1, dim)), jnp.asarray(lse.reshape(-1)),
                             jnp.asarray(start), jnp.asarray(lens),
                             None if fresh is None else (jnp.asarray(o0.reshape(-1, dim)),
                                                         jnp.asarray(lse0.reshape(-1))),
                             splits=splits, heads=heads, block_rows=4)  # 10 rows: 3 programs
        w = np.exp2(parts[1] - parts[1].max(axis=0))
        want = (parts[0] * w[..., None]).sum(axis=0) / w.sum(axis=0)[..., None]
        got = np.asarray(got).reshape(tokens, heads, dim)
        np.testing.assert_allclose(got[~pad], want[~pad], rtol=1e-6)
        assert not got[pad].any()


def test_merge_rows_spread_the_partials_over_the_sms():
    assert ea.merge_rows(64 * 28, 128, 132) == 8  # Qwen2-7B, 64 tokens: 224 programs
    assert ea.merge_rows(64 * 14, 64, 132) == 8  # a block of 512 elements at least
    assert ea.merge_rows(1 << 20, 128, 132) == 64
    assert ea.merge_rows(3, 16, 132) == 32


@settings(max_examples=5, deadline=None)
@given(seq_lens=st.lists(st.integers(0, 70), min_size=0, max_size=4),
       page_size=st.sampled_from([1, 16, 64]), dtype=st.sampled_from([np.float32, jnp.bfloat16]),
       splits=st.sampled_from([1, 3]), seed=st.integers(0, 2**31 - 1))
def test_decode_matches_reference(seq_lens, page_size, dtype, splits, seed):
    run_decode(seed, seq_lens, page_size, dtype, block_k=16, splits=splits)


@settings(max_examples=4, deadline=None)
@given(seq_lens=st.lists(st.integers(0, 90), min_size=1, max_size=3),
       extra=st.integers(1, 12), splits=st.sampled_from([2, 5]),
       seed=st.integers(0, 2**31 - 1))
def test_decode_over_a_table_wider_than_its_requests_matches_reference(seq_lens, extra, splits,
                                                                       seed):
    """Each request's splits share out its own length, whatever the table's width."""
    run_decode(seed, seq_lens, 16, np.float32, block_k=16, splits=splits, extra_columns=extra)


def _bad_calls():
    rng = np.random.default_rng(1)
    k, v = _pages(rng, 4, 16, 2, 16, np.float32)
    q = jnp.asarray(rand(rng, (5, 4, 16), np.float32))
    table = np.array([[0, 1], [2, 3]], np.int32)
    seq, start, qlen = (np.array(x, np.int32) for x in ([20, 3], [0, 4], [4, 1]))
    ext = lambda *a, **kw: ea.paged_attention(*a, sm_scale=0.25, **kw)  # noqa: E731
    return [
        # page id out of range
        lambda: ext(q, k, v, np.array([[0, 7], [2, 3]], np.int32), seq, start, qlen),
        lambda: ext(q, k, v, table, np.array([40, 3], np.int32), start, qlen),  # beyond the table
        lambda: ext(q, k, v, table, seq, np.array([0, 5], np.int32), qlen),  # query rows beyond T
        lambda: ext(q[:, :3], k, v, table, seq, start, qlen),  # heads not a multiple
        lambda: ext(q[..., :8], k, v, table, seq, start, qlen),  # head_dim
        lambda: ext(q, k, v.astype(jnp.bfloat16), table, seq, start, qlen),  # K/V dtypes
        lambda: ext(q, k, v, table, seq.astype(np.int64), start, qlen),
        lambda: da.paged_decode_attention(q[:2], k, v, np.array([[0, 9], [2, 3]], np.int32), seq,
                                          sm_scale=0.25),
        lambda: da.paged_decode_attention(q[:3], k, v, table, seq, sm_scale=0.25),  # batch mismatch
    ]


@pytest.mark.parametrize("index", range(9))
def test_attention_invalid_arguments_raise(index):
    with pytest.raises(ValueError):
        _bad_calls()[index]()


def test_empty_batches():
    rng = np.random.default_rng(2)
    k, v = _pages(rng, 3, 16, 2, 16, np.float32)
    empty = np.zeros((0,), np.int32)
    out = ea.paged_attention(jnp.zeros((0, 4, 16)), k, v, np.zeros((0, 1), np.int32), empty, empty,
                             empty, sm_scale=0.25)
    chex.assert_shape(out, (0, 4, 16))
    chex.assert_shape(da.paged_decode_attention(jnp.zeros((0, 4, 16)), k, v,
                                                np.zeros((0, 1), np.int32), empty, sm_scale=0.25),
                      (0, 4, 16))


def _open_gate(layer: int = 2, seq: int = 5) -> LayerGate:
    """A gate whose flag is already past its sequence number: the kernels must not wait."""
    flags = np.zeros(6, np.int32)
    flags[layer] = seq + 1
    return LayerGate(jnp.asarray(flags), jnp.array([seq], jnp.int32),
                     jnp.array([layer], jnp.int32))


@pytest.mark.parametrize("splits", [1, 3])
def test_gated_kernels_match_reference(splits):
    """With a gate (flags set, as once a layer's loads landed) both kernels give the reference;
    the gate adds its operands in front, which shifts the split-1 kernel's aliased output."""
    run_extend(11, [(37, 5), (0, 9)], 16, np.float32, splits=splits, gate=_open_gate())
    run_decode(12, [33, 0, 70], 16, np.float32, splits=splits, gate=_open_gate(0, 1))


def test_gate_arguments_checked():
    q, pages = jnp.ones((2, 2, 16)), jnp.ones((3, 16, 1, 16))
    table, lens = jnp.array([[1]], jnp.int32), jnp.array([2], jnp.int32)
    bad = _open_gate()._replace(seq=jnp.array([1, 2], jnp.int32))
    with pytest.raises(ValueError, match="gate seq"):
        da.paged_decode_attention(q[:1], pages, pages, table, lens, sm_scale=0.3, gate=bad)
    with pytest.raises(ValueError, match="gate flags"):
        ea.paged_attention(q, pages, pages, table, lens, jnp.array([0], jnp.int32), lens,
                           sm_scale=0.3, gate=bad._replace(flags=jnp.zeros(4, jnp.float32)))


@pytest.mark.gpu
def test_gpu_gate_that_runs_out_of_spins_reports_it(monkeypatch):
    """A gate whose flag never reaches its number: every program gives up after the spin limit
    (shortened here), sets the flags' last slot, and computes on what the pages hold."""
    from jhicache.pallas_kernels import _attention

    monkeypatch.setattr(_attention, "GATE_SPIN_LIMIT", 64)  # read when the kernel is traced
    flags = jnp.zeros(5, jnp.int32)
    gate = LayerGate(flags, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
    # a shape no other test uses, so the kernel is traced with the short limit
    run_decode(13, [45, 7], 16, np.float32, heads=6, kv_heads=3, dim=32, gate=gate)
    assert np.asarray(jnp.copy(flags)).tolist() == [0, 0, 0, 0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gpu_extend_and_decode(page_size, dtype):
    run_extend(3, [(0, 100), (37, 64), (64, 1), (5, 200)], page_size, dtype, heads=14, kv_heads=2,
               dim=64, pad_tokens=9)
    run_extend(4, [(130, 70), (0, 33)], page_size, dtype, heads=28, kv_heads=4, dim=128)
    run_decode(5, [1, 0, 300, 64, 65, 1000], page_size, dtype, heads=14, kv_heads=2, dim=64)
    run_decode(6, [77, 2000, 0], page_size, dtype, heads=28, kv_heads=4, dim=128, splits=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gpu_extend_split_k(dtype):
    """Split-K on Triton: automatic splits (a short turn over a long prefix) and forced ones, both
    Qwen2 shapes."""
    run_extend(8, [(4000, 64)], 64, dtype, heads=14, kv_heads=2, dim=64, pad_tokens=0)
    run_extend(9, [(3000, 64), (37, 5), (1000, 1)], 64, dtype, heads=28, kv_heads=4, dim=128,
               pad_tokens=7)
    run_extend(10, [(500, 100), (64, 64)], 16, dtype, heads=14, kv_heads=2, dim=64, splits=7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gpu_extend_with_new_tokens_apart(dtype):
    """Apart on the GPU (cuDNN for bf16, the reference for float32), one split and several:
    long fresh prompts, a long turn over a prefix, a short turn, both Qwen2 head shapes."""
    run_extend(12, [(0, 700), (300, 500), (64, 1)], 64, dtype, heads=28, kv_heads=4, dim=128,
               pad_tokens=5, apart=True)
    run_extend(13, [(2000, 64), (0, 1000)], 16, dtype, heads=14, kv_heads=2, dim=64,
               pad_tokens=0, apart=True, splits=4)
    # last tokens straddling two 128-row tiles (55 x 7 = 385 rows), many programs: in place, no
    # tile may store into another's rows
    run_extend(14, [(300, 55)] * 40 + [(0, 55)], 64, dtype, heads=28, kv_heads=4, dim=128,
               pad_tokens=3, apart=True, splits=1, block_q=128)


@pytest.mark.gpu
def test_gpu_rejects_head_dim_below_16() -> None:
    q = jnp.ones((4, 2, 8), jnp.bfloat16)
    pages = jnp.ones((3, 16, 1, 8), jnp.bfloat16)
    lens = jnp.array([4], jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
        ea.paged_attention(q, pages, pages, jnp.array([[1]], jnp.int32), lens,
                           jnp.array([0], jnp.int32), lens, sm_scale=0.3)


@pytest.mark.parametrize("block_q,block_k,splits", [(128, 64, 16), (256, 128, 8), (64, 64, 1)])
def test_kernels_lower_to_triton(block_q, block_k, splits, monkeypatch):
    """Lowered for CUDA (Pallas -> Triton IR, no GPU needed): every operation of the extend, merge
    and decode kernels has a Triton lowering rule at the Qwen2-7B shape, page 64, bf16, gated. The
    interpreter tests cannot catch this (a weak-typed scalar once lowered to a mistyped rem)."""
    monkeypatch.setattr(ea, "use_interpreter", lambda: False)
    monkeypatch.setattr(da, "use_interpreter", lambda: False)
    spec = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    pages = spec(130, 64, 4, 128, dtype=jnp.bfloat16)
    gate = LayerGate(spec(29), spec(1), spec(1))
    extend = functools.partial(ea._extend, sm_scale=0.1, block_q=block_q, block_k=block_k,
                               splits=splits, num_warps=8, num_stages=3)
    for new_kv in (None, (spec(64, 4, 128, dtype=jnp.bfloat16),) * 2):  # apart: the prefix mode
        text = (jax.jit(extend).trace(spec(64, 28, 128, dtype=jnp.bfloat16), pages, pages,
                                      spec(1, 130), spec(1), spec(1), spec(1), gate, new_kv)
                .lower(lowering_platforms=("cuda",)).as_text())
        assert text.count("triton") >= (2 if splits > 1 else 1)
    decode = functools.partial(da._decode, sm_scale=0.1, block_k=block_k, splits=4, num_warps=4,
                               num_stages=2)
    jax.jit(decode).trace(spec(8, 28, 128, dtype=jnp.bfloat16), pages, pages, spec(8, 16), spec(8),
                          gate).lower(lowering_platforms=("cuda",))


def test_default_stages_pipeline_wide_16_bit_heads_deeper(monkeypatch) -> None:
    """3 stages only for 16-bit heads of 128 (the H200 sweep); what the kernel is given."""
    assert ea.default_stages(jnp.bfloat16, 128) == 3 and ea.default_stages(jnp.float16, 128) == 3
    assert ea.default_stages(jnp.bfloat16, 64) == 2 and ea.default_stages(jnp.float32, 128) == 2
    seen = []
    real = ea._extend
    monkeypatch.setattr(ea, "_extend", lambda *a, **kw: seen.append(kw["num_stages"]) or real(
        *a, **kw))
    run_extend(11, [(5, 3)], 4, jnp.bfloat16, heads=2, kv_heads=1, dim=128)
    run_extend(11, [(5, 3)], 4, jnp.bfloat16, heads=2, kv_heads=1, dim=128, num_stages=2)
    assert seen == [3, 2]
