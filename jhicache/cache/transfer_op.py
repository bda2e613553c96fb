"""TransferOp: one queued copy of page pairs between tiers, its kind, and the helpers both
directions share (their tuning, `TransferTuning`, is the engine's config's)."""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import numpy as np

from jhicache.cache.copier import Copier, Mark
from jhicache.cache.ticket import LoadTicket


class TransferKind(enum.Enum):
    WRITE_BACK = "write_back"
    LOAD_BACK = "load_back"


class TransferOp(NamedTuple):
    """One queued copy of page pairs; reported back by `poll` once complete."""

    op_id: int
    kind: TransferKind
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    ticket: LoadTicket | None


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page pairs coalesced where both ids step by one: (src starts, dst starts, lengths)."""
    if len(src) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], cut])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return src[starts], dst[starts], lengths


def is_ready(array: jax.Array) -> bool:
    """Whether a dispatched program's output is computed (jax.Array's stubs lack is_ready)."""
    return array.is_ready()  # type: ignore[attr-defined]




def timed_s(copier: Copier, start: Mark | None, end: Mark | None) -> float:
    """Seconds between two done, timed marks (then given back to the copier)."""
    assert start is not None and end is not None
    seconds = copier.elapsed_s(start, end)
    copier.release(start)
    copier.release(end)
    return seconds
