"""Scheduler decisions (admission, chunking, decode, retraction, page hand-off) on a real tiny
cache and no model: batches are planned and committed by hand, with a fake forward's tokens."""

from __future__ import annotations

import numpy as np

from jhicache.batch import Batch
from jhicache.cache import PrefixCache
from jhicache.config import EngineConfig
from jhicache.request import FinishReason, Request, RequestStatus
from jhicache.sampling import SamplingParams
from jhicache.scheduler import Scheduler
from tests.cache._helpers import make_cache

PAGE = 4


def make_scheduler(device_pages: int, budget: int,
                   cache_mode: str = "device") -> tuple[Scheduler, PrefixCache]:
    config = EngineConfig(page_size=PAGE, cache_mode=cache_mode, chunked_prefill_tokens=budget)
    cache = make_cache(PAGE, device_pages=device_pages, host_pages=None)
    return Scheduler(config, cache), cache


def request(tag: int, prompt_len: int, max_new_tokens: int) -> Request:
    """A prompt of `prompt_len` tokens; requests of one tag share their prompt's prefix."""
    prompt = [1000 * tag + i for i in range(prompt_len)]
    return Request(f"r{tag}", prompt, SamplingParams(max_new_tokens=max_new_tokens),
                   arrival_s=0.0)


def fake_forward(batch: Batch) -> np.ndarray:
    """A 'model' whose next token depends on the sequence position only (so a recomputed
    request samples what it sampled before); rows that sample nothing get garbage."""
    return np.array([c.start + c.length if c.samples_token else -1 for c in batch.chunks])


def step(sched: Scheduler, cache: PrefixCache) -> Batch | None:
    """One lock-step engine step without a model; checks the page accounting after it."""
    batch = sched.schedule()
    if batch is not None:
        assert batch.num_tokens <= sched.config.chunked_prefill_tokens
        sched.commit(batch, fake_forward(batch), now=1.0)
    cache.check_invariants(extra_owned_device_pages=sched.owned_device_pages())
    return batch


def test_chunked_prefill_then_decode_then_pages_to_the_cache() -> None:
    sched, cache = make_scheduler(device_pages=16, budget=8)
    a, b = request(1, 10, 2), request(2, 6, 2)
    sched.add(a)
    sched.add(b)

    first = step(sched, cache)  # a's first 8 tokens fill the budget: b waits
    assert first is not None and not first.is_decode
    assert [(c.request, c.start, c.length, c.samples_token) for c in first.chunks] == [
        (a, 0, 8, False)]
    assert a.output == [] and list(sched.waiting) == [b]

    second = step(sched, cache)  # a's last 2 tokens, then b admitted into the 6 left
    assert second is not None and not second.is_decode
    assert [(c.request, c.start, c.length, c.samples_token) for c in second.chunks] == [
        (a, 8, 2, True), (b, 0, 6, True)]
    assert (a.output, b.output) == ([10], [6])
    assert a.status is b.status is RequestStatus.DECODING

    late = request(3, 4, 1)
    sched.add(late)
    prefill_first = step(sched, cache)  # a prompt waiting beats the decoders (TTFT)
    assert prefill_first is not None and not prefill_first.is_decode
    assert [c.request for c in prefill_first.chunks] == [late] and late.finished

    third = step(sched, cache)  # one decode step finishes both (max_new_tokens=2)
    assert third is not None and third.is_decode
    assert [(c.request, c.start, c.length) for c in third.chunks] == [(a, 10, 1), (b, 6, 1)]
    assert (a.output, b.output) == ([10, 11], [6, 7])
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert not sched.has_work() and step(sched, cache) is None

    # Every page is back: free, or cached (a's 2 full pages of KV, b's 1, late's 1), none held.
    assert a.device_pages == b.device_pages == [] and sched.owned_device_pages() == []
    assert cache.device.evictable_pages == 4
    assert cache.device.num_free + cache.device.evictable_pages == cache.device.capacity

    again = request(1, 10, 1)  # the same prompt: its first 8 tokens are a device hit
    sched.add(again)
    hit = step(sched, cache)
    assert hit is not None and [(c.start, c.length) for c in hit.chunks] == [(8, 2)]
    assert again.device_hit_tokens == 8 and sched.counters["device_hit_tokens"] == 8
    assert again.finished and cache.device.evictable_pages == 4


def test_decode_short_of_pages_retracts_the_newest_and_recomputes_it() -> None:
    # 4 pages, a and b 2 each: when a needs a third, the newest decoder (b) gives its pages up.
    sched, cache = make_scheduler(device_pages=4, budget=16, cache_mode="off")
    a, b = request(1, 6, 4), request(2, 6, 4)
    sched.add(a)
    sched.add(b)
    admitted = step(sched, cache)
    assert admitted is not None and [c.request for c in admitted.chunks] == [a, b]
    for _ in range(2):  # positions 6 and 7: still in each one's second page
        decode = step(sched, cache)
        assert decode is not None and decode.is_decode and len(decode.chunks) == 2

    crossing = step(sched, cache)  # position 8 is in a third page
    assert crossing is not None and [c.request for c in crossing.chunks] == [a]
    assert sched.counters["retracted_requests"] == 1
    assert list(sched.waiting) == [b] and b.device_pages == [] and b.output == [6, 7, 8]
    assert a.finished  # its 4th token: a's pages are free again

    readmitted = step(sched, cache)  # b's prompt and output so far recomputed, output kept
    assert readmitted is not None and not readmitted.is_decode
    assert [(c.request, c.start, c.length) for c in readmitted.chunks] == [(b, 0, 9)]
    assert a.output == b.output == [6, 7, 8, 9] and not sched.has_work()
    assert cache.device.num_free == cache.device.capacity


def test_a_running_requests_prompt_pages_are_cached_for_others_and_counted_once() -> None:
    """Once a request's prefill step is committed, its prompt's full pages are the cache's (as
    SGLang caches unfinished requests): a request with the same prompt hits them while the first
    still decodes, and the first's end counts no second hit on them."""
    sched, cache = make_scheduler(device_pages=16, budget=16)
    a = request(1, 10, 6)
    sched.add(a)
    step(sched, cache)  # a's prompt: its 2 full pages to the cache, the partial third its own
    assert a.status is RequestStatus.DECODING and a.shared_len == 8
    assert cache.match(a.tokens[:8]).device_pages == a.device_pages[:2]
    assert sched.owned_device_pages() == a.device_pages[2:]

    twin = request(1, 10, 1)
    sched.add(twin)
    hit = step(sched, cache)  # the twin's prompt first (TTFT): 8 of its 10 tokens cached
    assert hit is not None and [(c.request, c.start, c.length) for c in hit.chunks] == [
        (twin, 8, 2)]
    assert twin.finished and twin.device_hit_tokens == 8 and not a.finished
    while sched.has_work():
        step(sched, cache)
    assert a.output == [10, 11, 12, 13, 14, 15]
    # a's insert while running counted it (1), the twin's reuse (2), a's end none
    assert cache.match(a.tokens[:8]).last_device_node.hit_count == 2
    assert cache.device.num_free + cache.device.evictable_pages == cache.device.capacity


def test_a_retracted_request_reuses_the_pages_it_cached_without_counting_them_as_hits() -> None:
    """Retracted after its first chunk, a request finds the pages that chunk cached still in the
    cache: it computes them no more, and they are no device hit (it computed them)."""
    sched, cache = make_scheduler(device_pages=16, budget=8)
    a = request(1, 20, 2)
    sched.add(a)
    step(sched, cache)  # a's first 8 tokens: 2 full pages to the cache, held by its lock
    assert a.shared_len == 8 and a.status is RequestStatus.PREFILLING
    sched.retract(a)
    resumed = step(sched, cache)
    assert resumed is not None and [(c.request, c.start, c.length) for c in resumed.chunks] == [
        (a, 8, 8)]
    assert a.device_hit_tokens == 0 and sched.counters["device_hit_tokens"] == 0
    while sched.has_work():
        step(sched, cache)
    assert a.output == [20, 21]


def test_a_node_cached_again_by_another_request_is_a_hit_for_a_retracted_one() -> None:
    """The pages a retracted request cached are evicted and cached again by another request:
    matched on re-admission, they are that other request's pages, so a hit, counted."""
    sched, cache = make_scheduler(device_pages=16, budget=8)
    a = request(1, 20, 1)
    sched.add(a)
    step(sched, cache)  # a caches its first 2 pages
    sched.retract(a)
    sched.waiting.remove(a)  # held back while its pages leave the cache
    cache.evict_device()
    twin = request(1, 8 + 1, 1)  # caches a's first 8 tokens again
    sched.add(twin)
    while sched.has_work():
        step(sched, cache)
    node = cache.match(a.tokens[:8]).last_device_node
    assert node.hit_count == 1 and twin.finished
    sched.waiting.appendleft(a)
    step(sched, cache)
    assert a.device_hit_tokens == 8 and sched.counters["device_hit_tokens"] == 8
    while sched.has_work():
        step(sched, cache)
    assert node.hit_count == 2  # a's end counted its hit on the twin's node
