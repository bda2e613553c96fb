"""LoadTicket: the one object through which a forward learns that a load-back's layer is on device.

A ticket is created when a load-back is queued and bound to per-layer output arrays when the
transfer controller launches it. `wait(layer)` blocks the calling (host) thread until that
layer's copy has finished; `is_ready(layer)` / `done()` poll without blocking. No pool getter
waits implicitly: the runner calls `wait(layer)` (or relies on JAX's data dependency, see
`transfer.py`) at one explicit site in its layer loop.

Readiness of a donated output: the pool keeps the newest array of each layer, and every newer
version was computed from the older one, so when a launch's own output has since been donated,
the pool's current array standing ready implies the load finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

Successor = Callable[[int], jax.Array]  # layer -> the pool's current array for that layer


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


class LoadTicket:
    """Per-layer readiness of one queued load-back (several tickets may share one launch)."""

    def __init__(self, op_id: int, num_layers: int, host_pages: Sequence[int],
                 device_pages: Sequence[int]) -> None:
        self.op_id = op_id
        self.num_layers = num_layers
        self.host_pages = tuple(host_pages)
        self.device_pages = tuple(device_pages)
        self._outputs: list[jax.Array] | None = None
        self._successor: Successor | None = None

    def __repr__(self) -> str:
        state = "launched" if self.launched else "queued"
        return f"LoadTicket(op={self.op_id}, pages={len(self.device_pages)}, {state})"

    @property
    def launched(self) -> bool:
        return self._outputs is not None

    def bind(self, outputs: list[jax.Array], successor: Successor) -> None:
        """Called by the controller at launch: `outputs[layer]` is that layer's copy result."""
        if len(outputs) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer outputs, got {len(outputs)}")
        self._outputs, self._successor = outputs, successor

    def _checked(self, layer: int) -> tuple[jax.Array, Successor]:
        if self._outputs is None or self._successor is None:
            raise RuntimeError(f"{self} was not launched: call TieredCache.launch() (or "
                               "TransferController.launch()) before the forward that reads it")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return self._outputs[layer], self._successor

    def is_ready(self, layer: int) -> bool:
        arr, successor = self._checked(layer)
        return array_ready(arr, layer, successor)

    def wait(self, layer: int) -> None:
        """Blocks until `layer`'s pages are on device."""
        arr, successor = self._checked(layer)
        block_on(arr, layer, successor)

    def done(self) -> bool:
        """Non-blocking: every layer copied (False while still queued)."""
        return self.launched and all(self.is_ready(layer) for layer in range(self.num_layers))

    def wait_all(self) -> None:
        for layer in range(self.num_layers):
            self.wait(layer)
