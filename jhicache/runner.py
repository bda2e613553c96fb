"""ModelRunner: runs one batch through the model over the device KV pages, fused or layer by layer.

Without a load-back in flight the whole model runs as one jitted program (one dispatch per step).
With one, the forward runs layer by layer and syncs with layer l's pages at exactly one place,
`ticket.wait(layer)` in `_layered`, before dispatching layer l. On the pages path that blocks the
host until the (already dispatched) copy is done; on the segments path it dispatches layer l+1's
host->device DMA and layer l's on-device scatter without blocking, so the DMA overlaps layer l's
compute and the scatter's output is layer l's input (`jhicache.cache.segment_transfer`). The KV
arrays are donated to each program and the pool is given the returned arrays at once, so the pool
always holds the newest version (the transfer controllers rely on that for ordering, see
`jhicache.cache.transfer`).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
from flax import nnx

from jhicache.cache import DevicePool, LoadTicket
from models import AttentionMetadata, ModelParts, Qwen2ForCausalLM, embed_apply, layer_apply, split_model


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _fused_step(
    parts_defs: tuple[nnx.GraphDef, nnx.GraphDef, nnx.GraphDef],
    states_def: jax.tree_util.PyTreeDef,
    state_leaves: list[jax.Array],  # flattened once at start-up: per-step flattening costs ~0.5 ms
    k_pages: tuple[jax.Array, ...],  # per layer [num_pages, page_size, kv_heads, head_dim], donated
    v_pages: tuple[jax.Array, ...],  # same, donated
    tokens: jax.Array,  # [T] int32
    meta: AttentionMetadata,
    last_index: jax.Array,  # [B] int32 rows whose logits are wanted
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:  # logits [B, vocab] f32
    embed_def, layer_def, head_def = parts_defs
    embed_state, layer_states, head_state = jax.tree.unflatten(states_def, state_leaves)
    hidden = nnx.merge(embed_def, embed_state)(tokens)
    new_k, new_v = [], []
    for state, k, v in zip(layer_states, k_pages, v_pages):
        hidden, k, v = nnx.merge(layer_def, state)(hidden, k, v, meta)
        new_k.append(k)
        new_v.append(v)
    logits = nnx.merge(head_def, head_state)(hidden[last_index])
    return logits, tuple(new_k), tuple(new_v)


@functools.partial(jax.jit, static_argnums=(0,))
def _head_rows(head_def: nnx.GraphDef, head_state: nnx.State, hidden: jax.Array, rows: jax.Array) -> jax.Array:
    """Final norm + lm_head on the selected rows only: [B, vocab] float32."""
    return nnx.merge(head_def, head_state)(hidden[rows])


class ForwardResult(NamedTuple):
    logits: jax.Array  # [B, vocab] float32
    load_wait_s: float  # host time spent in ticket.wait (blocked, or dispatching on the segments path)


class ModelRunner:
    """Owns the split model and drives it over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: Qwen2ForCausalLM, device_pool: DevicePool) -> None:
        self.parts: ModelParts = split_model(model)
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers
        p = self.parts
        self._leaves, self._states_def = jax.tree.flatten((p.embed_state, p.layer_states, p.head_state))

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
            tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        """Logits of the rows `last_index`; KV pages updated in the pool."""
        if not tickets:
            return ForwardResult(self._fused(tokens, meta, last_index), 0.0)
        return self._layered(tokens, meta, last_index, tickets)

    def _fused(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array) -> jax.Array:
        p = self.parts
        logits, new_k, new_v = _fused_step(
            (p.embed_def, p.layer_def, p.head_def), self._states_def, self._leaves,
            tuple(self.pool.k), tuple(self.pool.v), tokens, meta, last_index,
        )
        for layer in range(self.num_layers):
            self.pool.set_layer(layer, new_k[layer], new_v[layer])
        return logits

    def _layered(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
                 tickets: tuple[LoadTicket, ...]) -> ForwardResult:
        p = self.parts
        hidden = embed_apply(p.embed_def, p.embed_state, tokens)
        waited = 0.0
        for layer in range(self.num_layers):
            start = time.perf_counter()
            for ticket in tickets:
                ticket.wait(layer)  # the one place a forward syncs with loaded pages
            waited += time.perf_counter() - start
            hidden, k, v = layer_apply(p.layer_def, p.layer_states[layer], hidden,
                                       self.pool.k[layer], self.pool.v[layer], meta)
            self.pool.set_layer(layer, k, v)
        return ForwardResult(_head_rows(p.head_def, p.head_state, hidden, last_index), waited)

