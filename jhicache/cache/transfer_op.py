"""TransferOp: one queued copy of page pairs between tiers, its kind, the tuning of how much is
queued at a time, and the helpers both directions share."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import numpy as np

from jhicache.cache.copier import Copier, Mark
from jhicache.cache.ticket import LoadTicket


@dataclasses.dataclass(frozen=True)
class TransferTuning:
    """How much the transfers queue at a time (bytes of one device shard).

    Attributes:
      write_piece_bytes: host copies of write-backs queued per poll (and per `launch_writes`):
        small against a whole write-back, because a forward's own small device->host copy
        (its sampled tokens) waits behind copies queued before it (`WriteBacks._issue`).
      gather_head_bytes: a write-back larger than this gathers this many bytes first (whole
        pages, a power of two of them), then pieces that double (`gather_pieces`): the first
        piece's copies start once it has gathered, while the rest gathers, instead of after
        the whole write-back's staging. Small enough to gather in a fraction of a millisecond,
        large enough that its per-layer copies run at the PCIe rate (BENCHMARKS.md, the
        write-back table).
      load_head_bytes: a load launched by its first layers queues at least this many bytes
        (whole layers) before the rest: enough copying to keep the copy engine busy while the
        host builds the step's inputs and dispatches the forward's first program, after which
        it queues the rest (the host-hit phases in BENCHMARKS.md). Where the whole load is
        smaller, it is queued at once.
    """

    write_piece_bytes: int = 64 << 20
    gather_head_bytes: int = 256 << 20
    load_head_bytes: int = 96 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransferTuning.{field.name}={value!r}: expected an int >= 1")


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
