"""LoadTicket: the one object through which a forward learns that a load-back's layer is on device.

A ticket is created when a load-back is queued and bound, when the transfer controller launches
it, to the launch's per-layer copies (`LayerCopies`; several tickets may share one launch).
`wait(layer)` makes that layer's pages safe for the next computation the caller dispatches:
on the pages path (zero-copy kernels, all layers dispatched at launch) it blocks the host until
the copy has finished; on the segments path it dispatches the on-device scatter of that layer's
group (and refills the window of host->device DMAs) without blocking, and JAX's data
dependencies order them before the caller's next kernel. `is_ready(layer)` / `done()` poll without blocking and
`wait_all()` blocks until every layer is on device. No pool getter waits implicitly: the runner
calls `wait(layer)` at one explicit site in its layer loop.

Readiness of a donated output: the pool keeps the newest array of each layer, and every newer
version was computed from the older one, so when a launch's own output has since been donated,
the pool's current array standing ready implies the load finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import jax

Successor = Callable[[int], jax.Array]  # layer -> the pool's current array for that layer


class LoadMarks(NamedTuple):
    """Arrays a forward times one layer group's load by (see jhicache.load_timing)."""

    landed: tuple[jax.Array, ...]  # the group's host->device copies (copy engine)
    placed: jax.Array  # computed by the scatter that placed the group's pages (compute stream)


def layer_groups(num_layers: int, largest: int = 4) -> list[range]:
    """The layers a layer-split forward computes, and a segment load dispatches, together: 1, 2, then
    `largest` at a time. Early groups are small so little of a load is exposed before compute starts;
    later ones large so one dispatch serves several layers (each costs ~0.1 ms of host time on the
    H200, more than a small model's layer computes)."""
    groups, start, size = [], 0, 1
    while start < num_layers:
        groups.append(range(start, min(start + size, num_layers)))
        start, size = start + size, min(2 * size, largest)
    return groups


def array_ready(arr: jax.Array, layer: int, successor: Successor) -> bool:
    """Non-blocking: has the computation producing `arr` (or a successor of it) finished?"""
    if not arr.is_deleted():
        return arr.is_ready()
    current = successor(layer)
    return not current.is_deleted() and current.is_ready()


def block_on(arr: jax.Array, layer: int, successor: Successor) -> None:
    """Blocks until `arr` (or the pool's newer version of it) is computed."""
    if not arr.is_deleted():
        arr.block_until_ready()
        return
    current = successor(layer)
    if current.is_deleted():
        raise RuntimeError(f"layer {layer}: the pool array was donated and not put back; "
                           "call pool.set_layer() with the kernel's output before waiting")
    current.block_until_ready()


class LayerCopies(Protocol):
    """The per-layer copies of one load-back launch, as a ticket sees them."""

    def wait(self, layer: int) -> None: ...  # layer safe for the next dispatched computation
    def is_ready(self, layer: int) -> bool: ...  # non-blocking: layer's copy has finished
    def block(self, layer: int) -> None: ...  # blocks the host until layer's copy has finished
    def marks(self, layer: int) -> LoadMarks | None: ...  # after wait: what times layer's load (segments path)


class DispatchedCopies:
    """Copies dispatched for every layer at launch (pages path): `outputs[layer]` is the result."""

    def __init__(self, outputs: list[jax.Array], successor: Successor) -> None:
        self.outputs, self.successor = outputs, successor

    def wait(self, layer: int) -> None:
        self.block(layer)

    def is_ready(self, layer: int) -> bool:
        return array_ready(self.outputs[layer], layer, self.successor)

    def block(self, layer: int) -> None:
        block_on(self.outputs[layer], layer, self.successor)

    def marks(self, layer: int) -> None:
        return None  # the copies are kernels on the compute stream: a forward's wait blocks on them


class LoadTicket:
    """Per-layer readiness of one queued load-back (several tickets may share one launch)."""

    def __init__(self, op_id: int, num_layers: int, host_pages: Sequence[int],
                 device_pages: Sequence[int]) -> None:
        self.op_id = op_id
        self.num_layers = num_layers
        self.host_pages = tuple(host_pages)
        self.device_pages = tuple(device_pages)
        self._copies: LayerCopies | None = None
        self.launched_at = 0.0  # perf_counter() when the launch began dispatching its copies

    def __repr__(self) -> str:
        state = "launched" if self.launched else "queued"
        return f"LoadTicket(op={self.op_id}, pages={len(self.device_pages)}, {state})"

    @property
    def launched(self) -> bool:
        return self._copies is not None

    def bind(self, copies: LayerCopies, launched_at: float) -> None:
        """Called by the controller at launch (`launched_at`: before it dispatched the copies)."""
        self._copies = copies
        self.launched_at = launched_at

    def _checked(self, layer: int) -> LayerCopies:
        if self._copies is None:
            raise RuntimeError(f"{self} was not launched: call TieredCache.launch() (or "
                               "TransferController.launch()) before the forward that reads it")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return self._copies

    def is_ready(self, layer: int) -> bool:
        return self._checked(layer).is_ready(layer)

    def wait(self, layer: int) -> None:
        """Makes `layer`'s pages safe to read by the next computation dispatched (see module doc)."""
        self._checked(layer).wait(layer)

    def marks(self, layer: int) -> LoadMarks | None:
        """After `wait(layer)`: arrays whose completion times `layer`'s load (segments path); None
        on the pages path, whose copies run on the compute stream and block in `wait` instead."""
        return self._checked(layer).marks(layer)

    def done(self) -> bool:
        """Non-blocking: every layer copied (False while still queued)."""
        return self.launched and all(self.is_ready(layer) for layer in range(self.num_layers))

    def wait_all(self) -> None:
        """Blocks until every layer's pages are on device."""
        for layer in range(self.num_layers):
            self.wait(layer)
        for layer in range(self.num_layers):
            self._checked(layer).block(layer)
