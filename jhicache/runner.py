"""ModelRunner: runs one batch through the model over the device KV pages, fused or layer by layer.

Without a load-back in flight the whole model runs as one jitted program (one dispatch per step).
With one, the forward runs in layer groups (`layer_groups`: 1, 2, then 4 layers per program) and
syncs with a group's pages at exactly one place, `ticket.wait(layer)` in `_layered`, before
dispatching the group. On the pages path that blocks the host until the (already dispatched) copy
is done; on the segments path the DMAs were queued at launch (as far as the staging budget allows)
and it dispatches this group's on-device scatter without blocking, so the copies overlap the
compute of earlier groups and the scatter's outputs are this group's inputs
(`jhicache.cache.segment_transfer`). The KV
arrays are donated to each program and the pool is given the returned arrays at once, so the pool
always holds the newest version (the transfer controllers rely on that for ordering, see
`jhicache.cache.transfer`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax

from jhicache.cache import DevicePool, LoadTicket, layer_groups
from jhicache.cache.ticket import LoadMarks
from jhicache.load_timing import LoadTimeline
from jhicache.models import AttentionMetadata, ModelPrograms, Qwen2ForCausalLM
from jhicache.models.sharding import TensorParallel


class ForwardResult(NamedTuple):
    logits: jax.Array  # [B, vocab] float32
    load_wait_s: float  # host time spent in ticket.wait (blocked, or dispatching on the segments path)
    timeline: LoadTimeline | None  # layer-split steps: `measure()` once the step is dispatched


class ModelRunner:
    """Owns the model's jitted programs and drives them over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: Qwen2ForCausalLM, device_pool: DevicePool, tp: TensorParallel | None = None) -> None:
        self.programs = ModelPrograms(model, tp)  # with tp, the pool's pages are sharded as tp says
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers
        self.groups = layer_groups(self.num_layers)  # the granularity segment loads are dispatched at too

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
            tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        """Logits of the rows `last_index`; KV pages updated in the pool."""
        if not tickets:
            return ForwardResult(self._fused(tokens, meta, last_index), 0.0, None)
        return self._layered(tokens, meta, last_index, tickets)

    def _fused(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array) -> jax.Array:
        logits, new_k, new_v = self.programs.fused(tuple(self.pool.k), tuple(self.pool.v), tokens, meta, last_index)
        for layer in range(self.num_layers):
            self.pool.set_layer(layer, new_k[layer], new_v[layer])
        return logits

    def _layered(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
                 tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        hidden = self.programs.embed(tokens)
        timeline = LoadTimeline(min((t.launched_at for t in tickets), default=time.perf_counter()), hidden)
        waited = 0.0
        for group in self.groups:
            start = time.perf_counter()
            for ticket in tickets:
                for layer in group:
                    ticket.wait(layer)  # the one place a forward syncs with loaded pages
            waited += time.perf_counter() - start
            hidden, ks, vs = self.programs.layers(group, hidden, tuple(self.pool.k[i] for i in group),
                                                  tuple(self.pool.v[i] for i in group), meta)
            for layer, k, v in zip(group, ks, vs):
                self.pool.set_layer(layer, k, v)
            timeline.add_group(_marks(tickets, group), hidden)
        return ForwardResult(self.programs.head(hidden, last_index), waited, timeline)


def _marks(tickets: tuple[LoadTicket, ...], group: range) -> list[LoadMarks]:
    """What times `group`'s loads, once per load (tickets may share one)."""
    marks = {id(m.placed): m for m in (t.marks(layer) for t in tickets for layer in group) if m is not None}
    return list(marks.values())
