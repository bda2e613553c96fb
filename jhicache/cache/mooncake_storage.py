"""MooncakeStorage: the storage tier in a Mooncake Store that several servers share: pages keyed
by namespace digest and page key, each one contiguous object moved through a registered buffer
of the calling thread; its config from Mooncake's own environment variables and config names."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jhicache.cache.storage import (
    PageViews,
    Storage,
    StorageCounters,
    StorageNamespace,
    StorageUsage,
    gather_page,
    scatter_page,
)
from jhicache.config import STORAGE_BACKEND_KEYS, StorageBackend

logger = logging.getLogger("jhicache.storage")

# Pages a thread's buffer holds: a call moves at most this many (the storage tier's read and
# write tasks take 8). Why a buffer and not the host pool itself: the pool is laid out layer
# first, so a page there is 2 x layers pieces, and a put or get of many pieces a call runs at a
# third of a contiguous object's rate on Mooncake's TCP transport, or fails (-800) with 7B's
# pages; copying a page into or out of a buffer costs far less. A page-first pool would need no
# buffer, but its layer-wise loads then copy page by page, which slowed the host hit more than
# the buffer's copy costs the store (both in BENCHMARKS.md's log).
BUFFER_PAGES = 8
CONFIG_KEYS = STORAGE_BACKEND_KEYS[StorageBackend.MOONCAKE]  # Mooncake's store config names
# Small defaults for a server that only reads and writes its own registered pages (Mooncake's
# own are 3.125 GiB contributed and 1 GiB of staging buffer)
DEFAULT_GLOBAL_SEGMENT_SIZE = 1 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 64 << 20


class MooncakeError(RuntimeError):
    """The store cannot be used as configured (no master, a setup or registration failed)."""


def store_config(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Mooncake's setup dict: its `MOONCAKE_*` environment variables (as Mooncake's other clients
    read them, when `MOONCAKE_MASTER` or `MOONCAKE_CONFIG_PATH` is set), then `overrides`, whose
    keys are Mooncake's config names (`CONFIG_KEYS`); ValueError on any other key, or with no
    master address from either."""
    unknown = sorted(set(overrides) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"storage backend config: unknown Mooncake key(s) {unknown}; known: "
                         f"{list(CONFIG_KEYS)}")
    from mooncake.mooncake_config import MooncakeConfig

    fields: dict[str, Any] = {
        "local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": DEFAULT_GLOBAL_SEGMENT_SIZE,
        "local_buffer_size": DEFAULT_LOCAL_BUFFER_SIZE, "protocol": "tcp", "device_name": "",
        "master_server_address": ""}
    try:
        fields.update(dataclasses.asdict(MooncakeConfig.load_from_env()))
    except ValueError:  # neither MOONCAKE_MASTER nor MOONCAKE_CONFIG_PATH: no environment
        pass
    fields.update(overrides)
    try:
        config = MooncakeConfig(**{k: fields[k] for k in CONFIG_KEYS})
    except ValueError as e:
        raise ValueError(f"storage backend config: {e} (set it, or MOONCAKE_MASTER)") from e
    return {"local_hostname": config.local_hostname, "metadata_server": config.metadata_server,
            "global_segment_size": int(config.global_segment_size),
            "local_buffer_size": int(config.local_buffer_size), "protocol": config.protocol,
            "rdma_devices": config.device_name or "",
            "master_server_addr": config.master_server_address}


class MooncakeStorage(Storage):
    """Pages as objects `<namespace digest>/<key hex>` of a Mooncake Store, one contiguous object
    a page in the host pool's byte order (`views`), put from and got into a registered buffer of
    `BUFFER_PAGES` pages, one for each of `callers` threads calling at once (another waits for
    one to be free). Objects are written whole or not at all (the store makes one visible only
    once its put ends), so a server killed mid-write leaves nothing another reads; a page the
    store evicted, or one of another size, is a miss. While the master is unreachable every
    read is a miss and every write a failure, logged once until it is back."""

    def __init__(self, namespace: StorageNamespace, views: PageViews,
                 config: Mapping[str, Any], callers: int = 1) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.namespace, self._views = namespace, views
        self.prefix = f"{namespace.digest}/"
        self._store = MooncakeDistributedStore()
        setup = store_config(config)
        if self._store.setup(setup) != 0:
            raise MooncakeError(f"Mooncake store setup failed (master "
                                f"{setup['master_server_addr']}, metadata "
                                f"{setup['metadata_server']}, protocol {setup['protocol']})")
        # one registered block, a slot of `BUFFER_PAGES` pages for each caller at once (a
        # registration takes long: made here, not in a storage hit's first read)
        slot = BUFFER_PAGES * namespace.page_bytes
        self._block = np.empty(callers * slot, np.uint8)
        if self._store.register_buffer(self._block.ctypes.data, self._block.nbytes) != 0:
            raise MooncakeError(f"Mooncake could not register {self._block.nbytes} bytes of "
                                f"buffers")
        self._slots: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for i in range(callers):
            self._slots.put(self._block[i * slot:(i + 1) * slot])
        self._lock = threading.Lock()
        self._known: set[bytes] = set()  # pages this process stored or found stored
        self._counters = StorageCounters()
        self._down = False  # the last call found the store unreachable (logged once)

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.prefix + key.hex() for key in keys]

    # -- the interface -------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        found = self._call(lambda: self._store.batch_is_exist(self._names(keys)))
        n = _leading(found or [], lambda r: r == 1)
        with self._lock:
            self._known.update(keys[:n])
        return n

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._known

    def get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Reads the pages `BUFFER_PAGES` a call, up to the first one missing."""
        return _by_buffer(self._get, keys, host_pages)

    def _get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        page = self.namespace.page_bytes
        start = time.perf_counter()
        with self._slot() as buffer:
            read = self._call(lambda: self._store.batch_get_into(
                self._names(keys), _addresses(buffer, page, len(keys)), [page] * len(keys)))
            n = _leading(read or [], lambda r: r == page)
            for i in range(n):
                scatter_page(buffer[i * page:(i + 1) * page], self._views(host_pages[i]))
        seconds = time.perf_counter() - start
        with self._lock:
            self._counters.read_pages += n
            self._counters.read_bytes += n * page
            self._counters.read_s += seconds
            if n < len(keys):
                self._counters.missing_pages += 1
                self._known.difference_update(keys[n:])
        return n

    def set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Writes the pages `BUFFER_PAGES` a call, up to the first one that fails."""
        return _by_buffer(self._set, keys, host_pages)

    def _set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        page = self.namespace.page_bytes
        start = time.perf_counter()
        with self._slot() as buffer:
            for i, host_page in enumerate(host_pages):
                gather_page(self._views(host_page), buffer[i * page:(i + 1) * page])
            stored = self._call(lambda: self._store.batch_put_from(
                self._names(keys), _addresses(buffer, page, len(keys)), [page] * len(keys)))
        seconds = time.perf_counter() - start
        n = _leading(stored or [], lambda r: r == 0)
        with self._lock:
            self._known.update(keys[:n])
            self._counters.written_pages += n
            self._counters.written_bytes += n * page
            self._counters.write_s += seconds
            if n < len(keys):
                self._counters.write_failures_io += 1
        return n

    @contextlib.contextmanager
    def _slot(self) -> Iterator[np.ndarray]:
        """A free slot of the registered block, for one call."""
        slot = self._slots.get()
        try:
            yield slot
        finally:
            self._slots.put(slot)

    def clear(self) -> int:
        removed = self._call(lambda: self._store.remove_by_regex(f"^{self.prefix}", True))
        if removed is None:  # not reached: what was stored stays so
            return 0
        with self._lock:
            self._known.clear()
        return max(removed, 0)

    def usage(self) -> StorageUsage:
        """The pages this process knows stored (written or found): the store is shared and
        evicts on its own, so this is no count of what it holds."""
        with self._lock:
            pages = len(self._known)
        return StorageUsage(pages, pages * self.namespace.page_bytes, None)

    def counters(self) -> StorageCounters:
        with self._lock:
            return dataclasses.replace(self._counters)

    def close(self) -> None:
        self._store.unregister_buffer(self._block.ctypes.data)
        self._store.close()

    # -- reachability --------------------------------------------------------------------
    def reachable(self) -> bool:
        """Whether the store's master answers, as its client last saw (no call: at once)."""
        return self._store.health_check() == 0

    def _call(self, call: Callable[[], Any]) -> Any:
        """`call`'s answer (None if it raised, or without calling while the master is
        unreachable: a call to it would wait out Mooncake's RPC timeout, seconds, and a request
        whose query it is would wait too); logs once when the master stops or starts
        answering."""
        if not self._observe():
            return None
        try:
            answer = call()
        except Exception:  # noqa: BLE001 (the store failing is a miss, not a crash)
            answer = None
        if answer is None or _any_negative(answer):
            self._observe()
        return answer

    def _observe(self) -> bool:
        """Whether the master answers now; the health check and the state it updates in one
        step, so that threads calling at once log each change once, in the order seen."""
        with self._lock:
            up = self.reachable()
            changed, self._down = self._down == up, not up
        if changed:
            logger.warning("Mooncake store's master answers again" if up else
                           "Mooncake store's master unreachable: reads are misses and writes "
                           "fail until it answers again")
        return up


def _by_buffer(move: Callable[[Sequence[bytes], Sequence[int]], int], keys: Sequence[bytes],
               host_pages: Sequence[int]) -> int:
    """`move` over the pages a buffer's worth at a time, up to the first call that moved fewer
    than it was given; how many pages moved."""
    moved = 0
    for at in range(0, len(keys), BUFFER_PAGES):
        part = keys[at:at + BUFFER_PAGES]
        done = move(part, host_pages[at:at + BUFFER_PAGES])
        moved += done
        if done < len(part):
            break
    return moved


def _addresses(buffer: np.ndarray, page: int, n: int) -> list[int]:
    """The addresses of the first `n` pages of `buffer`."""
    return [buffer.ctypes.data + i * page for i in range(n)]


def _leading(results: Sequence[int], ok: Callable[[int], bool]) -> int:
    """How many of `results`, from the first, are `ok`."""
    for n, result in enumerate(results):
        if not ok(result):
            return n
    return len(results)


def _any_negative(answer: Any) -> bool:
    """An answer holding an error code (the store's are negative)."""
    if isinstance(answer, list):
        return any(isinstance(r, int) and r < 0 for r in answer)
    return isinstance(answer, int) and answer < 0
