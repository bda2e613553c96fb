"""FileStorage: the storage tier in a local (or shared) directory, one file per page, written
atomically, checked when read, capped by size with LRU eviction, and found again by a scan."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jhicache.cache.storage import Storage, StorageCounters, StorageNamespace, StorageUsage

logger = logging.getLogger("jhicache.storage")

SUFFIX = ".kv"
CONFIG_FILE = "config.json"
# magic, format version, payload bytes, CRC-32 of the payload, the page's key
_HEADER = struct.Struct("<4sIQI32s")
_MAGIC = b"JHKV"
HIGH_WATERMARK = 0.95  # a write that takes the directory past this share of its cap ...
LOW_WATERMARK = 0.85  # ... starts eviction down to this share, least recently used first

PageViews = Callable[[int], list[np.ndarray]]


class StorageDirError(RuntimeError):
    """The storage directory cannot be used (not writable, or another namespace's config)."""


class FileStorage(Storage):
    """Pages under `root/<namespace digest>/`, each `<key hex>.kv`: a header (magic, version,
    size, CRC-32, key) and the page's bytes in the host tier's layout: its views' bytes
    (`views(host_page)`, writable uint8 arrays), in order.

    A page goes through a contiguous buffer of the calling thread's: copied into it, checked
    and written in one call each; read into it, checked, then copied out. So a page costs its
    thread a handful of waits for the interpreter lock, not one per layer's K or V, each of which
    a busy engine thread can stretch to its switch interval (numpy's copies let go of the lock);
    and a page that fails its check never reaches the host page.

    Writes go to a temporary file renamed into place, so a reader (here or in another server
    sharing the directory) sees a whole page or none. A read checks the size, the header and the
    checksum: a missing, truncated or corrupt page is a miss, logged and counted, never served.
    The index (key -> size, in LRU order) is built by a directory scan at start, so it cannot go
    stale across restarts; pages other servers write are found by `exists` on the file system.
    """

    def __init__(self, root: str | Path, namespace: StorageNamespace, views: PageViews,
                 capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < namespace.page_bytes:
            raise ValueError(f"storage capacity {capacity_bytes} bytes holds no page of "
                             f"{namespace.page_bytes} bytes")
        self.namespace, self.capacity_bytes = namespace, capacity_bytes
        self.dir = Path(root) / namespace.digest
        self._views = views
        self.page_file_bytes = _HEADER.size + namespace.page_bytes  # one page on disk
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's page buffer
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._bytes = 0
        self._counters = StorageCounters()
        self._prepare()
        self._scan()

    # -- start ---------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Creates the namespace directory and its config.json, or checks an existing one."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageDirError(f"storage directory {self.dir} is not writable: {e}") from e
        config = self.dir / CONFIG_FILE
        want = self.namespace.as_dict()
        if config.exists():
            try:
                found = json.loads(config.read_text())
            except (OSError, ValueError) as e:
                raise StorageDirError(f"{config} is unreadable: {e}") from e
            if found != want:
                raise StorageDirError(f"{config} describes another namespace: {found}")
            return
        self._atomic_write(config, json.dumps(want, indent=1, sort_keys=True).encode())

    def _scan(self) -> None:
        """The index from the directory: page files oldest first (by their last use)."""
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                key = _key_of(entry.name)
                if key is None:
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue  # evicted by another server meanwhile
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    # -- the interface -------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        for n, key in enumerate(keys):
            with self._lock:
                known = key in self._index
            if not known and not self._adopt(key):
                return n
        return len(keys)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def _adopt(self, key: bytes) -> bool:
        """Whether another writer has stored `key` (then it joins the index)."""
        try:
            size = self._path(key).stat().st_size
        except FileNotFoundError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
        return True

    def get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        for n, (key, page) in enumerate(zip(keys, host_pages, strict=True)):
            start = time.perf_counter()
            problem = self._read(key, page)
            if problem is not None:
                self._miss(key, problem)
                return n
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                self._counters.read_pages += 1
                self._counters.read_bytes += self.page_file_bytes
                self._counters.read_s += time.perf_counter() - start
        return len(keys)

    def _read(self, key: bytes, page: int) -> str | None:
        """Reads one page file into `page`; the reason it cannot be served, or None."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "missing"
        buffer = self._buffer()
        try:
            if os.fstat(fd).st_size != self.page_file_bytes:
                return "truncated"
            header = bytearray(_HEADER.size)
            if os.preadv(fd, [header, buffer.data], 0) != self.page_file_bytes:
                return "truncated"
            os.utime(fd)  # its last use, for the LRU order a later scan rebuilds
        finally:
            os.close(fd)
        magic, version, size, crc, stored_key = _HEADER.unpack(header)
        if (magic, version, size, stored_key) != (_MAGIC, self.namespace.format_version,
                                                  self.namespace.page_bytes, key):
            return "corrupt"
        if zlib.crc32(buffer.data) != crc:
            return "corrupt"
        _scatter(buffer, self._views(page))
        return None

    def _buffer(self) -> np.ndarray:
        """This thread's buffer of one page's bytes."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = np.empty(self.namespace.page_bytes, np.uint8)
        return buffer

    def _miss(self, key: bytes, problem: str) -> None:
        """Counts and logs a page that could not be served; a bad file is deleted."""
        with self._lock:
            setattr(self._counters, f"{problem}_pages",
                    getattr(self._counters, f"{problem}_pages") + 1)
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        if problem != "missing":
            logger.warning("storage page %s is %s: not served, deleted", key.hex(), problem)
            _unlink(self._path(key))

    def set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        for n, (key, page) in enumerate(zip(keys, host_pages, strict=True)):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
            start = time.perf_counter()
            try:
                self._write(key, page)
            except OSError as e:
                logger.warning("storage write of page %s failed: %s", key.hex(), e)
                with self._lock:
                    self._counters.write_failures += 1
                return n
            with self._lock:
                if key not in self._index:
                    self._index[key] = self.page_file_bytes
                    self._bytes += self.page_file_bytes
                self._counters.written_pages += 1
                self._counters.written_bytes += self.page_file_bytes
                self._counters.write_s += time.perf_counter() - start
            self._evict_if_full()
        return len(keys)

    def _write(self, key: bytes, page: int) -> None:
        buffer = self._buffer()
        _gather(self._views(page), buffer)
        header = _HEADER.pack(_MAGIC, self.namespace.format_version,
                              self.namespace.page_bytes, zlib.crc32(buffer.data), key)
        final = self._path(key)
        temporary = self.dir / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = os.pwritev(fd, [header, buffer.data], 0)
        finally:
            os.close(fd)
        if written != self.page_file_bytes:
            _unlink(temporary)
            raise OSError(f"short write: {written} of {self.page_file_bytes} bytes")
        os.replace(temporary, final)  # atomic: readers see all of it or none

    def _evict_if_full(self) -> None:
        """Past the high watermark, deletes least recently used pages down to the low one."""
        cap = self.capacity_bytes
        if cap is None:
            return
        victims: list[tuple[bytes, int]] = []
        with self._lock:
            if self._bytes <= HIGH_WATERMARK * cap:
                return
            while self._index and self._bytes > LOW_WATERMARK * cap:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append((key, size))
            self._counters.evicted_pages += len(victims)
            self._counters.evicted_bytes += sum(size for _, size in victims)
        for key, _ in victims:
            _unlink(self._path(key))

    def clear(self) -> int:
        with self._lock:
            keys = list(self._index)
            self._index.clear()
            self._bytes = 0
        for key in keys:
            _unlink(self._path(key))
        return len(keys)

    def usage(self) -> StorageUsage:
        with self._lock:
            return StorageUsage(len(self._index), self._bytes, self.capacity_bytes)

    def counters(self) -> StorageCounters:
        with self._lock:
            return dataclasses.replace(self._counters)

    # -- files ---------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)


def _key_of(name: str) -> bytes | None:
    """The key a page file's name carries; None for any other file."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    try:
        key = bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == 32 else None


def _gather(views: Sequence[np.ndarray], buffer: np.ndarray) -> None:
    """Copies `views`, in order, into `buffer`."""
    for view, start in zip(views, _offsets(views, buffer)):
        np.copyto(buffer[start:start + view.size].reshape(view.shape), view)


def _scatter(buffer: np.ndarray, views: Sequence[np.ndarray]) -> None:
    """Copies `buffer` into `views`, in order."""
    for view, start in zip(views, _offsets(views, buffer)):
        np.copyto(view, buffer[start:start + view.size].reshape(view.shape))


def _offsets(views: Sequence[np.ndarray], buffer: np.ndarray) -> list[int]:
    """Where each view starts in a page's bytes; ValueError unless they fill `buffer`."""
    starts, end = [], 0
    for view in views:
        starts.append(end)
        end += view.size
    if end != buffer.size:
        raise ValueError(f"a page's views hold {end} bytes, not {buffer.size}")
    return starts


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass  # another server's eviction got there first
