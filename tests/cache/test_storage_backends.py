"""The contract every storage backend keeps, checked on each (`file`, `mooncake` against a real
master): batch exists/get/set in prefix order, stopping at the first gap; a key already stored
is kept; pages round-trip byte for byte between host pages; namespaces never see each other's
pages; clear deletes its namespace's pages only."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.cache import HostPool, PoolLayout
from jhicache.cache.file_storage import FileStorage
from jhicache.cache.page_keys import chain_keys
from jhicache.cache.storage import Storage, StorageNamespace
from tests.mooncake_support import Master, running_master
from tests.waiting import wait_until

PAGE, PAGES = 4, 12
LAYOUT = PoolLayout(3, PAGES, PAGE, 2, 8, jnp.float32)
BIG = PoolLayout(4, PAGES, PAGE, 64, 64, jnp.float32)


def namespace(dtype: str = "float32") -> StorageNamespace:
    return StorageNamespace(model="contract", dtype=dtype, page_size=PAGE, layout="test",
                            page_bytes=LAYOUT.page_bytes)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    with running_master(tmp_path_factory.mktemp("mooncake")) as master:
        yield master


@pytest.fixture(params=["file", "mooncake"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    """A factory of (backend, host pool) pairs over one shared store or directory."""
    made: list[tuple[Storage, HostPool]] = []

    def build(ns: StorageNamespace | None = None, shards: int = 1) -> tuple[Storage, HostPool]:
        pool = HostPool(dataclasses.replace(LAYOUT), shards=shards)
        ns = ns or namespace()
        if request.param == "file":
            storage: Storage = FileStorage(tmp_path, ns, pool.page_views)
        else:
            from jhicache.cache.mooncake_storage import MooncakeStorage

            master = request.getfixturevalue("master")
            storage = MooncakeStorage(ns, pool.page_views, master.config, callers=2)
        made.append((storage, pool))
        return storage, pool

    yield build
    for storage, pool in made:
        storage.clear()
        storage.close()
        pool.close()


def _fill(pool: HostPool, pages: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    data = []
    for page in pages:
        for view in pool.page_views(page):
            view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        data.append(np.concatenate([v.ravel() for v in pool.page_views(page)]))
    return data


def _page(pool: HostPool, page: int) -> np.ndarray:
    return np.concatenate([v.ravel() for v in pool.page_views(page)])


KEYS = chain_keys(list(range(PAGES * PAGE)), PAGE)


def test_pages_round_trip_between_two_clients(make) -> None:
    writer, wpool = make()
    reader, rpool = make()
    data = _fill(wpool, [3, 7, 1], seed=1)
    assert writer.set(KEYS[:3], [3, 7, 1]) == 3
    assert writer.contains(KEYS[0]) and writer.counters().written_pages == 3
    assert reader.exists(KEYS) == 3
    assert reader.get(KEYS[:3], [0, 5, 9]) == 3
    for page, expected in zip([0, 5, 9], data, strict=True):
        np.testing.assert_array_equal(_page(rpool, page), expected)
    assert reader.counters().read_pages == 3


def test_a_batch_stops_at_its_first_gap(make) -> None:
    storage, pool = make()
    _fill(pool, [0, 1, 2], seed=2)
    assert storage.set([KEYS[0], KEYS[1], KEYS[3]], [0, 1, 2]) == 3
    assert storage.exists(KEYS[:5]) == 2
    assert storage.get(KEYS[:5], [4, 5, 6, 7, 8]) == 2
    assert storage.set(KEYS[:2], [0, 1]) == 2  # stored already: kept, not an error


def test_namespaces_never_see_each_others_pages_and_clear_keeps_to_its_own(make) -> None:
    one, pool = make()
    other, other_pool = make(namespace("bfloat16"))
    _fill(pool, [0, 1], seed=3)
    _fill(other_pool, [0], seed=4)
    assert one.set(KEYS[:2], [0, 1]) == 2 and other.set(KEYS[:1], [0]) == 1
    assert other.exists(KEYS[:2]) == 1
    assert one.clear() >= 1 and one.exists(KEYS[:2]) == 0
    assert other.exists(KEYS[:1]) == 1


def test_a_tensor_parallel_pool_stores_every_shard_of_a_page(make) -> None:
    writer, wpool = make(shards=2)
    reader, rpool = make(shards=2)
    data = _fill(wpool, [2], seed=5)
    assert writer.set(KEYS[:1], [2]) == 1 and reader.get(KEYS[:1], [6]) == 1
    np.testing.assert_array_equal(_page(rpool, 6), data[0])


def test_long_batches_from_several_threads_at_once_round_trip(make) -> None:
    """Batches longer than a backend's buffer of pages (Mooncake's holds 8), read by two
    threads at once into pages of their own: every page's bytes as written."""
    writer, wpool = make()
    reader, rpool = make()
    data = _fill(wpool, list(range(PAGES)), seed=6)
    assert writer.set(KEYS[:PAGES], list(range(PAGES))) == PAGES
    spans = [(0, 10), (10, PAGES)]
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        got = list(threads.map(lambda span: reader.get(KEYS[span[0]:span[1]],
                                                       list(range(*span))), spans))
    assert got == [10, PAGES - 10]
    for page in range(PAGES):
        np.testing.assert_array_equal(_page(rpool, page), data[page])


def test_a_full_store_evicts_pages_as_misses_never_wrong_bytes(tmp_path: Path) -> None:
    """Far more pages than the store's memory holds: every page read back is whole and the one
    written under its key; the rest are misses."""
    from jhicache.cache.mooncake_storage import MooncakeStorage

    with running_master(tmp_path) as master:
        pool = HostPool(BIG)  # 256 kB pages
        config = {**master.config, "global_segment_size": 16 << 20}
        ns = dataclasses.replace(namespace(), page_bytes=BIG.page_bytes)
        storage = MooncakeStorage(ns, pool.page_views, config)
        keys = chain_keys(list(range(200 * PAGE)), PAGE)
        assert len(keys) * BIG.page_bytes > 2 * config["global_segment_size"]  # it evicts
        for start in range(0, len(keys), 10):
            _fill(pool, list(range(10)), seed=start)
            storage.set(keys[start:start + 10], list(range(10)))
        served = 0
        for start in range(0, len(keys), 10):
            expected = _fill(pool, list(range(10)), seed=start)  # what was written
            for i in range(10):
                if storage.get([keys[start + i]], [11]) == 1:
                    np.testing.assert_array_equal(_page(pool, 11), expected[i])
                    served += 1
        assert 0 < served < len(keys)
        storage.close()
        pool.close()


class _CountingStore:
    """A Mooncake store whose batch calls are recorded, by name, before they run."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if not name.startswith("batch_"):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return counted


def test_an_unreachable_master_is_not_called_until_it_answers_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """While the store's client sees its master gone, reads are misses and writes failures
    without a call to the store (each would wait out Mooncake's RPC timeout, and a request its
    query), said once in the log; once the master answers again, calls go to it again, and the
    log says so once."""
    from jhicache.cache.mooncake_storage import MooncakeStorage

    caplog.set_level("WARNING", logger="jhicache.storage")
    with running_master(tmp_path) as master:
        pool = HostPool(LAYOUT)
        storage = MooncakeStorage(namespace(), pool.page_views, master.config)
        _fill(pool, [0, 1, 2, 3], seed=5)
        assert storage.set(KEYS[:2], [0, 1]) == 2
        store = storage._store = _CountingStore(storage._store)  # type: ignore[assignment]
        master.stop()
        wait_until(lambda: not storage.reachable())  # the client's own heartbeat notices
        assert storage.set(KEYS[2:4], [2, 3]) == 0
        assert storage.exists(KEYS) == 0 and storage.get(KEYS[:2], [2, 3]) == 0
        assert store.calls == []  # none reached the store
        assert storage.counters().write_failures_io == 1
        master.start()  # a new, empty master on the same ports
        wait_until(storage.reachable)
        # the calls reach the store again (a put fails until the client has mounted its memory
        # in the new master again)
        wait_until(lambda: storage.set(KEYS[2:4], [2, 3]) == 2)
        assert store.calls and set(store.calls) == {"batch_put_from"}
        said = [r.getMessage() for r in caplog.records if r.name == "jhicache.storage"]
        assert said == ["Mooncake store's master unreachable: reads are misses and writes fail "
                        "until it answers again", "Mooncake store's master answers again"]
        storage.close()
        pool.close()


ENV = {"MOONCAKE_MASTER": "master_server_address", "MOONCAKE_TE_META_DATA_SERVER":
       "metadata_server", "MOONCAKE_LOCAL_HOSTNAME": "local_hostname", "MOONCAKE_PROTOCOL":
       "protocol", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size"}


def test_mooncake_takes_its_own_environment_variables_under_the_configs_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's `MOONCAKE_*` variables configure the backend as they do Mooncake's other
    clients (no config given: the store is reached through them alone); a key of the backend's
    config wins over its variable; with neither a master address, a clear error."""
    from jhicache.cache.mooncake_storage import MooncakeStorage, store_config

    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)  # it would win over the rest
    with running_master(tmp_path) as master:
        for variable, name in ENV.items():
            monkeypatch.setenv(variable, str(master.config[name]))
        setup = store_config({"local_buffer_size": 8 << 20})
        assert setup["master_server_addr"] == master.config["master_server_address"]
        assert setup["metadata_server"] == master.config["metadata_server"]
        assert setup["global_segment_size"] == master.config["global_segment_size"]
        assert setup["local_buffer_size"] == 8 << 20
        pool = HostPool(LAYOUT)
        storage = MooncakeStorage(namespace(), pool.page_views, {})
        data = _fill(pool, [0], seed=9)
        assert storage.set(KEYS[:1], [0]) == 1 and storage.get(KEYS[:1], [1]) == 1
        np.testing.assert_array_equal(_page(pool, 1), data[0])
        storage.clear()
        storage.close()
        pool.close()
    for variable in ENV:
        monkeypatch.delenv(variable)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        store_config({})


def test_a_namespace_of_another_page_size_never_sees_the_pages(make) -> None:
    """The same model and dtype at another page size: its keys name other objects, and so
    its reads miss what the first wrote (the digest covers the page size)."""
    one, pool = make()
    other, _ = make(dataclasses.replace(namespace(), page_size=2 * PAGE))
    _fill(pool, [0, 1], seed=10)
    assert one.set(KEYS[:2], [0, 1]) == 2
    assert other.exists(KEYS[:2]) == 0 and other.get(KEYS[:2], [0, 1]) == 0
    assert one.exists(KEYS[:2]) == 2
