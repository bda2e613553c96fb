"""The new tokens' attention among themselves: the reference against a per-request numpy softmax,
cuDNN against the reference (GPU), and the policy that hands long batches to it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jhicache.pallas_kernels import fresh_attention as fa
from jhicache.pallas_kernels.tuning import KernelTuning

from tests.kernels.helpers import rand


def _batch(rng, lens, pad_rows, heads, kv_heads, dim, dtype):
    """Requests of `lens` new tokens back to back (0: a request without any), then padding rows."""
    lens = np.asarray(lens, np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    rows = int(lens.sum()) + pad_rows
    q, k, v = (jnp.asarray(rand(rng, (rows, h, dim), np.float32) - 3.0).astype(dtype)
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, jnp.asarray(starts), jnp.asarray(lens)


def _naive(q, k, v, starts, lens, scale):
    """Per request, per head: a causal softmax in float64; (out, base-2 lse) of the live rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for s, n in zip(np.asarray(starts), np.asarray(lens)):
        for h in range(q.shape[1] if n else 0):
            scores = q[s:s + n, h] @ k[s:s + n, h // group].T * scale
            scores[np.triu_indices(n, 1)] = -np.inf
            top = scores.max(axis=1, keepdims=True)
            p = np.exp(scores - top)
            out[s:s + n, h] = p @ v[s:s + n, h // group] / p.sum(axis=1, keepdims=True)
            lse[s:s + n, h] = (top[:, 0] + np.log(p.sum(axis=1))) / np.log(2)
    return out, lse


def _live_rows(starts, lens):
    return np.concatenate([np.arange(s, s + n) for s, n in zip(np.asarray(starts),
                                                              np.asarray(lens))]).astype(int)


@pytest.mark.parametrize("lens,pad_rows", [([9, 0, 14, 1], 3), ([20], 0), ([5, 7, 0], 2)])
def test_reference_matches_a_per_request_softmax(lens, pad_rows):
    rng = np.random.default_rng(len(lens))
    q, k, v, starts, qlens = _batch(rng, lens, pad_rows, 6, 2, 16, np.float32)
    out, lse = fa.fresh_attention_reference(q, k, v, starts, qlens, sm_scale=0.3)
    want_out, want_lse = _naive(q, k, v, starts, qlens, 0.3)
    live = _live_rows(starts, qlens)
    np.testing.assert_allclose(np.asarray(out)[live], want_out[live], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], want_lse[live], rtol=2e-5, atol=2e-5)


def test_row_segments_skip_requests_without_rows():
    """cuDNN numbers only the requests that have rows: a row's statistics are at (its request's
    rank among those, its row within the request); padding rows clamp into range."""
    starts, lens = jnp.array([0, 3, 3, 5], jnp.int32), jnp.array([3, 0, 2, 0], jnp.int32)
    seg, local = fa._row_segments(starts, lens, 7)
    assert np.asarray(seg).tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert np.asarray(local).tolist() == [0, 1, 2, 0, 1, 1, 1]


def test_request_order_is_checked():
    fa.check_request_order(np.array([0, 4, 4, 9]), np.array([4, 0, 5, 0]))
    with pytest.raises(ValueError, match="request order"):
        fa.check_request_order(np.array([4, 0]), np.array([3, 4]))
    with pytest.raises(ValueError, match="request order"):
        fa.check_request_order(np.array([0, 2]), np.array([3, 4]))
    with pytest.raises(ValueError, match="row 0"):
        fa.check_request_order(np.array([2]), np.array([3]))


def test_policy_needs_cudnn_16_bit_and_a_long_batch(monkeypatch):
    """Off on the CPU; on a cuDNN GPU, for 16-bit batches of fresh_apart_tokens rows or more."""
    tuning = KernelTuning(num_sms=132)
    assert not fa.attend_fresh_apart(1 << 20, jnp.bfloat16, tuning) or fa.cudnn_available()
    monkeypatch.setattr(fa, "cudnn_available", lambda: True)
    limit = tuning.fresh_apart_tokens
    assert fa.attend_fresh_apart(limit, jnp.bfloat16, tuning)
    assert fa.attend_fresh_apart(limit, jnp.float16, tuning)
    assert not fa.attend_fresh_apart(limit - 1, jnp.bfloat16, tuning)
    assert not fa.attend_fresh_apart(limit, jnp.float32, tuning)
    assert fa.attend_fresh_apart(64, jnp.bfloat16,
                                 dataclasses.replace(tuning, fresh_apart_tokens=64))


@pytest.mark.gpu
@pytest.mark.parametrize("lens,pad_rows", [([700, 0, 333, 1], 5), ([1024], 0), ([64], 64),
                                           ([100, 2000, 57], 0)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(28, 4, 128), (14, 2, 64)])
def test_gpu_cudnn_matches_reference(lens, pad_rows, heads, kv_heads, dim):
    """cuDNN's packed (several requests) and padded (one) layouts, its statistics read back per
    row, against the float32 reference on the same bf16 inputs."""
    if not fa.cudnn_available():
        pytest.skip("no cuDNN flash attention on this GPU")
    rng = np.random.default_rng(sum(lens))
    q, k, v, starts, qlens = _batch(rng, lens, pad_rows, heads, kv_heads, dim, jnp.bfloat16)
    out, lse = fa.fresh_attention(q, k, v, starts, qlens, sm_scale=dim**-0.5)
    want_out, want_lse = fa.fresh_attention_reference(q, k, v, starts, qlens, sm_scale=dim**-0.5)
    live = _live_rows(starts, qlens)
    np.testing.assert_allclose(np.asarray(out, np.float32)[live],
                               np.asarray(want_out, np.float32)[live], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(want_lse)[live], rtol=1e-3,
                               atol=1e-3)
