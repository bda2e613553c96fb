"""ModelRunner: runs one batch through the model over the device KV pages, fused or layer by layer.

When every page the batch reads is on device the whole model runs as one jitted program (one
dispatch per step). While a load-back into its pages is still landing, the forward runs in layer
groups (`layer_groups`: 1, 2, then 4 layers per program) and waits for a group's pages at
exactly one place, `ticket.wait(layer)` in `_layered`, before dispatching the group: the host
blocks until the copies of that layer (issued in layer order on a copy stream of their own)
have landed, while the device computes the groups already dispatched. The KV arrays are donated
to each program and the pool is given the returned arrays at once, so the pool always holds the
newest version (the transfer controller relies on that, see `jhicache.cache.transfer`).

Measurement stays out of that path: a benchmark may set `probe`, which then receives each
layer-split forward's host timeline (`LayeredTimeline`); it is None otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import jax

from jhicache.cache import DevicePool, LoadTicket
from jhicache.models import AttentionMetadata, ModelPrograms, Qwen2ForCausalLM
from jhicache.models.sharding import TensorParallel


class ForwardResult(NamedTuple):
    logits: jax.Array  # [B, vocab] float32
    load_wait_s: float  # host time blocked in ticket.wait
    layered: bool  # run layer group by layer group around loads still landing


@dataclasses.dataclass(frozen=True)
class LayeredTimeline:
    """Host clock (`time.perf_counter`) of one layer-split forward, for a probe: when it began,
    then per layer group when its wait for loaded pages returned and when its program had been
    dispatched, and when the head had been dispatched. Host times only: what the device does
    between them is not seen here."""

    start_s: float
    groups: tuple[range, ...]
    waited_s: tuple[float, ...]
    dispatched_s: tuple[float, ...]
    head_dispatched_s: float


def layer_groups(num_layers: int, largest: int = 4) -> list[range]:
    """The layers a layer-split forward computes together: 1, 2, then `largest` at a time. Early
    groups are small so little of a load is exposed before compute starts; later ones large so
    one dispatch serves several layers (each costs host time, more than a small model's layer)."""
    groups, start, size = [], 0, 1
    while start < num_layers:
        groups.append(range(start, min(start + size, num_layers)))
        start, size = start + size, min(2 * size, largest)
    return groups


class ModelRunner:
    """Owns the model's jitted programs and drives them over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: Qwen2ForCausalLM, device_pool: DevicePool,
                 tp: TensorParallel | None = None) -> None:
        self.programs = ModelPrograms(model, tp)  # with tp, the pool's pages are sharded as tp says
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers
        self.groups = layer_groups(self.num_layers)
        self.probe: Callable[[LayeredTimeline], None] | None = None  # benchmarks only

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
            tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        """Logits of the rows `last_index`; KV pages updated in the pool."""
        landing = tuple(t for t in tickets if not t.done())
        if not landing:
            logits, waited = self._fused(tokens, meta, last_index), 0.0
        else:
            logits, waited = self._layered(tokens, meta, last_index, landing)
        self.pool.last_compute = logits  # pages freed from now on are fenced on this forward
        return ForwardResult(logits, waited, bool(landing))

    def _fused(self, tokens: jax.Array, meta: AttentionMetadata,
               last_index: jax.Array) -> jax.Array:
        logits, new_k, new_v = self.programs.fused(tuple(self.pool.k), tuple(self.pool.v), tokens,
                                                   meta, last_index)
        for layer in range(self.num_layers):
            self.pool.set_layer(layer, new_k[layer], new_v[layer])
        return logits

    def _layered(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
                 tickets: tuple[LoadTicket, ...]) -> tuple[jax.Array, float]:
        begin = time.perf_counter()
        hidden = self.programs.embed(tokens)
        waited, landed, dispatched = 0.0, [], []
        for group in self.groups:
            start = time.perf_counter()
            for ticket in tickets:
                ticket.wait(group[-1])  # the one place a forward syncs with loaded pages
            landed.append(time.perf_counter())
            waited += landed[-1] - start
            hidden, ks, vs = self.programs.layers(group, hidden,
                                                  tuple(self.pool.k[i] for i in group),
                                                  tuple(self.pool.v[i] for i in group), meta)
            for layer, k, v in zip(group, ks, vs):
                self.pool.set_layer(layer, k, v)
            dispatched.append(time.perf_counter())
        logits = self.programs.head(hidden, last_index)
        if self.probe is not None:
            self.probe(LayeredTimeline(begin, tuple(self.groups), tuple(landed),
                                       tuple(dispatched), time.perf_counter()))
        return logits, waited
