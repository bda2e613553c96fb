"""The storage tier in the engine: a restart on the same directory hits from storage with the
tokens of no cache at all, under each fetch policy (split: computing the head while the tail is
read), bfloat16 pages bit for bit; a clean stop keeps the whole cache whatever the write
policies; damaged pages are recomputed; an abort during a fetch leaks nothing; an unusable
directory is a clear error at start."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest

from jhicache import AsyncEngine, Engine, SamplingParams
from jhicache.bench.workload import MultiTurnChats
from jhicache.cache.page_keys import chain_keys
from jhicache.engine_process import EngineSpec
from tests.test_async_engine import run
from tests.test_engine import (
    SPEC,
    assert_idle_and_consistent,
    make_engine,
    reference_histories,
    run_chats,
)
from tests.waiting import wait_until

STORAGE = dict(write_policy="write_through", host_kv_tokens=1024, fetch_threshold=16,
               fetch_policy="wait_complete")


def storage_engine(root: Path, **overrides) -> Engine:
    return make_engine(storage_dir=str(root), **{**STORAGE, **overrides})


def test_a_restart_hits_from_storage_with_the_tokens_of_no_cache(tmp_path: Path) -> None:
    first = storage_engine(tmp_path)
    assert run_chats(first) == reference_histories()
    assert first.flush_cache()  # waits for the backups; storage keeps its pages
    stats = first.stats()
    assert stats.storage_backup_pages > 0 and stats.storage_pages == stats.storage_backup_pages
    assert stats.storage_hit_tokens == 0
    again = storage_engine(tmp_path)  # a restart: nothing on device or host
    assert run_chats(again) == reference_histories()
    stats = again.stats()
    assert stats.storage_hit_tokens > 0 and stats.storage_fetch_full > 0
    assert stats.storage_read_bytes > 0 and stats.storage_corrupt_pages == 0
    assert stats.storage_backup_pages == 0  # every page was stored before: none planned again
    assert_idle_and_consistent(again)


def test_write_back_to_storage_writes_pages_evicted_from_host(tmp_path: Path) -> None:
    """Pages reach storage when the host tier evicts them (a small host pool), and a restart
    hits them there."""
    first = storage_engine(tmp_path, storage_write_policy="write_back", write_policy="write_back",
                           host_kv_tokens=400)
    assert run_chats(first) == reference_histories()
    assert first.flush_cache()
    stats = first.stats()
    assert stats.evicted_host_tokens > 0 and stats.storage_backup_pages > 0
    assert_idle_and_consistent(first)
    assert first.cache.storage.held_pages() == []  # type: ignore[union-attr]
    assert not first.cache.host.releasing  # type: ignore[union-attr]
    again = storage_engine(tmp_path)
    assert run_chats(again) == reference_histories()
    assert again.stats().storage_hit_tokens > 0


def _rounds(engine: Engine, chats: MultiTurnChats, rounds: int) -> tuple[int, list[list[int]]]:
    """Runs the chats' next `rounds`; the last one's prompt tokens hit (any tier), its tokens."""
    params = SamplingParams(max_new_tokens=SPEC.output_length)
    for _ in range(rounds):
        outputs = engine.generate(chats.prompts(), params)
        chats.extend([o.token_ids for o in outputs])
    hits = sum(o.device_hit_tokens + o.host_hit_tokens + o.storage_hit_tokens for o in outputs)
    return hits, [o.token_ids for o in outputs]


def test_a_clean_stop_keeps_the_cache_with_the_default_write_policies(tmp_path: Path) -> None:
    """The default write policy copies a page to host only when the device evicts it; a clean
    stop (`close`) writes every page only on device (or host) to storage, so that the round
    after a restart hits what it hits on an engine never restarted, with the same tokens."""
    sizes = dict(host_kv_tokens=1024, fetch_threshold=16, fetch_policy="wait_complete")
    straight = make_engine(**sizes)
    hits, tokens = _rounds(straight, MultiTurnChats(SPEC), SPEC.num_rounds)
    assert hits > 0
    first = make_engine(storage_dir=str(tmp_path), **sizes)
    chats = MultiTurnChats(SPEC)
    _rounds(first, chats, SPEC.num_rounds - 1)
    tree, tier = first.cache.tree, first.cache.storage
    assert tier is not None
    device_only = [n for n in tree.nodes() if n.host_pages is None]
    assert device_only  # pages that reached neither host nor storage while it served
    first.close()
    keys = [k for n in tree.nodes() for k in tree.page_keys(n)]
    assert all(tier.storage.contains(k) for k in keys)
    assert first.stats().storage_pages >= len(keys)
    again = make_engine(storage_dir=str(tmp_path), **sizes)
    assert _rounds(again, chats, 1) == (hits, tokens)
    assert again.stats().storage_hit_tokens == hits


def test_close_stores_the_cache_within_its_timeout(tmp_path: Path) -> None:
    """A storage that writes slowly: `close(timeout_s)` stops writing once the time is up
    (within a chunk of pages), and what it wrote is whole."""
    engine = make_engine(storage_dir=str(tmp_path), host_kv_tokens=1024)
    prompt = list(range(1, 20 * 16 + 2))  # twenty whole pages, on device only
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    tier = engine.cache.storage
    assert tier is not None
    set_pages = tier.storage.set

    def slow_set(keys, host_pages):
        time.sleep(0.5)
        return set_pages(keys, host_pages)

    tier.storage.set = slow_set  # type: ignore[method-assign]
    start = time.monotonic()
    engine.close(timeout_s=0.2)
    assert time.monotonic() - start < 5  # the timeout, and the chunk being written
    stored = len(list(tmp_path.rglob("*.kv")))
    assert 0 < stored < 20 and engine.stats().storage_pages == stored
    again = make_engine(storage_dir=str(tmp_path), host_kv_tokens=1024, fetch_threshold=16,
                        fetch_policy="wait_complete")
    output = again.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    assert output.storage_hit_tokens == stored * 16


def test_under_a_storage_cap_close_keeps_the_most_recent_prefixes(tmp_path: Path) -> None:
    """Two prompts of six pages on device, a cap of eight pages: close writes the older first,
    so that the cap's eviction (least recently written first) keeps the newer whole."""
    probe = storage_engine(tmp_path / "probe")
    page_file = probe.cache.storage.storage.page_file_bytes  # type: ignore[union-attr]
    engine = make_engine(storage_dir=str(tmp_path / "capped"), host_kv_tokens=1024,
                         storage_capacity_bytes=8 * page_file)
    older, newer = ([base + i for i in range(6 * 16 + 1)] for base in (1, 200))
    for prompt in (older, newer):
        engine.generate([prompt], SamplingParams(max_new_tokens=1))
    engine.close()
    stored = {p.name for p in (tmp_path / "capped").rglob("*.kv")}
    assert {f"{k.hex()}.kv" for k in chain_keys(newer[:96], 16)} <= stored
    assert len(stored) <= 8


def test_an_engine_process_stores_its_cache_when_closed(tmp_path: Path) -> None:
    """The server's engine process closes its engine at `Close`: the pages of a prompt that
    never left the device (default write policy) are in storage once it has exited."""
    prompt = list(range(1, 3 * 16 + 2))  # three whole pages, then the token left to compute
    engine = AsyncEngine(EngineSpec(factory=functools.partial(
        make_engine, storage_dir=str(tmp_path), host_kv_tokens=1024)))
    try:
        run(lambda: engine.generate([prompt], SamplingParams(max_new_tokens=1)))
        assert engine.stats().storage_pages == 0  # on device only while it serves
    finally:
        engine.close(timeout=60)
    assert engine.process is not None and engine.process.exitcode == 0
    stored = {p.name for p in tmp_path.rglob("*.kv")}
    assert stored >= {f"{k.hex()}.kv" for k in chain_keys(prompt[:48], 16)}


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "split"])
def test_each_fetch_policy_gives_the_tokens_of_no_cache(tmp_path: Path, policy: str) -> None:
    first = storage_engine(tmp_path)
    run_chats(first)
    first.flush_cache()
    again = storage_engine(tmp_path, fetch_policy=policy)
    assert run_chats(again) == reference_histories()
    stats = again.stats()
    assert stats.storage_fetches > 0
    assert stats.storage_fetch_full + stats.storage_fetch_partial + stats.storage_fetch_revoked \
        + stats.storage_fetch_no_host <= stats.storage_fetches
    assert_idle_and_consistent(again)


def test_bfloat16_pages_come_back_from_storage_bit_for_bit(tmp_path: Path) -> None:
    """The GPU's page dtype: one request at a time (no batching to differ), a restart's
    storage hits give the tokens of no cache at all."""
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(100)] for i in range(3)]
    params = SamplingParams(max_new_tokens=8)
    expected = [make_engine(cache_mode="off", dtype="bfloat16").generate([p], params)[0].token_ids
                for p in prompts]
    first = storage_engine(tmp_path, dtype="bfloat16")
    assert [first.generate([p], params)[0].token_ids for p in prompts] == expected
    first.close()
    again = storage_engine(tmp_path, dtype="bfloat16")
    outputs = [again.generate([p], params)[0] for p in prompts]
    assert [o.storage_hit_tokens for o in outputs] == [96] * 3
    assert [o.token_ids for o in outputs] == expected


def test_split_computes_the_head_while_the_tail_is_read(tmp_path: Path) -> None:
    """Split policy, with the reads of the first 8 pages held back: the request computes
    its head, stops where the pages read from the tail begin, and takes those from storage;
    its tokens are those of no cache, and the held-back pages go back to the free list."""
    prompt = list(range(1, 20 * 16 + 2))  # 20 whole pages, then the token left to compute
    params = SamplingParams(max_new_tokens=3)
    expected = make_engine(cache_mode="off").generate([prompt], params)[0].token_ids
    first = storage_engine(tmp_path)
    first.generate([prompt], params)
    first.flush_cache()
    again = storage_engine(tmp_path, fetch_policy="split", chunked_prefill_tokens=64)
    tier = again.cache.storage
    assert tier is not None
    held = 8  # pages
    head = set(chain_keys(prompt[:held * 16], 16))
    release, get = threading.Event(), tier.storage.get

    def held_get(keys, host_pages):  # a read of the first pages waits for the test
        if keys[0] in head:
            release.wait(10)
        return get(keys, host_pages)

    tier.storage.get = held_get  # type: ignore[method-assign]
    rid = again.add_request(prompt, params)
    again.step()  # admitted at once: computes [0, 64) while storage is asked
    (req,) = again.scheduler.running
    fetch = again.cache.fetches.in_flight(req.request_id)
    assert fetch is not None
    wait_until(lambda: fetch.queried)
    again.step()  # the reads start, last chunk first; computes [64, 128)
    wait_until(lambda: fetch.tail_completed == 20 - held)
    outputs = []  # it meets the pages read at 128, takes them, computes the last token
    for _ in range(20):
        outputs += again.step()
        if any(o.finished for o in outputs):
            break
    (output,) = [o for o in outputs if o.request_id == rid and o.finished]
    assert [t for o in outputs if o.request_id == rid for t in o.new_token_ids] == expected
    assert (output.device_hit_tokens, output.host_hit_tokens) == (0, 0)
    assert output.storage_hit_tokens == (20 - held) * 16
    release.set()
    wait_until(lambda: fetch.finished)
    again.step()  # frees the held-back pages
    assert tier.held_pages() == []
    assert_idle_and_consistent(again)


@pytest.mark.parametrize("policy", ["wait_complete", "split"])
def test_damaged_pages_are_recomputed_not_served(tmp_path: Path, policy: str) -> None:
    first = storage_engine(tmp_path)
    run_chats(first)
    first.flush_cache()
    pages = sorted(first.cache.storage.storage.dir.glob("*.kv"))  # type: ignore[union-attr]
    for i, page in enumerate(pages):
        data = bytearray(page.read_bytes())
        if i % 3 == 0:
            page.write_bytes(data[:-7])  # truncated
        elif i % 3 == 1:
            data[-3] ^= 1  # a flipped bit
            page.write_bytes(data)
    again = storage_engine(tmp_path, fetch_policy=policy)
    assert run_chats(again) == reference_histories()
    stats = again.stats()
    assert stats.storage_truncated_pages + stats.storage_corrupt_pages > 0
    assert_idle_and_consistent(again)


@pytest.mark.parametrize("policy", ["wait_complete", "split"])
def test_an_abort_during_a_fetch_leaks_nothing(tmp_path: Path, policy: str) -> None:
    first = storage_engine(tmp_path)
    prompt = list(range(1, 130))
    first.generate([prompt], SamplingParams(max_new_tokens=2))
    first.flush_cache()
    again = storage_engine(tmp_path, fetch_policy=policy, chunked_prefill_tokens=32)
    tier = again.cache.storage
    assert tier is not None
    release, get = threading.Event(), tier.storage.get

    def held_get(keys, host_pages):  # every read waits for the abort (a fetch in flight)
        release.wait(10)
        return get(keys, host_pages)

    tier.storage.get = held_get  # type: ignore[method-assign]
    rid = again.add_request(prompt, SamplingParams(max_new_tokens=2))
    again.step()  # the request asks storage for its pages and waits (split: computes meanwhile)
    fetches = again.cache.fetches
    running = [r for r in again.scheduler.running if fetches.gate(r.request_id).stop is not None]
    waiting = [r for r in again.scheduler.waiting if fetches.gate(r.request_id).wait]
    assert waiting if policy == "wait_complete" else running
    assert again.abort(rid)
    outputs = again.drain()
    assert [o.finish_reason for o in outputs] == ["abort"]
    release.set()
    again.cache.flush(backups=True)  # the held reads end; their pages go back to the free list
    for _ in range(3):  # the read threads end; their pages go back to the free list
        again.cache.fetches.wait(1.0)
        again.step()
    assert_idle_and_consistent(again)
    assert again.cache.storage.held_pages() == []  # type: ignore[union-attr]
    assert again.generate([prompt], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"


def test_close_writes_the_backups_stops_the_threads_and_ends_the_engine(tmp_path: Path) -> None:
    before = set(threading.enumerate())  # (engines of other tests may keep theirs)
    engine = storage_engine(tmp_path)
    rid = engine.add_request(list(range(1, 100)), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="unfinished"):
        engine.close()
    engine.abort(rid)
    engine.drain()
    engine.generate([list(range(1, 100))], SamplingParams(max_new_tokens=2))
    engine.close()
    engine.close()  # idempotent
    assert not [t for t in set(threading.enumerate()) - before
                if t.name.startswith("jhicache-storage")]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    again = storage_engine(tmp_path)  # what it wrote is there
    assert again.generate([list(range(1, 100))], SamplingParams(max_new_tokens=2))
    assert again.stats().storage_hit_tokens > 0


def test_an_unusable_storage_directory_is_a_clear_error_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="not writable"):
        storage_engine(blocker / "storage")
    with pytest.raises(ValueError, match="hierarchical"):
        make_engine(storage_dir=str(tmp_path), cache_mode="device")


def test_clear_storage_deletes_the_pages_and_flush_cache_keeps_them(tmp_path: Path) -> None:
    first = storage_engine(tmp_path)
    run_chats(first)
    assert first.flush_cache() and first.stats().storage_pages > 0  # flush keeps storage
    assert first.clear_storage()
    assert first.stats().storage_pages == 0 and not list(tmp_path.rglob("*.kv"))
    again = storage_engine(tmp_path)
    assert run_chats(again) == reference_histories()
    assert again.stats().storage_hit_tokens == 0 and again.stats().storage_backup_pages > 0
    rid = again.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert not again.clear_storage()  # refused while a request is unfinished
    again.abort(rid)
    again.drain()
    assert again.clear_storage() and make_engine().clear_storage()  # no storage: nothing to do


def test_a_page_evicted_from_storage_is_written_again(tmp_path: Path) -> None:
    """Under a cap, pages leave storage; a later write of the same prefix stores them again
    (what this process planned before does not count as stored)."""
    probe = storage_engine(tmp_path / "probe")
    page_file = probe.cache.storage.storage.page_file_bytes  # type: ignore[union-attr]
    engine = storage_engine(tmp_path / "capped", storage_capacity_bytes=8 * page_file)
    prompt = list(range(1, 6 * 16 + 2))  # six whole pages, then the token left to compute
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    engine.flush_cache()
    stats = engine.stats()
    assert stats.storage_backup_pages == 6 and stats.storage_pages == 6
    for i in range(3):  # other prompts push the first out of storage
        engine.generate([[500 - i] * (6 * 16 + 1)], SamplingParams(max_new_tokens=1))
        engine.flush_cache()
    assert engine.stats().storage_evicted_pages >= 6
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    engine.flush_cache()
    assert engine.cache.storage.storage.exists(  # type: ignore[union-attr]
        chain_keys(prompt[:96], 16)) == 6


def test_a_tier_detached_and_attached_while_requests_are_served(tmp_path: Path) -> None:
    """Detached while a request waits on its read (held back): the read ends with what it
    had and the request is served with the tokens of no cache; a tier attached again (another
    directory) takes the pages written after it; every page is accounted for throughout."""
    prompt, params = list(range(1, 130)), SamplingParams(max_new_tokens=3)
    expected = make_engine(cache_mode="off").generate([prompt], params)[0].token_ids
    first = storage_engine(tmp_path / "a")
    first.generate([prompt], params)
    first.close()
    again = storage_engine(tmp_path / "a", chunked_prefill_tokens=32)
    tier = again.cache.storage
    assert tier is not None
    release, get = threading.Event(), tier.storage.get

    def held_get(keys, host_pages):  # the reads wait until the detach has begun
        release.wait(10)
        return get(keys, host_pages)

    tier.storage.get = held_get  # type: ignore[method-assign]
    rid = again.add_request(prompt, params)
    again.step()
    assert again.cache.fetches.gate(rid).wait
    threading.Timer(0.2, release.set).start()
    assert not again.set_storage(None).storage_enabled
    outputs = []
    while again.has_unfinished():
        outputs += again.step()
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert_idle_and_consistent(again)
    config = again.set_storage("file", storage_dir=str(tmp_path / "b"))
    assert config.storage_dir == str(tmp_path / "b") and again.config == config
    again.generate([prompt[:64] + [7] * 80], params)
    again.close()
    assert list((tmp_path / "b").rglob("*.kv"))


def test_a_bad_storage_setting_at_run_time_changes_nothing(tmp_path: Path) -> None:
    engine = storage_engine(tmp_path)
    for bad in (dict(backend="file"), dict(backend="s3", storage_dir=str(tmp_path)),
                dict(backend=None, storage_dir=str(tmp_path)),
                dict(backend="mooncake", backend_config="[1]")):
        with pytest.raises(ValueError):
            engine.set_storage(**bad)
    assert engine.config.storage_dir == str(tmp_path) and engine.cache.storage is not None
    assert run_chats(engine) == reference_histories()
    engine.close()


def _finish(engine: Engine) -> list:
    """Steps `engine` until no request is unfinished; the outputs."""
    outputs: list = []
    while engine.scheduler.waiting or engine.scheduler.running:
        outputs += engine.step()
    return outputs + engine.drain()


def _held_exists(engine: Engine) -> threading.Event:
    """Makes the storage tier's queries wait until the returned event is set."""
    tier = engine.cache.storage
    assert tier is not None
    release, exists = threading.Event(), tier.storage.exists

    def held(keys):
        release.wait(10)
        return exists(keys)

    tier.storage.exists = held  # type: ignore[method-assign]
    return release


def test_a_query_in_flight_holds_no_cached_prefix(tmp_path: Path) -> None:
    """Most queries find nothing: while storage answers, the request's cached prefix stays
    evictable for the other requests' loads, and the read takes its prefix only once the
    answer says there are pages to read."""
    prefix = list(range(1, 5 * 16 + 2))  # 5 whole pages, then a token left to compute
    params = SamplingParams(max_new_tokens=2)
    engine = storage_engine(tmp_path)
    engine.generate([prefix], params)
    release = _held_exists(engine)
    engine.add_request(prefix[:-1] + list(range(200, 500)), params)
    engine.step()  # asks storage, waits for the answer
    fetch = engine.cache.fetches.in_flight(engine.scheduler.waiting[0].request_id)
    assert fetch is not None and not fetch.queried
    match = engine.cache.match(prefix[:-1])
    assert match.device_len == 5 * 16 and match.last_device_node.lock_count == 0
    assert engine.cache.pages.device_available == engine.cache.pages.device
    release.set()
    _finish(engine)
    assert_idle_and_consistent(engine)


def _stored_with_head_cached(tmp_path: Path) -> tuple[Engine, list[int], SamplingParams,
                                                          list[int]]:
    """A prompt of 20 whole pages (and a token left to compute) stored by one engine, and a
    second engine on the same directory with its first 5 pages cached (read back from storage):
    (that engine, the prompt, its sampling params, its tokens with no cache)."""
    prompt = list(range(1, 20 * 16 + 2))
    params = SamplingParams(max_new_tokens=3)
    expected = make_engine(cache_mode="off").generate([prompt], params)[0].token_ids
    first = storage_engine(tmp_path)
    first.generate([prompt], params)
    first.flush_cache()
    again = storage_engine(tmp_path)
    again.generate([prompt[:5 * 16 + 1]], SamplingParams(max_new_tokens=1))
    return again, prompt, params, expected


def test_a_prefix_evicted_while_storage_answers_ends_the_read_revoked(tmp_path: Path) -> None:
    """The found pages would hang under a prefix that left the cache during the query: the read
    ends (revoked), nothing is read, and the request computes its prompt as with no cache."""
    again, prompt, params, expected = _stored_with_head_cached(tmp_path)
    before = again.stats()
    release = _held_exists(again)
    rid = again.add_request(prompt, params)
    again.step()  # asks storage for pages 5.. and waits for the answer
    fetch = again.cache.fetches.in_flight(rid)
    assert fetch is not None and fetch.first_page == 5
    assert again.cache.clear() > 0  # the prefix leaves both tiers meanwhile
    release.set()
    wait_until(lambda: fetch.queried)
    outputs = _finish(again)
    (output,) = [o for o in outputs if o.request_id == rid and o.finished]
    assert [t for o in outputs if o.request_id == rid for t in o.new_token_ids] == expected
    assert output.storage_hit_tokens == 0
    stats = again.stats()
    assert stats.storage_fetch_revoked - before.storage_fetch_revoked == 1
    assert stats.storage_fetched_pages == before.storage_fetched_pages
    assert_idle_and_consistent(again)


def test_a_read_past_a_cached_prefix_asks_for_the_right_pages(tmp_path: Path) -> None:
    """A request whose first pages are cached reads the rest from storage: their keys chain
    from the cached prefix's last one (kept by the tree), so storage finds them."""
    again, prompt, params, expected = _stored_with_head_cached(tmp_path)
    (output,) = again.generate([prompt], params)
    assert output.token_ids == expected
    assert output.device_hit_tokens == 5 * 16 and output.storage_hit_tokens == 15 * 16
    assert_idle_and_consistent(again)
