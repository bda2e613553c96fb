"""ModelPrograms: the jitted programs a runner calls, over a Qwen2 model split into embed, layers,
head.

Usage by a runner that drives layers one by one:

    programs = ModelPrograms(model)
    hidden = programs.embed(tokens)
    for group in (range(0, 1), range(1, 3), ...):  # any partition of the layers, in order
        hidden, k[group], v[group] = programs.layers(group, hidden, k[group], v[group], meta)
    logits = programs.head(hidden, rows)

or the whole model in one program: `logits, k, v = programs.fused(k, v, tokens, meta, rows)`.

Dispatch cost is the design constraint here: a layer-split forward makes one call per layer, and
a call that passes an `nnx.GraphDef` as a static argument spends host time hashing it, more than
a 0.5B layer's GPU time (measured: benchmarks/LOG.md, 2026-11-30). So the graphdefs and state
tree structures are closed over when the programs are built (once per model structure: engines
of the same shape share the compiled programs), and each call passes only flat lists of arrays.
Every layer has the same graphdef, so `layers` compiles once per (group size, T, B, decode_only),
not once per layer. The k/v page arguments are donated: the caller must replace its references with
the returned ones. `forward_apply(graphdef, state, tokens, kv, meta)` is a one-off whole-model entry
point for tests and scripts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.tree_util import PyTreeDef
from jhicache.models.metadata import AttentionMetadata
from jhicache.models.qwen2 import KVPages, Qwen2ForCausalLM
from jhicache.models.sharding import KV_PAGES_SPEC, LOCAL, Collectives, TensorParallel

Leaves = list[jax.Array]


class _Jitted(NamedTuple):
    embed: Callable
    layers: Callable
    head: Callable
    fused: Callable


class _Specs(NamedTuple):
    """A sharded model's layout and the partition specs of its flat leaves (hashable)."""

    tp: TensorParallel
    embed: tuple[P, ...]
    layer: tuple[P, ...]
    head: tuple[P, ...]


def _programs(embed_def: nnx.GraphDef, layer_def: nnx.GraphDef, head_def: nnx.GraphDef,
              trees: tuple[PyTreeDef, PyTreeDef, PyTreeDef], comm: Collectives) -> _Jitted:
    """The four programs, unjitted, as one device runs them (`comm` its collectives)."""
    embed_tree, layer_tree, head_tree = trees

    def embed(leaves: Leaves, tokens: jax.Array) -> jax.Array:  # [T] int32 -> [T, hidden]
        return comm.lookup(nnx.merge(embed_def, jax.tree.unflatten(embed_tree, leaves)), tokens)

    def layers(leaves: list[Leaves], hidden: jax.Array, ks: tuple[jax.Array, ...],
               vs: tuple[jax.Array, ...], meta: AttentionMetadata
               ) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        new_k, new_v = [], []
        for layer_leaves, k, v in zip(leaves, ks, vs):
            layer = nnx.merge(layer_def, jax.tree.unflatten(layer_tree, layer_leaves))
            hidden, k, v = layer(hidden, k, v, meta, comm)
            new_k.append(k)
            new_v.append(v)
        return hidden, tuple(new_k), tuple(new_v)

    def head(leaves: Leaves, hidden: jax.Array, rows: jax.Array) -> jax.Array:  # -> [B, vocab] f32
        return nnx.merge(head_def, jax.tree.unflatten(head_tree, leaves))(hidden[rows], comm)

    def fused(embed_l: Leaves, layers_l: list[Leaves], head_l: Leaves,
              k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
              tokens: jax.Array, meta: AttentionMetadata,
              rows: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        hidden, new_k, new_v = layers(layers_l, embed(embed_l, tokens), k_pages, v_pages, meta)
        return head(head_l, hidden, rows), new_k, new_v

    return _Jitted(embed, layers, head, fused)


def _over_mesh(local: _Jitted, specs: _Specs) -> _Jitted:
    """The programs as `shard_map`s over the mesh: weights and pages enter as each device's
    shard, everything else (tokens, metadata, hidden states, logits) replicated.

    Why shard_map over whole programs rather than GSPMD annotations with shard_map around the
    kernels only: the Pallas calls cannot be auto-partitioned, so they need shard_map anyway,
    and with every op per device the collectives are exactly the Megatron ones written in the
    model (psum after o_proj and down_proj, the vocab-parallel lookup, the logits gather),
    rather than what the partitioner infers through the reshapes between projections and heads.
    The specs are built at trace time because a call's layer count sets their structure.
    """
    tp, rep, kv = specs.tp, P(), KV_PAGES_SPEC
    embed_s, layer_s, head_s = list(specs.embed), list(specs.layer), list(specs.head)

    def embed(leaves: Leaves, tokens: jax.Array) -> jax.Array:
        return tp.shard_map(local.embed, (embed_s, rep), rep)(leaves, tokens)

    def layers(leaves, hidden, ks, vs, meta):  # signature as _programs' layers
        pages = (kv,) * len(ks)
        return tp.shard_map(local.layers, ([layer_s] * len(leaves), rep, pages, pages, rep),
                            (rep, pages, pages))(leaves, hidden, ks, vs, meta)

    def head(leaves: Leaves, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        return tp.shard_map(local.head, (head_s, rep, rep), rep)(leaves, hidden, rows)

    def fused(embed_l, layers_l, head_l, ks, vs, tokens, meta, rows):  # as _programs' fused
        pages = (kv,) * len(ks)
        in_specs = (embed_s, [layer_s] * len(layers_l), head_s, pages, pages, rep, rep, rep)
        return tp.shard_map(local.fused, in_specs, (rep, pages, pages))(
            embed_l, layers_l, head_l, ks, vs, tokens, meta, rows)

    return _Jitted(embed, layers, head, fused)


@functools.lru_cache(maxsize=16)
def _jitted(embed_def: nnx.GraphDef, layer_def: nnx.GraphDef, head_def: nnx.GraphDef,
            trees: tuple[PyTreeDef, PyTreeDef, PyTreeDef], specs: _Specs | None = None) -> _Jitted:
    """The four programs for one model structure (and layout); cached so engines of the same
    shape share compiles. `specs` None: one device, no shard_map."""
    if specs is None:
        programs = _programs(embed_def, layer_def, head_def, trees, LOCAL)
    else:
        programs = _over_mesh(_programs(embed_def, layer_def, head_def, trees,
                                        specs.tp.collectives), specs)
    return _Jitted(jax.jit(programs.embed), jax.jit(programs.layers, donate_argnums=(2, 3)),
                   jax.jit(programs.head), jax.jit(programs.fused, donate_argnums=(3, 4)))


class ModelPrograms:
    """Jitted embed / layer / head / fused programs over one model's weights (flat leaf lists).

    With `tp`, the leaves are placed in its sharded layout (copied only where they are not
    already, as after a sharded load) and the programs run per device over its mesh; the
    caller's K/V pages must then be sharded on their heads (`tp.kv_pages_sharding`).
    """

    def __init__(self, model: Qwen2ForCausalLM, tp: TensorParallel | None = None) -> None:
        embed_def, embed_state = nnx.split(model.embed_tokens)
        splits = [nnx.split(layer) for layer in model.layers]
        layer_def = splits[0][0]
        if any(d != layer_def for d, _ in splits):
            raise ValueError("decoder layers differ in structure; "
                             "cannot share one compiled layer function")
        head_def, head_state = nnx.split(model.head_module)
        self.embed_leaves, embed_tree = jax.tree.flatten(embed_state)
        flat_layers = [jax.tree.flatten(state) for _, state in splits]
        self.layer_leaves: list[Leaves] = [leaves for leaves, _ in flat_layers]
        self.head_leaves, head_tree = jax.tree.flatten(head_state)
        specs = None
        if tp is not None:
            self.embed_leaves, embed_specs = tp.place(embed_state)
            placed = [tp.place(state) for _, state in splits]
            self.layer_leaves = [leaves for leaves, _ in placed]
            self.head_leaves, head_specs = tp.place(head_state)
            specs = _Specs(tp, embed_specs, placed[0][1], head_specs)
        self.tp = tp
        self._jit = _jitted(embed_def, layer_def, head_def,
                            (embed_tree, flat_layers[0][1], head_tree), specs)

    @property
    def num_layers(self) -> int:
        return len(self.layer_leaves)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [T] int32 -> hidden [T, hidden]."""
        return self._jit.embed(self.embed_leaves, tokens)

    def layers(self, group: range, hidden: jax.Array, k_pages: tuple[jax.Array, ...],
               v_pages: tuple[jax.Array, ...], meta: AttentionMetadata
               ) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Decoder layers `group` in one program: hidden [T, hidden], per layer k/v [pages,
        page_size, kv_heads, head_dim] (donated) -> (hidden, new k, new v). Compiles once per group
        size."""
        return self._jit.layers([self.layer_leaves[i] for i in group], hidden,
                                k_pages, v_pages, meta)

    def head(self, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        """Final norm + lm_head on `rows` [B] of hidden [T, hidden] -> logits [B, vocab] float32."""
        return self._jit.head(self.head_leaves, hidden, rows)

    def fused(self, k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
              tokens: jax.Array, meta: AttentionMetadata,
              rows: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """The whole model in one program: (logits [B, vocab] f32 of `rows`, new k, new v per
        layer)."""
        return self._jit.fused(self.embed_leaves, self.layer_leaves, self.head_leaves,
                               k_pages, v_pages, tokens, meta, rows)

    def lower_fused(self, k_pages: tuple[Any, ...], v_pages: tuple[Any, ...], tokens: Any,
                    meta: AttentionMetadata, rows: Any) -> jax.stages.Lowered:
        """The fused program lowered for these arguments (arrays or ShapeDtypeStructs): with
        programs built over an `nnx.eval_shape` model, a dry run that compiles for a mesh
        without allocating a weight."""
        return self._jit.fused.lower(self.embed_leaves, self.layer_leaves, self.head_leaves,
                                     k_pages, v_pages, tokens, meta, rows)

    def compiled_layer_variants(self) -> int:
        """How many (group size, shape) variants the layers program has been compiled for."""
        return self._jit.layers._cache_size()


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def forward_apply(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, kv: list[KVPages],
    meta: AttentionMetadata
) -> tuple[jax.Array, list[KVPages]]:
    """Whole model in one jit, from `graphdef, state = nnx.split(model)`: (logits [T, vocab] f32,
    new kv)."""
    return nnx.merge(graphdef, state).forward(tokens, kv, meta)
