"""benchmarks/head_rows_probe.py's fused Pallas kernel (the head's product folded into a running
logsumexp, max and target logit) against the engine's reduction of the product's logits, on
fresh random rows (the kernel in interpret mode here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scripts import load_script

probe = load_script("benchmarks/head_rows_probe.py")


@pytest.mark.parametrize("splits", [1, 2])
def test_fused_head_reduction_equals_the_engines_on_random_rows(splits: int) -> None:
    rng = np.random.default_rng(splits)
    rows, hidden, vocab = 64, 128, 512
    x = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(hidden, vocab)) * 0.2, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
    got = probe.fused(x, w, targets, bm=32, bn=128, bk=64, splits=splits, warps=4, stages=2)
    want = probe.blocks(x, w, targets, block=32, reduce=probe.one_pass)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    full = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)  # and against the logits as such
    lse = jax.nn.logsumexp(full, axis=-1)
    np.testing.assert_array_equal(np.asarray(got[2])[:, 0], np.asarray(jnp.argmax(full, -1)))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(
        full[jnp.arange(rows), targets] - lse), rtol=1e-4, atol=1e-4)
