"""TransferController and LoadTicket with the real page-copy kernels (interpret mode on CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from jhicache.cache import TransferController
from jhicache.cache.transfer import default_copy_fns
from jhicache.config import WritePolicy
from tests.cache._helpers import assert_device_kv, expected_kv, make_cache, prefill, write_kv


def _controller_round_trip() -> None:
    cache = make_cache(4, device_pages=6, host_pages=6, copy_fns=default_copy_fns())
    ctl = cache.controller
    assert isinstance(ctl, TransferController)
    a, b = list(range(8)), list(range(100, 108))
    pages = cache.alloc_device(4)
    assert pages is not None
    write_kv(cache, a, pages[:2])
    write_kv(cache, b, pages[2:])
    ctl.queue_write_back(pages[:2], [4, 5])
    ctl.queue_write_back(pages[2:], [0, 1])
    assert ctl.poll() == [] and ctl.num_queued() == 2
    ctl.launch()
    assert ctl.counters["write_back_launches"] == 1 and ctl.counters["write_back_ops"] == 2  # merged
    done = ctl.flush()
    assert [op.kind.value for op in done] == ["write_back", "write_back"]
    for layer in range(2):
        k, _ = cache.host_pool.read_pages(layer, [4, 5, 0, 1])
        np.testing.assert_array_equal(k[:2], expected_kv(a, layer, 4)[0])
        np.testing.assert_array_equal(k[2:], expected_kv(b, layer, 4)[0])
    ticket = ctl.queue_load_back([0, 1, 4, 5], pages)
    with pytest.raises(RuntimeError, match="not launched"):
        ticket.wait(0)
    assert not ticket.done()
    ctl.launch()
    ticket.wait(0)
    with pytest.raises(ValueError):
        ticket.wait(2)
    ticket.wait_all()
    assert ticket.done() and [op.op_id for op in ctl.poll()] == [ticket.op_id]
    assert_device_kv(cache, b, pages[:2])
    assert_device_kv(cache, a, pages[2:])


def _cache_round_trip(policy: WritePolicy) -> None:
    cache = make_cache(16, device_pages=4, host_pages=8, policy=policy, copy_fns=default_copy_fns())
    prompts = [[t * 1000 + i for i in range(32)] for t in range(3)]
    for tokens in prompts:
        prefill(cache, tokens)
        prefill(cache, tokens)
        cache.check_invariants()
    m = cache.match(prompts[0])
    assert m.host_len == 32
    ticket = cache.load_back(m)
    assert ticket is not None
    cache.launch()
    for layer in range(ticket.num_layers):
        ticket.wait(layer)
    cache.flush()
    assert_device_kv(cache, prompts[0], list(ticket.device_pages))
    cache.check_invariants()


def test_controller_merges_launches_and_reports_completion() -> None:
    _controller_round_trip()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_cache_round_trip_with_real_kernels(policy: WritePolicy) -> None:
    _cache_round_trip(policy)


def test_ticket_readiness_survives_donation_of_its_outputs() -> None:
    """After the forward donated the load's output, readiness comes from the pool's newer array."""
    cache = make_cache(4, device_pages=2, host_pages=4, load_back_threshold=0)
    a, b = list(range(8)), list(range(50, 58))
    prefill(cache, a)
    prefill(cache, b)
    prefill(cache, list(range(90, 98)))  # a and b now on host only
    ticket = cache.load_back(cache.match(b))
    assert ticket is not None
    cache.launch()
    write_kv(cache, a[:4], [0])  # a 'forward' donating every layer's arrays (writes the sink page 0)
    ticket.wait(1)
    assert ticket.done()
    cache.poll()
    assert cache.stats()["loads_in_flight"] == 0


@pytest.mark.gpu
def test_gpu_controller_round_trip() -> None:
    _controller_round_trip()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_gpu_cache_round_trip(policy: WritePolicy) -> None:
    _cache_round_trip(policy)
