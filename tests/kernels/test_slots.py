"""alloc_extend / alloc_decode slot arithmetic against the plain-Python references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jhicache.pallas_kernels.slots import (
    alloc_decode_reference,
    alloc_decode_slots,
    alloc_extend_reference,
    alloc_extend_slots,
    new_page_counts,
)


def _last_locs(rng, prefix_lens, page_size, num_pages):
    """A consistent last_loc per request: (last_loc + 1) % P == p % P, on a page of its own."""
    pages = rng.permutation(num_pages)[: len(prefix_lens)]
    return np.array([pg * page_size + (p - 1) % page_size if p else -1 for pg, p in zip(pages, prefix_lens)],
                    np.int32)


@settings(max_examples=15, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 150)), max_size=5),
       page_size=st.sampled_from([1, 4, 16, 64]), pad=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_alloc_extend_matches_reference(reqs, page_size, pad, seed):
    rng = np.random.default_rng(seed)
    prefix = np.array([p for p, _ in reqs], np.int32)
    seq = prefix + np.array([n for _, n in reqs], np.int32)
    last = _last_locs(rng, prefix, page_size, 1000)
    free = rng.permutation(np.arange(1000, 2000)).astype(np.int32)
    want, used = alloc_extend_reference(prefix, seq, last, free, page_size)
    slots, got_used = alloc_extend_slots(jnp.asarray(prefix), jnp.asarray(seq), jnp.asarray(last), jnp.asarray(free),
                                         page_size=page_size, num_tokens=len(want) + pad)
    assert np.asarray(slots).tolist() == want + [-1] * pad
    assert int(got_used) == used == int(np.asarray(new_page_counts(prefix, seq, page_size)).sum())


def test_alloc_extend_examples():
    # page 4: request 0 has 6 cached (last slot 21 -> page 5, offset 1), adds 5: 22, 23, then page 9.
    # request 1 has no prefix, adds 5: page 2 whole, then page 7's head.
    slots, used = alloc_extend_slots(jnp.array([6, 0]), jnp.array([11, 5]), jnp.array([21, -1]),
                                     jnp.array([9, 2, 7, 3]), page_size=4, num_tokens=10)
    assert np.asarray(slots).tolist() == [22, 23, 36, 37, 38, 8, 9, 10, 11, 28] and int(used) == 3


def test_alloc_extend_page_size_one_and_empty():
    slots, used = alloc_extend_slots(jnp.array([3, 0]), jnp.array([5, 2]), jnp.array([40, -1]),
                                     jnp.array([7, 8, 9, 10]), page_size=1, num_tokens=4)
    assert np.asarray(slots).tolist() == [7, 8, 9, 10] and int(used) == 4
    slots, used = alloc_extend_slots(jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32),
                                     jnp.array([1], jnp.int32), page_size=16, num_tokens=3)
    assert np.asarray(slots).tolist() == [-1, -1, -1] and int(used) == 0


@settings(max_examples=12, deadline=None)
@given(seq=st.lists(st.integers(1, 200), min_size=1, max_size=6), page_size=st.sampled_from([1, 16, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_alloc_decode_matches_reference(seq, page_size, seed):
    rng = np.random.default_rng(seed)
    seq = np.array(seq, np.int32)
    last = _last_locs(rng, seq - 1, page_size, 1000)
    free = rng.permutation(np.arange(1000, 1100)).astype(np.int32)
    want, used = alloc_decode_reference(seq, last, free, page_size)
    slots, got_used = alloc_decode_slots(jnp.asarray(seq), jnp.asarray(last), jnp.asarray(free), page_size=page_size)
    assert np.asarray(slots).tolist() == want and int(got_used) == used
