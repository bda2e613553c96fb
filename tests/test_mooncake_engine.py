"""The Mooncake storage tier in the engine, against a real master: a conversation one engine
served continues in an engine of another process, its prefixes read from the store, with the
tokens of no cache at all; an engine of another namespace never reads those pages; with the
master gone every engine keeps serving (reads miss, writes fail, counted), and the tier
recovers once it is back."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jhicache import AsyncEngine, Engine, SamplingParams
from jhicache.bench.workload import MultiTurnChats
from jhicache.engine_process import EngineSpec
from tests.mooncake_support import Master, running_master
from tests.test_async_engine import run
from tests.test_engine import (
    SPEC,
    assert_idle_and_consistent,
    make_engine,
    reference_histories,
    run_chats,
)
from tests.waiting import wait_until

RECOVERY_TRIES = 10
STORAGE = dict(write_policy="write_through", host_kv_tokens=1024, fetch_threshold=16,
               fetch_policy="wait_complete", storage_backend="mooncake")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    with running_master(tmp_path) as master:
        yield master


def mooncake_engine(master: Master, **overrides) -> Engine:
    return make_engine(**{**STORAGE, "storage_backend_config": json.dumps(master.config),
                          **overrides})


def run_chats_async(engine: AsyncEngine) -> list[list[int]]:
    chats = MultiTurnChats(SPEC)
    params = SamplingParams(max_new_tokens=SPEC.output_length)
    for _ in range(SPEC.num_rounds):
        outputs = run(lambda: engine.generate(chats.prompts(), params))
        chats.extend([o.token_ids for o in outputs])
    return chats.histories


def test_a_conversation_continues_in_another_process_through_the_store(master: Master) -> None:
    """(The first engine stays up: Mooncake keeps an object in the memory a client contributed
    to the store, so the pages of a closed engine's segment are gone with it.)"""
    first = mooncake_engine(master)
    assert run_chats(first) == reference_histories()
    assert first.flush_cache()  # every backup written; the store keeps the pages
    other = AsyncEngine(EngineSpec(factory=functools.partial(
        make_engine, **STORAGE, storage_backend_config=json.dumps(master.config))))
    try:
        assert run_chats_async(other) == reference_histories()
        stats = other.stats()
        assert stats.storage_hit_tokens > 0 and stats.storage_fetch_full > 0
        assert stats.storage_write_failures_io == 0
    finally:
        other.close(timeout=60)
        first.close()
    assert other.process is not None and other.process.exitcode == 0


def test_another_namespace_never_reads_the_pages(master: Master) -> None:
    first = mooncake_engine(master)
    run_chats(first)
    assert first.flush_cache()
    other = mooncake_engine(master, storage_model_name="another model")
    assert run_chats(other) == reference_histories()
    assert other.stats().storage_hit_tokens == 0
    other.close()
    first.close()


@pytest.mark.slow  # each call to an absent master waits out its timeout
def test_without_the_master_the_engine_serves_and_recovers_when_it_is_back(
        master: Master) -> None:
    engine = mooncake_engine(master, fetch_policy="timeout", fetch_timeout_s=0.5)
    assert engine.stats().storage_reachable == 1
    master.stop()
    wait_until(lambda: engine.stats().storage_reachable == 0)  # the client's heartbeat notices
    assert not engine.clear_storage()  # nothing can be deleted: refused, not "cleared"
    assert run_chats(engine) == reference_histories()  # from the device and host tiers
    engine.flush_cache()  # waits for the backups, which fail
    stats = engine.stats()
    assert stats.storage_hit_tokens == 0 and stats.storage_write_failures_io > 0
    master.start()  # a new, empty master on the same ports: the client mounts again
    for _ in range(RECOVERY_TRIES):  # written again once the store answers
        engine.flush_cache()
        run_chats(engine)
        engine.flush_cache()
        if engine.stats().storage_backup_pages > stats.storage_backup_pages:
            break
        time.sleep(1.0)
    assert engine.stats().storage_backup_pages > stats.storage_backup_pages
    assert engine.stats().storage_reachable == 1 and engine.clear_storage()
    assert_idle_and_consistent(engine)
    engine.close()



def test_the_store_attached_and_detached_at_run_time(master: Master) -> None:
    engine = make_engine(**{**STORAGE, "storage_backend": "file"})  # no storage tier
    assert run_chats(engine) == reference_histories()
    config = engine.set_storage("mooncake", backend_config=json.dumps(master.config))
    assert config.storage_backend.value == "mooncake" and config.storage_enabled
    engine.flush_cache()
    assert run_chats(engine) == reference_histories()
    engine.flush_cache()
    assert engine.stats().storage_backup_pages > 0
    reader = mooncake_engine(master)  # another engine finds them in the store
    assert run_chats(reader) == reference_histories()
    assert reader.stats().storage_hit_tokens > 0
    reader.close()
    assert not engine.set_storage(None).storage_enabled
    assert run_chats(engine) == reference_histories()
    assert_idle_and_consistent(engine)
    engine.close()
