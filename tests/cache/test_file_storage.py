"""Page keys and FileStorage on fresh random pages: round trips through host pages, prefixes
that stop at their first gap, truncated, corrupt, renamed and foreign files as misses that leave
the host page untouched, a restart that finds every page and removes stray temporary files, the
size cap (over two writers of one directory too), write failures counted and logged once a
burst, an unusable directory, and concurrent writers."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import struct
import subprocess
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jhicache.cache import file_storage
from jhicache.cache.device_pool import PoolLayout
from jhicache.cache.file_storage import CONFIG_FILE, FileStorage, StorageDirError
from jhicache.cache.host_pool import HostPool
from jhicache.cache.page_keys import chain_keys
from jhicache.cache.storage import StorageNamespace

LAYOUT = PoolLayout(num_layers=3, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype=jnp.float32)


def namespace(pool: HostPool, model: str = "tiny") -> StorageNamespace:
    return StorageNamespace(model=model, dtype="float32", page_size=LAYOUT.page_size,
                            layout=f"layer_first/{pool.shards}", page_bytes=LAYOUT.page_bytes,
                            tensor_parallel_size=pool.shards)


def filled(seed: int, shards: int = 1) -> HostPool:
    pool = HostPool(LAYOUT, shards=shards)
    for block in pool.blocks:
        block.array[:] = np.random.default_rng(seed).integers(0, 256, block.array.size, np.uint8)
        seed += 1
    return pool


def page_bytes(pool: HostPool, page: int) -> bytes:
    return b"".join(v.tobytes() for v in pool.page_views(page))


def storage(root: Path, pool: HostPool, **kw) -> FileStorage:
    return FileStorage(root, namespace(pool), pool.page_views, **kw)


def test_chain_keys_chain_sha256_over_little_endian_token_ids() -> None:
    tokens = list(range(100, 111))
    keys = chain_keys(tokens, 4)
    assert len(keys) == 2  # the partial last page has no key
    first = hashlib.sha256(struct.pack("<4I", 100, 101, 102, 103)).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.sha256(first + struct.pack("<4I", 104, 105, 106, 107)).digest()
    assert chain_keys(tokens[4:], 4, previous=keys[0]) == keys[1:]  # a prefix's keys extend
    assert chain_keys([7] + tokens[1:], 4)[1] != keys[1]  # a page's key names its whole prefix


@pytest.mark.parametrize("shards", [1, 2])
def test_pages_round_trip_through_host_pages(tmp_path: Path, shards: int) -> None:
    source, target = filled(1, shards), filled(2, shards)
    keys = chain_keys(list(range(5 * 4)), 4)
    store = FileStorage(tmp_path, namespace(source), source.page_views)
    assert store.set(keys, [3, 0, 7, 11, 5]) == 5
    assert store.exists(keys) == 5 and store.exists(keys[:2]) == 2
    reader = FileStorage(tmp_path, namespace(target), target.page_views)
    assert reader.get(keys, [1, 2, 3, 4, 6]) == 5
    for src, dst in zip([3, 0, 7, 11, 5], [1, 2, 3, 4, 6]):
        assert page_bytes(target, dst) == page_bytes(source, src)
    assert reader.counters().read_pages == 5 and store.counters().written_pages == 5
    assert store.set(keys[:2], [0, 1]) == 2 and store.counters().written_pages == 5  # kept


def test_a_prefix_stops_at_its_first_gap(tmp_path: Path) -> None:
    pool = filled(3)
    keys = chain_keys(list(range(4 * 4)), 4)
    store = storage(tmp_path, pool)
    store.set([keys[0], keys[1], keys[3]], [0, 1, 3])
    assert store.exists(keys) == 2
    assert store.get(keys, [4, 5, 6, 7]) == 2
    assert store.counters().missing_pages == 1


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "renamed", "header"])
def test_a_damaged_page_is_a_miss_never_served(tmp_path: Path, damage: str) -> None:
    source = filled(4)
    keys = chain_keys(list(range(3 * 4)), 4)
    store = storage(tmp_path, source)
    store.set(keys, [0, 1, 2])
    path = store.dir / f"{keys[1].hex()}.kv"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(data[:-1])
    elif damage == "corrupt":
        data[-5] ^= 0x40  # a flipped bit in the payload
        path.write_bytes(data)
    elif damage == "header":
        data[4] += 1  # another format version
        path.write_bytes(data)
    else:  # a whole, valid page under another page's name
        path.write_bytes((store.dir / f"{keys[2].hex()}.kv").read_bytes())
    target = filled(5)
    reader = storage(tmp_path, target)
    assert reader.get(keys, [8, 9, 10]) == 1
    counters = reader.counters()
    assert counters.truncated_pages + counters.corrupt_pages == 1
    assert (counters.truncated_pages == 1) == (damage == "truncated")
    assert not path.exists() and reader.exists(keys) == 1  # deleted: asked again, a plain miss
    assert page_bytes(target, 8) == page_bytes(source, 0)
    assert page_bytes(target, 9) == page_bytes(filled(5), 9)  # the bad page left it as it was


def test_a_foreign_namespace_sees_nothing_and_a_mismatched_config_is_refused(
        tmp_path: Path) -> None:
    pool = filled(6)
    keys = chain_keys(list(range(2 * 4)), 4)
    storage(tmp_path, pool).set(keys, [0, 1])
    other = FileStorage(tmp_path, namespace(pool, model="other"), pool.page_views)
    assert other.exists(keys) == 0 and other.get(keys, [2, 3]) == 0
    assert other.dir != storage(tmp_path, pool).dir
    config = storage(tmp_path, pool).dir / CONFIG_FILE
    config.write_text(config.read_text().replace('"tiny"', '"changed"'))
    with pytest.raises(StorageDirError, match="another namespace"):
        storage(tmp_path, pool)


def test_a_restart_finds_every_page_by_a_scan(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    pool = filled(7)
    keys = chain_keys(list(range(6 * 4)), 4)
    first = storage(tmp_path, pool)
    first.set(keys, list(range(6)))
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    gone = _finished_pid()
    stray = [".stray.tmp", f".{keys[0].hex()}.kv.{host}.{gone}.1.tmp",  # its writer is gone
             f".{keys[1].hex()}.kv.{host}.{os.getpid()}.1.tmp"]  # no thread of ours is 1
    in_flight = [f".{keys[2].hex()}.kv.{host}.{os.getppid()}.5.tmp",  # a live writer's
                 f".{keys[3].hex()}.kv.0123abcd.{gone}.5.tmp"]  # another host's, just now
    for name in stray + in_flight:
        (first.dir / name).write_bytes(b"half a page")
    target = filled(8)
    with caplog.at_level(logging.INFO, logger="jhicache.storage"):
        again = storage(tmp_path, target)
    assert [r.getMessage() for r in caplog.records] == [
        f"storage tier in {again.dir}: namespace {again.namespace.digest} (tiny, float32, 4 "
        f"tokens a page), 6 pages ({again.usage().bytes / 1e6:.1f} MB) found, 3 stray "
        "temporary files removed; cap none"]
    assert {p.name for p in again.dir.glob("*.tmp")} == set(in_flight)
    assert again.usage() == first.usage() and again.usage().pages == 6
    assert again.exists(keys) == 6 and again.get(keys, list(range(6, 12))) == 6
    assert all(page_bytes(target, 6 + p) == page_bytes(pool, p) for p in range(6))


def _finished_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_the_size_cap_evicts_least_recently_used_pages(tmp_path: Path) -> None:
    pool = filled(9)
    keys = chain_keys(list(range(10 * 4)), 4)
    file_bytes = storage(tmp_path / "probe", pool).page_file_bytes
    capped = storage(tmp_path, pool, capacity_bytes=10 * file_bytes)
    capped.set(keys[:9], list(range(9)))  # 90%: under the high watermark
    assert capped.usage().pages == 9 and capped.counters().evicted_pages == 0
    capped.get(keys[:2], [10, 11])  # the oldest two are now the most recently used
    capped.set(keys[9:], [9])  # 100%: evicts down to 85%, oldest first
    usage = capped.usage()
    assert usage.pages == 8 and usage.bytes <= 0.85 * 10 * file_bytes
    assert capped.counters().evicted_pages == 2
    kept = {p.name for p in capped.dir.glob("*.kv")}
    assert kept == {f"{k.hex()}.kv" for k in keys[:2] + keys[4:]}


def _directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.kv"))


def test_the_size_cap_holds_for_the_directory_over_two_writers(tmp_path: Path) -> None:
    """Two servers on one directory, each capped at ten pages: the directory never holds
    more than ten pages' bytes, and each evicts the least recently used pages of both."""
    pools = [filled(13), filled(14)]
    keys = chain_keys(list(range(40 * 4)), 4)
    file_bytes = storage(tmp_path / "probe", pools[0]).page_file_bytes
    stores = [storage(tmp_path, pool, capacity_bytes=10 * file_bytes) for pool in pools]
    for i, key in enumerate(keys):
        assert stores[i % 2].set([key], [i % 12]) == 1
        assert _directory_bytes(stores[0].dir) <= 10 * file_bytes
    assert sum(s.counters().evicted_pages for s in stores) >= 40 - 10
    kept = {p.name for p in stores[0].dir.glob("*.kv")}
    assert f"{keys[-1].hex()}.kv" in kept and f"{keys[0].hex()}.kv" not in kept
    again = storage(tmp_path, pools[0], capacity_bytes=10 * file_bytes)  # what a restart sees
    assert again.usage().bytes == _directory_bytes(again.dir)


def test_write_failures_are_counted_by_reason_and_logged_once_a_burst(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pool = filled(15)
    keys = chain_keys(list(range(12 * 4)), 4)
    store = storage(tmp_path, pool)
    real = os.pwritev

    def full(fd: int, buffers: list, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_storage.os, "pwritev", full)
    with caplog.at_level(logging.WARNING, logger="jhicache.storage"):
        for i in range(8):
            assert store.set(keys[i:i + 1], [i]) == 0
        counters = store.counters()
        assert (counters.write_failures_no_space, counters.write_failures_io) == (8, 0)
        assert [r.getMessage() for r in caplog.records if "fail" in r.getMessage()] == [
            "storage writes fail (no_space): [Errno 28] No space left on device; each failure "
            "is counted (jhicache:storage_write_failures_total) and logged again every 60 s "
            "while they go on"]
        assert not list(store.dir.glob("*.tmp")) and store.usage().pages == 0
        monkeypatch.setattr(file_storage.os, "pwritev", real)
        caplog.clear()
        assert store.set(keys[8:10], [8, 9]) == 2
        assert [r.getMessage() for r in caplog.records] == [
            "storage writes succeed again, after 8 failed"]
    monkeypatch.setattr(file_storage.os, "replace", lambda *a: (_ for _ in ()).throw(
        PermissionError(errno.EROFS, "Read-only file system")))
    assert store.set(keys[10:], [10, 11]) == 0
    assert store.counters().write_failures_permission == 1
    assert not list(store.dir.glob("*.tmp"))


def test_a_file_system_without_flock_caps_per_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pool = filled(16)
    keys = chain_keys(list(range(12 * 4)), 4)
    file_bytes = storage(tmp_path / "probe", pool).page_file_bytes

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(file_storage.fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger="jhicache.storage"):
        capped = storage(tmp_path, pool, capacity_bytes=10 * file_bytes)
        assert capped.set(keys, list(range(12))) == 12
    assert capped.counters().evicted_pages > 0
    assert _directory_bytes(capped.dir) <= 10 * file_bytes
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"storage directory {capped.dir} takes no flock"]


def test_an_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    pool = filled(10)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StorageDirError, match="not writable"):
        storage(blocker / "storage", pool)
    with pytest.raises(ValueError, match="holds no page"):
        storage(tmp_path, pool, capacity_bytes=10)


def test_concurrent_writers_into_one_directory(tmp_path: Path) -> None:
    pools = [filled(11), filled(11)]  # the same bytes: two servers that computed one prefix
    keys = chain_keys(list(range(8 * 4)), 4)
    stores = [storage(tmp_path, pool) for pool in pools]
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(5):
                assert stores[i % 2].set(keys[i % 3:], list(range(i % 3, 8))) == 8 - i % 3
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reader_pool = filled(12)
    reader = storage(tmp_path, reader_pool)
    assert reader.get(keys, list(range(8))) == 8
    assert all(page_bytes(reader_pool, p) == page_bytes(pools[0], p) for p in range(8))
    assert not list(reader.dir.glob(".*.tmp"))
