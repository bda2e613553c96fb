"""Storage: the interface of a third tier under the host tier (pages keyed by `page_keys`, read
into and written from host pages), its namespace and its counters; backends implement it."""

from __future__ import annotations

import abc
import dataclasses
import errno
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

FORMAT_VERSION = 1
# why a page could not be written: the file system is full (or over a quota), it refuses
# (read-only, not permitted), or any other I/O error
WRITE_FAILURE_REASONS = ("no_space", "permission", "io")
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}
# A host page's bytes as writable views, in the order a stored page keeps them (a backend copies
# a page between them and one contiguous buffer: `gather_page`, `scatter_page`)
PageViews = Callable[[int], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class StorageNamespace:
    """Everything that makes one engine's page bytes unreadable to another: pages written under
    one namespace are never read under another (a backend keeps each apart)."""

    model: str  # the model's identity: a hash of its config and weights' names, or a given name
    dtype: str
    page_size: int
    layout: str  # the host tier's byte layout of a page
    page_bytes: int
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    format_version: int = FORMAT_VERSION

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def digest(self) -> str:
        """A short name for the namespace: SHA-256 of its fields, hex."""
        text = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass
class StorageCounters:
    """What a backend did, cumulative. A page that could not be served (missing, truncated,
    corrupt) is a miss by its reason, never a page."""

    written_pages: int = 0
    written_bytes: int = 0
    write_s: float = 0.0
    write_failures_no_space: int = 0  # by reason (WRITE_FAILURE_REASONS)
    write_failures_permission: int = 0
    write_failures_io: int = 0
    read_pages: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    missing_pages: int = 0
    truncated_pages: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0
    evicted_bytes: int = 0


def write_failure_reason(error: OSError) -> str:
    """The reason (one of WRITE_FAILURE_REASONS) a write failed with `error`."""
    if error.errno in _NO_SPACE:
        return "no_space"
    if error.errno in _PERMISSION:
        return "permission"
    return "io"


@dataclasses.dataclass(frozen=True)
class StorageUsage:
    """A backend's size now: pages and bytes held, and its cap (None: no cap)."""

    pages: int
    bytes: int
    capacity_bytes: int | None


class Storage(abc.ABC):
    """Pages keyed by their chained keys (`jhicache.cache.page_keys`). Every call takes a batch,
    in prefix order, and stops at the first page it cannot serve: a prefix is usable only up to
    its first gap. Calls come from the storage tier's threads, several at once."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are stored."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the page `key` is stored, as far as this process knows without I/O (a page
        another server wrote may be missing from the answer; `exists` asks the backend)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Reads page `keys[i]` into host page `host_pages[i]`, in order; returns how many were
        read before the first that could not be (its host page then holds nothing usable)."""

    @abc.abstractmethod
    def set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Stores host page `host_pages[i]` as `keys[i]`, in order (a key already stored is
        kept); returns how many are stored before the first that could not be."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Deletes every page of this namespace; returns how many."""

    @abc.abstractmethod
    def usage(self) -> StorageUsage:
        """The size held now."""

    @abc.abstractmethod
    def counters(self) -> StorageCounters:
        """A copy of the counters."""

    def reachable(self) -> bool:
        """Whether the backend can be reached now, without asking it anything that could wait
        (a local directory always can)."""
        return True

    def close(self) -> None:
        """Stops background work; the pages stay."""


def gather_page(views: Sequence[np.ndarray], buffer: np.ndarray) -> None:
    """Copies a page's `views`, in order, into `buffer` (one numpy call a view: each lets go of
    the interpreter lock while it copies)."""
    for view, start in zip(views, _starts(views, buffer)):
        np.copyto(buffer[start:start + view.size].reshape(view.shape), view)


def scatter_page(buffer: np.ndarray, views: Sequence[np.ndarray]) -> None:
    """Copies `buffer` into a page's `views`, in order."""
    for view, start in zip(views, _starts(views, buffer)):
        np.copyto(view, buffer[start:start + view.size].reshape(view.shape))


def _starts(views: Sequence[np.ndarray], buffer: np.ndarray) -> list[int]:
    """Where each view starts in a page's bytes; ValueError unless they fill `buffer`."""
    starts, end = [], 0
    for view in views:
        starts.append(end)
        end += view.size
    if end != buffer.size:
        raise ValueError(f"a page's views hold {end} bytes, not {buffer.size}")
    return starts
