"""The engine hooks the server uses: occupancy() (queues, pool pages) and flush_cache()."""

from __future__ import annotations

import pytest

from jhicache import SamplingParams
from tests.test_engine import POOL_TOKENS, make_engine

PROMPT = list(range(1, 70))  # four full pages of 16, and a partial one


@pytest.mark.parametrize("cache_mode", ["device", "hierarchical"])
def test_flush_cache_empties_both_tiers(cache_mode: str):
    engine = make_engine(cache_mode=cache_mode)
    params = SamplingParams(max_new_tokens=2)
    engine.generate([PROMPT], params)
    before = engine.stats()
    engine.generate([PROMPT], params)
    assert engine.stats().device_hit_tokens - before.device_hit_tokens == 64
    if cache_mode == "hierarchical":  # push the prefix to the host tier, so both tiers hold it
        engine.generate([[400 + i % 90 for i in range(340)]], params)
        held = engine.occupancy()
        assert held.host_free_pages < held.host_pages
    assert engine.flush_cache()
    engine.check_invariants()
    occ = engine.occupancy()
    assert occ.device_free_pages == occ.device_pages == POOL_TOKENS // 16
    assert occ.host_free_pages == occ.host_pages
    hits = engine.stats()
    engine.generate([PROMPT], params)  # computed again from scratch: no hit in either tier
    after = engine.stats()
    assert after.device_hit_tokens == hits.device_hit_tokens
    assert after.host_hit_tokens == hits.host_hit_tokens
    assert after.computed_prompt_tokens - hits.computed_prompt_tokens == len(PROMPT)


def test_flush_cache_refused_while_a_request_is_unfinished():
    engine = make_engine()
    engine.generate([PROMPT], SamplingParams(max_new_tokens=2))
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=4))
    assert engine.occupancy().waiting_requests == 1
    assert not engine.flush_cache()
    engine.step()
    engine.step()
    occ = engine.occupancy()
    assert (occ.waiting_requests, occ.running_requests) == (0, 1)
    assert occ.device_free_pages < occ.device_pages
    assert engine.abort(rid)
    assert engine.flush_cache()
    engine.check_invariants()
    assert engine.occupancy().device_free_pages == POOL_TOKENS // 16


def test_occupancy_without_host_tier():
    occ = make_engine(cache_mode="device").occupancy()
    assert (occ.host_pages, occ.host_free_pages) == (0, 0)
    assert occ.device_pages == POOL_TOKENS // 16
