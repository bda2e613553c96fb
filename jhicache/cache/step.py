"""TransferStep: one engine step's view of the transfers, in the order a step needs them.

    with cache.step() as t:                  # finished copies retire
        batch = scheduler.schedule()
        gate = t.start_loads(batch.tickets, first_layers)   # the one place the host may block
        ... dispatch the forward's first program ...
        t.finish_loads()                     # the loads' later layers, behind the first program
        ... dispatch the rest; prefetch the next step's loads ...
                                             # exit: write-backs and prefetched loads start
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jhicache.cache.ticket import LoadTicket
from jhicache.cache.transfer_op import TransferOp
from jhicache.cache.transfers import Transfers


class TransferStep:
    """The transfer calls of one step; without a host tier every call does nothing."""

    def __init__(self, transfers: Transfers | None,
                 retire: Callable[[list[TransferOp]], int]) -> None:
        self._transfers, self._retire = transfers, retire

    def poll(self) -> int:
        """Retires the copies that have finished (non-blocking); returns how many."""
        return 0 if self._transfers is None else self._retire(self._transfers.poll())

    def start_loads(self, tickets: Sequence[LoadTicket], first_layers: int | None = None) -> int:
        """Starts the queued load-backs (only their first `first_layers` layers' copies where the
        device can wait for the rest, which `finish_loads` queues) and returns the gate the
        forward waits on: the sequence number each layer's load flag reaches once the last of
        `tickets` has landed in it (0: nothing to wait for). A load still held back by a
        compute or a write-back is issued now, blocking the host on what holds it."""
        if self._transfers is None:
            return 0
        self._transfers.launch_loads(first_layers)
        return max((t.gate_seq() for t in tickets), default=0)

    def finish_loads(self) -> None:
        """Queues the copies `start_loads` held back (after the forward's first program)."""
        if self._transfers is not None:
            self._transfers.loads.finish()
