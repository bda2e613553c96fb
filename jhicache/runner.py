"""ModelRunner: runs one batch through the model over the device KV pages, fused or layer by layer.

When every page the batch reads is on device the whole model runs as one jitted program (one
dispatch per step). While a load-back into its pages is still landing, the forward runs in layer
groups (`layer_groups`: 1, 2, then 4 layers per program) and waits for a group's pages before
dispatching the group: the host blocks until the copies of that layer (issued in layer order on
a copy stream of their own) have landed, while the device computes the groups already
dispatched. A shape that has run only fused waits for the whole load instead and runs fused
(no compile of the split mid-service). Either wait is `_wait`, the one place a forward syncs
with loaded pages. The KV arrays are donated to each program and the pool is given the returned
arrays at once, so the pool always holds the newest version (the transfer controller relies on
that, see `jhicache.cache.transfer`).

Measurement stays out of that path: a benchmark may set `probe`, which then receives each
layer-split forward's host timeline (`LayeredTimeline`); it is None otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import NamedTuple

import jax

from jhicache.cache import DevicePool, LoadTicket, layer_groups
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


class ModelRunner:
    """Owns the model's jitted programs and drives them over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: Qwen2ForCausalLM, device_pool: DevicePool,
                 tp: TensorParallel | None = None) -> None:
        self.programs = ModelPrograms(model, tp)  # with tp, the pool's pages are sharded as tp says
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers
        self.groups = layer_groups(self.num_layers)
        self.probe: Callable[[LayeredTimeline], None] | None = None  # benchmarks only
        # Input shapes each path has run: every new one compiled a program (per group size
        # for the layer split).
        self._ran: dict[bool, set[Hashable]] = {False: set(), True: set()}  # layered? -> shapes

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
            tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        """Logits of the rows `last_index`; KV pages updated in the pool.

        Runs layer by layer while loads are landing, except for a shape that this runner has
        run fused and never split: then it waits for the loads and runs fused, since waiting
        for copies costs milliseconds where compiling the split's programs costs seconds."""
        landing, waited = tuple(t for t in tickets if not t.done()), 0.0
        shape = (tokens.shape, last_index.shape, jax.tree.structure(meta),
                 tuple(x.shape for x in jax.tree.leaves(meta)))
        if landing and shape in self._ran[False] and shape not in self._ran[True]:
            waited, landing = self._wait(landing, self.num_layers - 1), ()
        if not landing:
            logits = self._fused(tokens, meta, last_index)
        else:
            logits, waited = self._layered(tokens, meta, last_index, landing)
        self._ran[bool(landing)].add(shape)
        self.pool.last_compute = logits  # pages freed from now on are fenced on this forward
        return ForwardResult(logits, waited, bool(landing))

    @staticmethod
    def _wait(tickets: tuple[LoadTicket, ...], layer: int) -> float:
        """Blocks until `layer` of every ticket has landed (and so every layer before it);
        returns the seconds that took. The one way a forward syncs with loaded pages."""
        start = time.perf_counter()
        for ticket in tickets:
            ticket.wait(layer)
        return time.perf_counter() - start

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
            waited += self._wait(tickets, group[-1])
            landed.append(time.perf_counter())
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
