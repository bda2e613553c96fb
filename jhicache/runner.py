"""ModelRunner: runs one batch through the model over the device KV pages.

A step whose pages are still being loaded back runs the same programs as any other: each layer's
attention kernel waits on the device until that layer's load flag says its pages have landed
(`AttentionMetadata.load_flags`, built by `jhicache.batch.model_inputs` from the step's load
tickets), so the host dispatches the whole forward without waiting and the copy stream and the
layers overlap on the GPU. The KV arrays are donated to the programs and the pool is given the
returned arrays at once, so the pool always holds the newest version (the transfer controller
relies on that, see `jhicache.cache.transfer`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jhicache.cache import DevicePool
from jhicache.models import AttentionMetadata, ModelPrograms, Qwen2ForCausalLM
from jhicache.models.sharding import TensorParallel


class ModelRunner:
    """Owns the model's jitted programs and drives them over a DevicePool's per-layer K/V arrays."""

    def __init__(self, model: Qwen2ForCausalLM, device_pool: DevicePool,
                 tp: TensorParallel | None = None) -> None:
        self.programs = ModelPrograms(model, tp)  # with tp, the pool's pages are sharded as tp says
        self.pool = device_pool
        self.num_layers = model.config.num_hidden_layers

    @property
    def first_layers(self) -> int:
        """Layers of the forward's first program, dispatched before `run`'s `between` call."""
        return self.programs.first_layers

    def run(self, tokens: jax.Array, meta: AttentionMetadata, last_index: jax.Array,
            between: Callable[[], object] | None = None) -> jax.Array:
        """Logits [B, vocab] float32 of the rows `last_index`; KV pages updated in the pool.
        `between` runs once the first program is dispatched: where the engine queues the loads
        of the later layers, so that the GPU starts before the host has queued them all."""
        logits, new_k, new_v = self.programs.forward(tuple(self.pool.k), tuple(self.pool.v),
                                                     tokens, meta, last_index, between)
        for layer in range(self.num_layers):
            self.pool.set_layer(layer, new_k[layer], new_v[layer])
        self.pool.last_compute = logits  # pages freed from now on are fenced on this forward
        return logits
