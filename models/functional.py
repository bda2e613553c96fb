"""Pure, jitted entry points over split Qwen2 parts (graphdef static, state traced, KV pages donated).

Usage by a runner that drives layers one by one:

    parts = split_model(model)
    hidden = embed_apply(parts.embed_def, parts.embed_state, tokens)
    for i in range(n_layers):
        hidden, k[i], v[i] = layer_apply(parts.layer_def, parts.layer_states[i], hidden, k[i], v[i], meta)
    logits = head_apply(parts.head_def, parts.head_state, hidden)

Every layer has the same graphdef, so `layer_apply` compiles once per (T, B, decode_only) shape, not
once per layer. `forward_apply(graphdef, state, tokens, kv, meta)` runs the whole model in one jit.
The k/v page arguments are donated: the caller must replace its references with the returned ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from models.metadata import AttentionMetadata
from models.qwen2 import KVPages, Qwen2ForCausalLM


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """A model split into the pieces a layer-by-layer runner jits separately."""

    embed_def: nnx.GraphDef
    embed_state: nnx.State
    layer_def: nnx.GraphDef
    layer_states: tuple[nnx.State, ...]
    head_def: nnx.GraphDef
    head_state: nnx.State  # holds the embedding table too when the head is tied


def split_model(model: Qwen2ForCausalLM) -> ModelParts:
    """Splits embed, each decoder layer and the head; the states share the model's arrays (no copy)."""
    embed_def, embed_state = nnx.split(model.embed_tokens)
    splits = [nnx.split(layer) for layer in model.layers]
    layer_def = splits[0][0]
    if any(d != layer_def for d, _ in splits):
        raise ValueError("decoder layers differ in structure; cannot share one compiled layer function")
    head_def, head_state = nnx.split(model.head_module)
    return ModelParts(embed_def, embed_state, layer_def, tuple(s for _, s in splits), head_def, head_state)


@functools.partial(jax.jit, static_argnums=(0,))
def embed_apply(embed_def: nnx.GraphDef, embed_state: nnx.State, tokens: jax.Array) -> jax.Array:
    """tokens [T] int32 -> hidden [T, hidden]."""
    return nnx.merge(embed_def, embed_state)(tokens)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3, 4))
def layer_apply(
    layer_def: nnx.GraphDef,
    layer_state: nnx.State,
    hidden: jax.Array,  # [T, hidden]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], donated
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], donated
    meta: AttentionMetadata,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer: (hidden [T, hidden], new k_pages, new v_pages)."""
    return nnx.merge(layer_def, layer_state)(hidden, k_pages, v_pages, meta)


@functools.partial(jax.jit, static_argnums=(0,))
def head_apply(head_def: nnx.GraphDef, head_state: nnx.State, hidden: jax.Array) -> jax.Array:
    """hidden [T, hidden] -> logits [T, vocab] float32 (final norm + lm_head)."""
    return nnx.merge(head_def, head_state)(hidden)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def forward_apply(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, kv: list[KVPages], meta: AttentionMetadata
) -> tuple[jax.Array, list[KVPages]]:
    """Whole model in one jit, from `graphdef, state = nnx.split(model)`: (logits [T, vocab] f32, new kv)."""
    return nnx.merge(graphdef, state).forward(tokens, kv, meta)
