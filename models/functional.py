"""ModelPrograms: the jitted programs of a model's forward a runner calls, over flat weights.

    programs = ModelPrograms(model)
    logits, k, v = programs.forward(k, v, tokens, meta, rows)

A few programs per step (`program_layers`), dispatched back to back: the first layers (with the
embedding), then the rest (the last program with the head). The GPU starts a program only once
the host has dispatched all of it, so the GPU runs one while the host dispatches the next. A forward
that reads pages still being loaded waits for them on the device, layer by layer inside its
attention kernels (`AttentionMetadata.load_flags`), so no host wait is needed between them.

Dispatch cost is the design constraint here: a call that passes an `nnx.GraphDef` as a static
argument spends host time hashing it (measured: benchmarks/LOG.md, 2026-11-30). So the graphdefs
and state tree structures are closed over when the programs are built (once per model
structure: engines of the same shape share the compiled programs), and each call passes only
flat lists of arrays. The k/v page arguments are donated: the caller must replace its
references with the returned ones. `forward_apply(graphdef, state, tokens, kv, meta)` is a
one-off whole-model entry point for tests and scripts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.tree_util import PyTreeDef
from jhicache.models.decoder import CausalLM, KVPages
from jhicache.models.metadata import AttentionMetadata
from jhicache.models.sharding import KV_PAGES_SPEC, LOCAL, Collectives, TensorParallel

Leaves = list[jax.Array]
# Rows a `head_rows` block takes at most: its logits are [block, vocab] float32 (623 MB for
# Qwen2-7B's vocabulary). The projection of fewer rows at a time runs further below the matmul's
# rate (benchmarks/head_rows_probe.py), and the logits cost a write and a read either way.
HEAD_ROWS_BLOCK = 1024
Pages = tuple[jax.Array, ...]  # one [pages, page_size, kv_heads, head_dim] array per layer


class _Specs(NamedTuple):
    """A sharded model's layout and the partition specs of its flat leaves (hashable)."""

    tp: TensorParallel
    embed: tuple[P, ...]
    layer: tuple[P, ...]
    head: tuple[P, ...]


def _programs(embed_def: nnx.GraphDef, layer_def: nnx.GraphDef, head_def: nnx.GraphDef,
              trees: tuple[PyTreeDef, PyTreeDef, PyTreeDef],
              comm: Collectives) -> tuple[Callable, Callable, Callable, Callable]:
    """The forward's programs, unjitted, as one device runs them (`comm` its collectives):
    `first` embeds the tokens and runs the first layers, `middle` runs layers only (hidden
    state in and out), `rest` the last layers and the head (and gives the last layer's hidden
    state of every row too). A call's layer count sets which layers a program holds; `start` is
    the first one's index. The fourth, `head_rows`, runs the
    head over every row of such a hidden state, `block` rows at a time, each block's logits
    reduced by `reduce(logits, targets)` at once (a [rows, vocab] array never exists whole)."""
    embed_tree, layer_tree, head_tree = trees

    def layers(leaves: list[Leaves], hidden: jax.Array, ks: Pages, vs: Pages,
               meta: AttentionMetadata, start: int) -> tuple[jax.Array, Pages, Pages]:
        new_k, new_v = [], []
        for index, (layer_leaves, k, v) in enumerate(zip(leaves, ks, vs), start):
            layer = nnx.merge(layer_def, jax.tree.unflatten(layer_tree, layer_leaves))
            hidden, k, v = layer(hidden, k, v, meta, comm, index)
            new_k.append(k)
            new_v.append(v)
        return hidden, tuple(new_k), tuple(new_v)

    def first(embed_l: Leaves, layers_l: list[Leaves], k_pages: Pages, v_pages: Pages,
              tokens: jax.Array, meta: AttentionMetadata) -> tuple[jax.Array, Pages, Pages]:
        embed = nnx.merge(embed_def, jax.tree.unflatten(embed_tree, embed_l))
        return layers(layers_l, comm.lookup(embed, tokens), k_pages, v_pages, meta, 0)

    def middle(layers_l: list[Leaves], k_pages: Pages, v_pages: Pages, hidden: jax.Array,
               meta: AttentionMetadata, start: int) -> tuple[jax.Array, Pages, Pages]:
        return layers(layers_l, hidden, k_pages, v_pages, meta, start)

    def rest(layers_l: list[Leaves], head_l: Leaves, k_pages: Pages, v_pages: Pages,
             hidden: jax.Array, meta: AttentionMetadata, rows: jax.Array,
             start: int) -> tuple[jax.Array, Pages, Pages, jax.Array]:  # logits [B, vocab] f32
        hidden, new_k, new_v = layers(layers_l, hidden, k_pages, v_pages, meta, start)
        head = nnx.merge(head_def, jax.tree.unflatten(head_tree, head_l))
        return head(hidden[rows], comm), new_k, new_v, hidden

    def head_rows(head_l: Leaves, hidden: jax.Array, targets: jax.Array, *,
                  reduce: Callable, block: int) -> Any:
        head = nnx.merge(head_def, jax.tree.unflatten(head_tree, head_l))
        rows = hidden.shape[0]
        block = min(block, rows)  # a short prompt's rows: one block of their own size
        padded = -(-rows // block) * block
        hidden = jax.numpy.pad(hidden, ((0, padded - rows), (0, 0)))
        targets = jax.numpy.pad(targets, ((0, padded - rows),) + ((0, 0),) * (targets.ndim - 1))
        blocks = (hidden.reshape(padded // block, block, -1),
                  targets.reshape(-1, block, *targets.shape[1:]))
        out = jax.lax.map(lambda b: reduce(head(b[0], comm), b[1]), blocks)
        return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:rows], out)

    return first, middle, rest, head_rows


def _over_mesh(first: Callable, middle: Callable, rest: Callable, head_rows: Callable,
               specs: _Specs) -> tuple[Callable, Callable, Callable, Callable]:
    """The programs as `shard_map`s over the mesh: weights and pages enter as each device's
    shard, everything else (tokens, metadata, hidden states, logits) replicated.

    Why shard_map over whole programs rather than GSPMD annotations with shard_map around the
    kernels only: the Pallas calls cannot be auto-partitioned, so they need shard_map anyway,
    and with every op per device the collectives are exactly the Megatron ones written in the
    model (psum after o_proj and down_proj, the vocab-parallel lookup, the logits gather),
    rather than what the partitioner infers through the reshapes between projections and heads.
    The specs are built at trace time because a call's layer count sets their structure. The
    metadata is replicated: its load flags are then one array per device, which each device's
    copy stream sets for its own shard of the pages.
    """
    tp, rep, kv = specs.tp, P(), KV_PAGES_SPEC
    embed_s, layer_s, head_s = list(specs.embed), list(specs.layer), list(specs.head)

    def sharded_first(embed_l, layers_l, ks, vs, tokens, meta):  # as _programs' first
        pages = (kv,) * len(ks)
        in_specs = (embed_s, [layer_s] * len(layers_l), pages, pages, rep, rep)
        return tp.shard_map(first, in_specs, (rep, pages, pages))(
            embed_l, layers_l, ks, vs, tokens, meta)

    def sharded_middle(layers_l, ks, vs, hidden, meta, start):  # as _programs' middle
        pages = (kv,) * len(ks)
        in_specs = ([layer_s] * len(layers_l), pages, pages, rep, rep)
        return tp.shard_map(functools.partial(middle, start=start), in_specs,
                            (rep, pages, pages))(layers_l, ks, vs, hidden, meta)

    def sharded_rest(layers_l, head_l, ks, vs, hidden, meta, rows, start):  # as _programs' rest
        pages = (kv,) * len(ks)
        in_specs = ([layer_s] * len(layers_l), head_s, pages, pages, rep, rep, rep)
        return tp.shard_map(functools.partial(rest, start=start), in_specs,
                            (rep, pages, pages, rep))(layers_l, head_l, ks, vs, hidden, meta, rows)

    def sharded_head_rows(head_l, hidden, targets, *, reduce, block):  # as _programs' head_rows
        return tp.shard_map(functools.partial(head_rows, reduce=reduce, block=block),
                            (head_s, rep, rep), rep)(head_l, hidden, targets)

    return sharded_first, sharded_middle, sharded_rest, sharded_head_rows


class _Jitted(NamedTuple):
    """The forward's jitted programs and the head over every row (see `_programs`)."""

    first: Any  # jax.jit's wrapped functions (callable, with `.lower`)
    middle: Any
    rest: Any
    head_rows: Any


@functools.lru_cache(maxsize=16)
def _jitted(embed_def: nnx.GraphDef, layer_def: nnx.GraphDef, head_def: nnx.GraphDef,
            trees: tuple[PyTreeDef, PyTreeDef, PyTreeDef], specs: _Specs | None = None) -> _Jitted:
    """The programs for one model structure (and layout); cached so engines of the same
    shape share compiles. `specs` None: one device, no shard_map. The pages are donated."""
    comm = LOCAL if specs is None else specs.tp.collectives
    first, middle, rest, head_rows = _programs(embed_def, layer_def, head_def, trees, comm)
    if specs is not None:
        first, middle, rest, head_rows = _over_mesh(first, middle, rest, head_rows, specs)
    return _Jitted(jax.jit(first, donate_argnums=(2, 3)),
                   jax.jit(middle, donate_argnums=(1, 2), static_argnames=("start",)),
                   jax.jit(rest, donate_argnums=(2, 3), static_argnames=("start",)),
                   jax.jit(head_rows, static_argnames=("reduce", "block")))


def program_layers(num_layers: int) -> tuple[int, ...]:
    """Layers each of the forward's programs runs, in order (the first with the embedding, the
    last with the head; it may run none): a quarter, then the rest. The GPU starts on a program
    only once the host has dispatched all of it, so a short first program lets the GPU run it
    while the host dispatches the next; its GPU time must outlast that dispatch (BENCHMARKS.md,
    host hits)."""
    first = max(1, -(-num_layers // 4))
    return first, num_layers - first


def _lowered(program: Any, platforms: tuple[str, ...] | None, *args: Any,
             **static: Any) -> jax.stages.Lowered:
    """`program` (a jitted function) lowered for `args`, for the default device's platform or
    for `platforms`."""
    if platforms is None:
        return program.lower(*args, **static)
    return program.trace(*args, **static).lower(lowering_platforms=platforms)


class ModelPrograms:
    """The jitted programs of the whole model over one model's weights (flat leaf lists).

    With `tp`, the leaves are placed in its sharded layout (copied only where they are not
    already, as after a sharded load) and the programs run per device over its mesh; the
    caller's K/V pages must then be sharded on their heads (`tp.kv_pages_sharding`).
    """

    def __init__(self, model: CausalLM, tp: TensorParallel | None = None) -> None:
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
        # layers each program runs (`program_layers`, read once: every step dispatches them)
        self.program_layers = counts = program_layers(self.num_layers)
        assert len(counts) >= 2 and counts[0] >= 1 and sum(counts) == self.num_layers, counts
        starts = [sum(counts[:i]) for i in range(len(counts))]
        # (start, stop) of the layers of each program between the first and the last
        self._middles = [(starts[i], starts[i] + counts[i]) for i in range(1, len(counts) - 1)]
        self._last = starts[-1]  # the last program's first layer
        self._jit = _jitted(embed_def, layer_def, head_def,
                            (embed_tree, flat_layers[0][1], head_tree), specs)

    @property
    def num_layers(self) -> int:
        return len(self.layer_leaves)

    @property
    def first_layers(self) -> int:
        """Layers the first program runs."""
        return self.program_layers[0]

    def forward(self, k_pages: Pages, v_pages: Pages, tokens: jax.Array, meta: AttentionMetadata,
                rows: jax.Array) -> tuple[jax.Array, Pages, Pages]:
        """The whole model, its programs back to back: (logits [B, vocab] f32 of `rows`, new k,
        new v per layer)."""
        hidden, k_first, v_first = self.forward_first(k_pages, v_pages, tokens, meta)
        logits, k_rest, v_rest, _ = self.forward_rest(k_pages, v_pages, hidden, meta, rows)
        return logits, k_first + k_rest, v_first + v_rest

    def forward_first(self, k_pages: Pages, v_pages: Pages, tokens: jax.Array,
                      meta: AttentionMetadata) -> tuple[jax.Array, Pages, Pages]:
        """The first program (embedding and the first `first_layers` layers) over those layers'
        pages: (hidden state, their new k, new v)."""
        split = self.first_layers
        return self._jit.first(self.embed_leaves, self.layer_leaves[:split], k_pages[:split],
                               v_pages[:split], tokens, meta)

    def forward_rest(self, k_pages: Pages, v_pages: Pages, hidden: jax.Array,
                     meta: AttentionMetadata,
                     rows: jax.Array) -> tuple[jax.Array, Pages, Pages, jax.Array]:
        """The programs after the first, back to back (the last with the head) over the later
        layers' pages: (logits [B, vocab] f32 of `rows`, their new k, new v, the last layer's
        hidden state of every row, for `head_rows`)."""
        new_k: Pages = ()
        new_v: Pages = ()
        for start, stop in self._middles:
            hidden, k, v = self._jit.middle(self.layer_leaves[start:stop], k_pages[start:stop],
                                            v_pages[start:stop], hidden, meta, start=start)
            new_k, new_v = new_k + k, new_v + v
        last = self._last
        logits, k, v, hidden = self._jit.rest(
            self.layer_leaves[last:], self.head_leaves, k_pages[last:], v_pages[last:], hidden,
            meta, rows, start=last)
        return logits, new_k + k, new_v + v, hidden

    def head_rows(self, hidden: jax.Array, targets: jax.Array, reduce: Callable,
                  block: int = HEAD_ROWS_BLOCK) -> Any:
        """`reduce(logits, targets)` of the head over every row of `forward_rest`'s hidden
        state, `block` rows at a time (`reduce` a module-level function: it keys the program),
        its outputs joined back into one row per hidden row."""
        return self._jit.head_rows(self.head_leaves, hidden, targets, reduce=reduce, block=block)

    def lower_head_rows(self, hidden: Any, targets: Any, reduce: Callable,
                        block: int = HEAD_ROWS_BLOCK) -> jax.stages.Lowered:
        """As `lower_first`, for `head_rows`."""
        return self._jit.head_rows.lower(self.head_leaves, hidden, targets, reduce=reduce,
                                         block=block)

    def lower_first(self, k_pages: tuple[Any, ...], v_pages: tuple[Any, ...], tokens: Any,
                    meta: AttentionMetadata,
                    platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The first program lowered for these arguments (arrays, or ShapeDtypeStructs typed as
        a call's would be): compiled, JAX keeps it for later `forward` calls with arguments of
        the same types (`output_type` then types its hidden state for `lower_rest`).
        `platforms`: lowered for those instead of the default device's (("cuda",) from a CPU
        checks the GPU lowering; such a program is not for running here)."""
        split = self.first_layers
        return _lowered(self._jit.first, platforms, self.embed_leaves,
                        self.layer_leaves[:split], k_pages[:split], v_pages[:split], tokens, meta)

    def lower_rest(self, k_pages: tuple[Any, ...], v_pages: tuple[Any, ...],
                   hidden: jax.ShapeDtypeStruct, meta: AttentionMetadata, rows: Any,
                   platforms: tuple[str, ...] | None = None) -> list[jax.stages.Lowered]:
        """As `lower_first`, for the programs after the first, in order (a program between the
        first and the last takes and gives a hidden state of `hidden`'s type)."""
        lowered = [_lowered(self._jit.middle, platforms, self.layer_leaves[start:stop],
                            k_pages[start:stop], v_pages[start:stop], hidden, meta, start=start)
                   for start, stop in self._middles]
        last = self._last
        return lowered + [_lowered(
            self._jit.rest, platforms, self.layer_leaves[last:], self.head_leaves,
            k_pages[last:], v_pages[last:], hidden, meta, rows, start=last)]

    def lower(self, k_pages: tuple[Any, ...], v_pages: tuple[Any, ...], tokens: Any,
              meta: AttentionMetadata, rows: Any) -> tuple[jax.stages.Lowered, ...]:
        """The programs lowered for these arguments (arrays or ShapeDtypeStructs): with programs
        built over an `nnx.eval_shape` model, a dry run that compiles for a mesh without
        allocating a weight."""
        first = self.lower_first(k_pages, v_pages, tokens, meta)
        return first, *self.lower_rest(k_pages, v_pages, first.out_info[0], meta, rows)


def output_type(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled,
                index: int = 0) -> jax.ShapeDtypeStruct:
    """A compiled program's output `index` (its first by default) as a ShapeDtypeStruct with
    the sharding a call gives it, so that a program lowered over it matches a later call over
    the real output."""
    infos, shardings = lowered.out_info, compiled.output_shardings
    if index:  # a program of several outputs: its output `index`
        infos, shardings = infos[index], shardings[index]
    info, sharding = jax.tree.leaves(infos)[0], jax.tree.leaves(shardings)[0]
    return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def forward_apply(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, kv: list[KVPages],
    meta: AttentionMetadata
) -> tuple[jax.Array, list[KVPages]]:
    """Whole model in one jit, from `graphdef, state = nnx.split(model)`: (logits [T, vocab] f32,
    new kv)."""
    return nnx.merge(graphdef, state).forward(tokens, kv, meta)
