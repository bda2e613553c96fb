"""CacheTiers.build: the tiers of a page layout in one call, with or without a host tier; bad
sizes refused; DevicePool.update, the way a forward hands its new pages back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.cache import CacheTiers, PoolLayout
from jhicache.config import WritePolicy
from tests.cache._helpers import HEAD_DIM, HEADS, LAYERS, assert_device_kv, prefill

PAGE = 4
LAYOUT = PoolLayout(num_layers=LAYERS, num_pages=5, page_size=PAGE, num_kv_heads=HEADS,
                    head_dim=HEAD_DIM, dtype=jnp.float32)  # as the helpers' KV is shaped


def test_device_only() -> None:
    tiers = CacheTiers.build(LAYOUT)
    assert tiers.host_pool is None and tiers.transfers is None
    assert tiers.device_pool.layout == LAYOUT
    pages = tiers.cache.pages
    assert (pages.device, pages.device_free, pages.host) == (4, 4, 0)  # page 0 is reserved


def test_a_host_tier_takes_evicted_pages_and_loads_them_back() -> None:
    tiers = CacheTiers.build(LAYOUT, host_pages=8, policy="write_back", load_back_threshold=1)
    cache = tiers.cache
    assert tiers.host_pool is not None and tiers.transfers is not None
    assert tiers.host_pool.layout.num_pages == 8 and LAYOUT.same_page_shape(tiers.host_pool.layout)
    assert cache.policy is WritePolicy.WRITE_BACK and cache.pages.host == 8
    tokens = list(range(1, 2 * PAGE + 1))
    prefill(cache, tokens)
    assert cache.evict_device() == 2  # written back to host
    match = cache.match(tokens)
    assert (match.device_len, match.host_len) == (0, len(tokens))
    ticket = cache.load_back(match)
    assert ticket is not None
    with cache.step() as step:
        assert step.start_loads([ticket]) > 0
    cache.flush()
    assert_device_kv(cache, tokens, list(ticket.device_pages))
    cache.check_invariants()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="host_pages"):
        CacheTiers.build(LAYOUT, host_pages=-1)
    with pytest.raises(ValueError, match="host tier"):
        CacheTiers.build(LAYOUT, storage=lambda host_pool: None)  # type: ignore
    with pytest.raises(ValueError, match="num_pages"):
        CacheTiers.build(PoolLayout(LAYERS, 1, PAGE, HEADS, HEAD_DIM))  # page 0 alone


def test_update_stores_layers_from_the_first_and_the_compute() -> None:
    pool = CacheTiers.build(LAYOUT).device_pool
    ones = jnp.ones(LAYOUT.page_shape, jnp.float32)
    pool.update(1, [ones], [2 * ones], compute=ones[0])
    np.testing.assert_array_equal(np.asarray(pool.k[1]), np.asarray(ones))
    np.testing.assert_array_equal(np.asarray(pool.v[1]), np.asarray(2 * ones))
    assert not np.asarray(pool.k[0]).any() and pool.last_compute is not None
    with pytest.raises(ValueError, match="V arrays"):
        pool.update(0, [ones, ones], [ones])
    with pytest.raises(ValueError, match="shape"):
        pool.update(0, [ones[:1]], [ones[:1]])
