"""ModelRunner: runs one batch through the model over the device KV pages.

A step whose pages are still being loaded back runs the same programs as any other: each layer's
attention kernel waits on the device until that layer's load flag says its pages have landed
(`AttentionMetadata.load_flags`; the gate comes from `TransferStep.start_loads`), so the host
dispatches the whole forward without waiting and the copy stream and the layers overlap on the
GPU. The KV arrays are donated to the programs and the pool is given the
returned arrays at once, so the pool always holds the newest version (the transfers rely on
that, see `jhicache.cache.transfers`).
"""

from __future__ import annotations

import jax

from jhicache.cache import DevicePool
from jhicache.models import AttentionMetadata, CausalLM, ModelPrograms
from jhicache.models.sharding import TensorParallel


class ModelRunner:
    """Owns the model's jitted programs and drives them over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: CausalLM, device_pool: DevicePool,
                 tp: TensorParallel | None = None) -> None:
        self.programs = ModelPrograms(model, tp)  # with tp, the pool's pages are sharded as tp says
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers

    @property
    def first_layers(self) -> int:
        """Layers of the forward's first program (`start`)."""
        return self.programs.first_layers

    def start(self, tokens: jax.Array, meta: AttentionMetadata) -> jax.Array:
        """Dispatches the forward's first program (its first `first_layers` layers); returns
        its hidden state for `finish`. The caller queues the later layers' loads between the
        two, so that the GPU starts before the host has queued them all."""
        hidden, new_k, new_v = self.programs.forward_first(tuple(self.pool.k), tuple(self.pool.v),
                                                           tokens, meta)
        self.pool.update(0, new_k, new_v)
        return hidden

    def finish(self, hidden: jax.Array, meta: AttentionMetadata,
               last_index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dispatches the rest of the forward after `start`: (logits [B, vocab] float32 of the
        rows `last_index`, the last layer's hidden state of every row); every layer's KV pages
        updated in the pool."""
        split = self.programs.first_layers
        logits, new_k, new_v, rows = self.programs.forward_rest(
            tuple(self.pool.k), tuple(self.pool.v), hidden, meta, last_index)
        self.pool.update(split, new_k, new_v, compute=logits)  # frees fence on this forward
        return logits, rows

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array) -> jax.Array:
        """`start` then `finish`, with nothing between them: the logits."""
        return self.finish(self.start(tokens, meta), meta, last_index)[0]
