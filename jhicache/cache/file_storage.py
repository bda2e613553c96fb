"""FileStorage: the storage tier in a local (or shared) directory, one file per page, written
atomically, checked when read, capped by size with LRU eviction over every writer of the
directory, and found again by a scan."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jhicache.cache.storage import (
    PageViews,
    Storage,
    StorageCounters,
    StorageNamespace,
    StorageUsage,
    gather_page,
    scatter_page,
    write_failure_reason,
)

logger = logging.getLogger("jhicache.storage")

SUFFIX = ".kv"
CONFIG_FILE = "config.json"
# The bytes of page files in the directory, as every writer adds them, 8 bytes little-endian;
# writers take turns on it with flock(2), as they do to rescan the directory and evict.
USAGE_FILE = ".usage"
TEMPORARY = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.(?P<thread>\d+)\.tmp$")
STRAY_AGE_S = 3600.0  # another host's temporary file this old is no write in flight
FAILURE_LOG_EVERY_S = 60.0  # while writes go on failing, a count this often
# magic, format version, payload bytes, CRC-32 of the payload, the page's key
_HEADER = struct.Struct("<4sIQI32s")
_MAGIC = b"JHKV"
HIGH_WATERMARK = 0.95  # a write that takes the directory past this share of its cap ...
LOW_WATERMARK = 0.85  # ... starts eviction down to this share, least recently used first



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
    A temporary file that no live writer holds (a writer killed mid-write) is removed at start.

    The cap holds for the directory whatever the processes writing to it: each write adds its
    bytes to a total they share (`USAGE_FILE`, under flock); one that takes it past the high
    watermark rescans the directory (every writer's pages, by last use) and evicts down to the
    low one. A write that fails is counted by its reason and logged once per burst.
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
        self._failures = _FailureLog()
        self._host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
        self._prepare()
        self._usage_lock = threading.Lock()  # this process's turn; flock gives it the others'
        self._flock = True  # the file system takes flock (False once it refused)
        self._usage_fd = os.open(self.dir / USAGE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        with self._usage():
            stray = self._remove_strays()
            self._scan()
            self._write_total(self._bytes)
        logger.info("storage tier in %s: namespace %s (%s, %s, %d tokens a page), %d pages "
                    "(%.1f MB) found, %d stray temporary files removed; cap %s", self.dir,
                    namespace.digest, namespace.model, namespace.dtype, namespace.page_size,
                    len(self._index), self._bytes / 1e6, stray,
                    "none" if capacity_bytes is None else f"{capacity_bytes / 1e6:.1f} MB")

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

    def _remove_strays(self) -> int:
        """Deletes the temporary files no write in flight holds: this host's whose process (or,
        in this process, thread) is gone, another host's older than STRAY_AGE_S, and any not
        named as this class names them. Returns how many."""
        removed = 0
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp") and not self._in_flight(entry):
                    _unlink(Path(entry.path))
                    removed += 1
        return removed

    def _in_flight(self, entry: os.DirEntry[str]) -> bool:
        match = TEMPORARY.match(entry.name)
        if match is None:
            return False
        if match["host"] != self._host:
            try:
                return time.time() - entry.stat().st_mtime < STRAY_AGE_S
            except FileNotFoundError:
                return True  # renamed into place meanwhile
        pid = int(match["pid"])
        if pid == os.getpid():  # another FileStorage of this process may be writing it
            return int(match["thread"]) in {t.ident for t in threading.enumerate()}
        return _alive(pid)

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
        index = collections.OrderedDict((key, size) for _, key, size in sorted(found))
        with self._lock:
            self._index, self._bytes = index, sum(index.values())

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
            _touch(fd)  # its last use, for the LRU order a later scan rebuilds
        finally:
            os.close(fd)
        magic, version, size, crc, stored_key = _HEADER.unpack(header)
        if (magic, version, size, stored_key) != (_MAGIC, self.namespace.format_version,
                                                  self.namespace.page_bytes, key):
            return "corrupt"
        if zlib.crc32(buffer.data) != crc:
            return "corrupt"
        scatter_page(buffer, self._views(page))
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
            if self._adopt(key):
                continue  # another server wrote it
            start = time.perf_counter()
            try:
                self._write(key, page)
            except OSError as e:
                reason = write_failure_reason(e)
                with self._lock:
                    name = f"write_failures_{reason}"
                    setattr(self._counters, name, getattr(self._counters, name) + 1)
                self._failures.failed(reason, e)
                return n
            self._failures.succeeded()
            with self._lock:
                if key not in self._index:
                    self._index[key] = self.page_file_bytes
                    self._bytes += self.page_file_bytes
                self._counters.written_pages += 1
                self._counters.written_bytes += self.page_file_bytes
                self._counters.write_s += time.perf_counter() - start
            self._account(self.page_file_bytes)
        return len(keys)

    def _write(self, key: bytes, page: int) -> None:
        buffer = self._buffer()
        gather_page(self._views(page), buffer)
        header = _HEADER.pack(_MAGIC, self.namespace.format_version,
                              self.namespace.page_bytes, zlib.crc32(buffer.data), key)
        final = self._path(key)
        temporary = self._temporary(final)
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = os.pwritev(fd, [header, buffer.data], 0)
                _touch(fd)
            finally:
                os.close(fd)
            if written != self.page_file_bytes:  # (a full disk's short write)
                raise OSError(errno.ENOSPC, f"short write: {written} of "
                              f"{self.page_file_bytes} bytes")
            os.replace(temporary, final)  # atomic: readers see all of it or none
        except OSError:
            _unlink(temporary)  # no stray temporary file
            raise

    # -- the directory's size, over every writer -----------------------------------------
    @contextlib.contextmanager
    def _usage(self) -> Iterator[None]:
        """This writer's turn on the directory's shared total (and its rescans). On a file
        system without flock (Lustre mounted without it, ...) the turns are this process's
        only: the cap then holds per process (said once, in the log)."""
        with self._usage_lock:
            locked = self._flock
            if locked:
                try:
                    fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
                except OSError as e:
                    self._flock = locked = False
                    logger.warning("storage directory %s takes no flock (%s): writers of other "
                                   "processes may each fill it to the cap", self.dir, e)
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    def _read_total(self) -> int:
        data = os.pread(self._usage_fd, 8, 0)
        return int.from_bytes(data, "little") if len(data) == 8 else 0

    def _write_total(self, total: int) -> None:
        os.pwrite(self._usage_fd, max(total, 0).to_bytes(8, "little"), 0)

    def _account(self, added: int) -> None:
        """Adds a written page to the directory's total; past the high watermark of the cap, a
        rescan measures the directory (every writer's pages) and evicts the least recently
        used down to the low watermark. (A page deleted by a reader's check is not taken off:
        the total may run high, never low, until the next rescan sets it.)"""
        with self._usage():
            total = self._read_total() + added
            cap = self.capacity_bytes
            if cap is not None and total > HIGH_WATERMARK * cap:
                self._scan()
                total = self._evict_down_to(LOW_WATERMARK * cap)
            self._write_total(total)

    def _evict_down_to(self, target: float) -> int:
        """Deletes least recently used pages while the index holds more than `target` bytes,
        if it holds more than the high watermark; returns the bytes it holds then."""
        victims: list[tuple[bytes, int]] = []
        with self._lock:
            if self.capacity_bytes is not None and self._bytes > HIGH_WATERMARK * \
                    self.capacity_bytes:
                while self._index and self._bytes > target:
                    key, size = self._index.popitem(last=False)
                    self._bytes -= size
                    victims.append((key, size))
            self._counters.evicted_pages += len(victims)
            self._counters.evicted_bytes += sum(size for _, size in victims)
            left = self._bytes
        for key, _ in victims:
            _unlink(self._path(key))
        return left

    def clear(self) -> int:
        """Deletes every page of the namespace in the directory, whoever wrote it."""
        with self._usage():
            self._scan()
            with self._lock:
                keys = list(self._index)
                self._index.clear()
                self._bytes = 0
            for key in keys:
                _unlink(self._path(key))
            self._write_total(0)
        return len(keys)

    def usage(self) -> StorageUsage:
        with self._lock:
            return StorageUsage(len(self._index), self._bytes, self.capacity_bytes)

    def counters(self) -> StorageCounters:
        with self._lock:
            return dataclasses.replace(self._counters)

    def close(self) -> None:
        with self._usage_lock:
            if self._usage_fd >= 0:
                os.close(self._usage_fd)
                self._usage_fd = -1

    # -- files ---------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def _temporary(self, final: Path) -> Path:
        """Where `final` is written before its rename: named by host, process and thread, so
        that a start tells a stray one from another writer's in flight."""
        return final.with_name(f".{final.name}.{self._host}.{os.getpid()}."
                               f"{threading.get_ident()}.tmp")

    def _atomic_write(self, path: Path, data: bytes) -> None:
        temporary = self._temporary(path)
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError:
            _unlink(temporary)
            raise


class _FailureLog:
    """Logs a burst of failed writes (a full disk fails every one) as a few lines, not one a
    page: its first failure with the error, a count every FAILURE_LOG_EVERY_S while it goes
    on, and its end (the next write that succeeds). Each failure is counted apart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._burst = 0  # failures since the last write that succeeded
        self._unlogged = 0
        self._logged_s = 0.0

    def failed(self, reason: str, error: OSError) -> None:
        now = time.monotonic()
        with self._lock:
            self._burst += 1
            self._unlogged += 1
            first = self._burst == 1
            due = first or now - self._logged_s >= FAILURE_LOG_EVERY_S
            unlogged = self._unlogged
            if due:
                self._unlogged, self._logged_s = 0, now
        if first:
            logger.warning("storage writes fail (%s): %s; each failure is counted "
                           "(jhicache:storage_write_failures_total) and logged again every "
                           "%.0f s while they go on", reason, error, FAILURE_LOG_EVERY_S)
        elif due:
            logger.warning("storage writes still fail (%s): %d more since the last message, "
                           "the last: %s", reason, unlogged, error)

    def succeeded(self) -> None:
        if not self._burst:  # (the common case, without the lock: a stale read only delays)
            return
        with self._lock:
            burst, self._burst, self._unlogged = self._burst, 0, 0
        if burst:
            logger.warning("storage writes succeed again, after %d failed", burst)


def _key_of(name: str) -> bytes | None:
    """The key a page file's name carries; None for any other file."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    try:
        key = bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == 32 else None


def _touch(fd: int) -> None:
    """Sets a file's times to now, to the nanosecond (the kernel's own stamp is as coarse as
    its tick: pages written one after the other would tie in the LRU order of a scan)."""
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass  # another server's eviction got there first
