"""LoadTicket: the one object through which a forward learns that a load-back's layer is on device.

A ticket is created when a load-back is queued and bound, when `LoadBacks.launch` starts it,
to the launch's copies (several tickets may share one launch). A forward that reads its
pages takes `gate_seq()`, the number its layers' device flags reach once each layer has landed,
and its attention kernels wait on the device for it (`AttentionMetadata.load_flags`); the host
does not wait. The host learns only of the whole load's landing: `wait_all()` blocks until it
(`flush`, benchmarks, tests), `done()` polls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class LoadCopies(Protocol):
    """The copies of one load-back launch, as a ticket sees them."""

    def wait(self) -> None: ...  # blocks until every layer has landed
    def is_ready(self) -> bool: ...  # non-blocking: has every layer landed?
    def issued_seq(self) -> int: ...  # issues the copies if held back; their flags' number


class LoadTicket:
    """Readiness of one queued load-back: on the device layer by layer, on the host as a whole."""

    def __init__(self, op_id: int, num_layers: int, host_pages: Sequence[int],
                 device_pages: Sequence[int]) -> None:
        self.op_id = op_id
        self.num_layers = num_layers
        self.host_pages = tuple(host_pages)
        self.device_pages = tuple(device_pages)
        self._copies: LoadCopies | None = None

    def __repr__(self) -> str:
        state = "launched" if self.launched else "queued"
        return f"LoadTicket(op={self.op_id}, pages={len(self.device_pages)}, {state})"

    @property
    def launched(self) -> bool:
        return self._copies is not None

    def bind(self, copies: LoadCopies) -> None:
        """Called by `LoadBacks.launch`."""
        self._copies = copies

    def _checked(self) -> LoadCopies:
        if self._copies is None:
            raise RuntimeError(f"{self} was not launched: a step launches it (TransferStep."
                               "start_loads, or on leaving PrefixCache.step()) before the "
                               "forward that reads it")
        return self._copies

    def gate_seq(self) -> int:
        """The sequence number each layer's load flag reaches once this load's pages of that
        layer have landed. Issues the copies first if something held them back (blocking the
        host on it): a forward may wait on the device only for copies already queued."""
        return self._checked().issued_seq()

    def done(self) -> bool:
        """Non-blocking: every layer landed (False while still queued)."""
        return self.launched and self._checked().is_ready()

    def wait_all(self) -> None:
        """Blocks until every layer has landed (issuing the copies first if held back)."""
        self._checked().wait()
