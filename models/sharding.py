"""TensorParallel: a decoder's Megatron layout over a 1-D device mesh (partition specs, KV-head
replication, placement) and the collectives the per-device programs run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jhicache.models.config import DecoderConfig

AXIS = "tp"

# Megatron: column-parallel layers split their outputs (heads, MLP columns), row-parallel ones
# their inputs, so each device runs attention on its own heads and one all-reduce per block
# (after o_proj, after down_proj) sums the partial outputs. Both column-parallel layers are
# merged projections: their columns are parts side by side ([q | k | v], [gate | up]), and
# each part is split over the devices on its own (see `TensorParallel.to_storage`).
_COLUMN = frozenset({"qkv_proj", "gate_up_proj"})
_ROW = frozenset({"o_proj", "down_proj"})
_HEAD = "head_module"
KV_PAGES_SPEC = P(None, None, AXIS, None)  # [pages, page_size, kv_heads, head_dim] on its heads


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The cross-device steps of the sharded programs, inside `shard_map` over `axis`.

    `axis` None is one device: every step is the identity (or the plain op), so the unsharded
    programs trace exactly as they would without this class.
    """

    axis: str | None = None

    def sum(self, x: jax.Array) -> jax.Array:
        """All-reduce of a row-parallel layer's partial output."""
        return x if self.axis is None else jax.lax.psum(x, self.axis)

    def gather_last(self, x: jax.Array) -> jax.Array:
        """Concatenates the devices' slices of the last axis (vocab-parallel logits)."""
        return (x if self.axis is None
                else jax.lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True))

    def lookup(self, embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
        """Vocab-parallel embedding: each device looks up the ids in its rows, zeros elsewhere,
        and the sum over devices is exact (one non-zero term per token)."""
        if self.axis is None:
            return embed(tokens)
        table = embed.embedding[...]  # [vocab / tp, hidden]
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(self.axis) * rows
        mine = (local >= 0) & (local < rows)
        found = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
        return self.sum(jnp.where(mine[:, None], found, jnp.zeros_like(found)))


LOCAL = Collectives()


def shard_map(fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`jax.shard_map` where it exists (newer jax: `check_vma`), else the experimental one
    (`check_rep`).

    Replication checking is off: pallas_call has no replication rule, and the programs make
    their replicated outputs replicated themselves (psum, all_gather).
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return experimental(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def param_names(path: Sequence[Any]) -> tuple[str, ...]:
    """The attribute names of an nnx state path (layer indices and the `.value` key dropped)."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", key))
        if isinstance(name, str) and name != "value":
            names.append(name)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class Part:
    """One projection inside a merged column-parallel parameter: its width in the model's
    layout and whether it holds KV heads (stored repeated when there are more devices than KV
    heads)."""

    width: int
    kv: bool = False


def column_parts(config: DecoderConfig, names: tuple[str, ...]) -> tuple[Part, ...]:
    """The parts of a merged projection's parameter at attribute path `names`, in the model's
    layout ([q | k | v], [gate | up]); none for any other parameter."""
    module = names[-2] if len(names) > 1 else None
    if module == "qkv_proj":
        kv = config.num_key_value_heads * config.head_dim
        return (Part(config.num_attention_heads * config.head_dim), Part(kv, True), Part(kv, True))
    if module == "gate_up_proj":
        return (Part(config.intermediate_size), Part(config.intermediate_size))
    return ()


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One model's tensor-parallel layout over `mesh` (one axis, AXIS).

    KV heads: with tp <= num_key_value_heads each device holds kv_heads / tp of them; with more
    devices than KV heads each holds one, replicated (vLLM's rule: tp must then be a multiple
    of the KV heads). qkv_proj's k and v columns and the KV pages are stored with
    `storage_kv_heads` heads, KV head h repeated `kv_replicas` times, so one column split gives
    every device its own head.
    """

    mesh: Mesh
    config: DecoderConfig

    @classmethod
    def create(cls, size: int, config: DecoderConfig, devices: Sequence[jax.Device] | None = None,
               field: str = "tensor_parallel_size") -> TensorParallel:
        """The layout over the first `size` devices; a ValueError naming `field` when `size`
        does not fit the devices or the model's shape."""
        devices = list(jax.devices() if devices is None else devices)
        misfits = _misfits(size, len(devices), config)
        if misfits:
            raise ValueError(f"{field}={size}: " + "; ".join(misfits))
        return cls(Mesh(np.asarray(devices[:size]), (AXIS,)), config)

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def kv_replicas(self) -> int:
        return max(1, self.size // self.config.num_key_value_heads)

    @property
    def storage_kv_heads(self) -> int:
        """KV heads of qkv_proj's k and v columns and of the KV pages as stored:
        max(kv_heads, tp)."""
        return self.config.num_key_value_heads * self.kv_replicas

    @property
    def collectives(self) -> Collectives:
        return Collectives(AXIS)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def kv_pages_sharding(self) -> NamedSharding:
        return self.sharding(KV_PAGES_SPEC)

    def shard_map(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        return shard_map(fn, self.mesh, in_specs, out_specs)

    # ---- weights -------------------------------------------------------------------------

    @staticmethod
    def spec(names: tuple[str, ...]) -> P:
        """Partition spec of the parameter at attribute path `names` (see `param_names`)."""
        param, module = names[-1], (names[-2] if len(names) > 1 else None)
        if param == "embedding":
            return P(AXIS, None)  # [vocab, hidden]
        if param == "weight":
            return P()  # RMSNorm scales
        if param == "kernel" and module in _COLUMN:
            return P(None, AXIS)  # [in, out]
        if param == "bias" and module in _COLUMN:
            return P(AXIS)
        if param == "kernel" and module in _ROW:
            return P(AXIS, None)
        if param == "kernel" and module in (None, _HEAD):
            return P(None, AXIS)  # untied lm_head [hidden, vocab]
        raise ValueError(f"no tensor-parallel rule for parameter {'.'.join(names)}")

    def _stored_width(self, part: Part) -> int:
        return part.width * (self.kv_replicas if part.kv else 1)

    def storage_shape(self, names: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of a parameter whose model shape (config heads) is `shape`."""
        parts = column_parts(self.config, names)
        if not parts:
            return tuple(shape)
        return (*shape[:-1], sum(self._stored_width(p) for p in parts))

    def source_columns(self, names: tuple[str, ...], cols: slice) -> list[tuple[int, slice]]:
        """Where one device's block `cols` of a parameter's stored columns comes from: a
        (part, columns of that part in the model's layout) per part, in stored order."""
        parts = column_parts(self.config, names)
        if not parts:
            return [(0, cols)]
        device = cols.start // (self.storage_shape(names, (0,))[-1] // self.size)
        sources = []
        for index, part in enumerate(parts):
            shard = self._stored_width(part) // self.size
            if part.kv and self.kv_replicas > 1:  # one stored head a device, `kv_replicas` alike
                head = device // self.kv_replicas
                sources.append((index, slice(head * shard, (head + 1) * shard)))
            else:
                sources.append((index, slice(device * shard, (device + 1) * shard)))
        return sources

    def to_storage(self, names: tuple[str, ...], value: jax.Array) -> jax.Array:
        """A parameter in the model's layout -> the stored one; traceable. A merged parameter's
        parts are each split over the devices and device i's shards put side by side
        ([q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...]), k and v with each KV head repeated
        `kv_replicas` times, so that one column split gives every device its own heads."""
        parts = column_parts(self.config, names)
        if not parts:
            return value
        lead, d = value.shape[:-1], self.config.head_dim
        bounds = np.cumsum([p.width for p in parts])[:-1].tolist()
        blocks = []
        for part, x in zip(parts, jnp.split(value, bounds, axis=-1)):
            if part.kv and self.kv_replicas > 1:
                heads = x.reshape(*lead, -1, d)
                x = jnp.repeat(heads, self.kv_replicas, axis=-2).reshape(*lead, -1)
            blocks.append(x.reshape(*lead, self.size, -1))
        return jnp.concatenate(blocks, axis=-1).reshape(*lead, -1)

    def state_shardings(self, state: Any) -> Any:
        """A pytree like `state` (an nnx.State) with each leaf's NamedSharding."""
        return jax.tree_util.tree_map_with_path(
            lambda p, _: self.sharding(self.spec(param_names(p))), state)

    def place(self, state: Any) -> tuple[list[Any], tuple[P, ...]]:
        """`state`'s leaves in the stored, sharded layout (copied only where they are not yet),
        with their partition specs, in `jax.tree.flatten` order. Abstract leaves (an
        `nnx.eval_shape` model, for compiling without weights) become sharded ShapeDtypeStructs."""
        leaves, specs = [], []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            names = param_names(path)
            spec = self.spec(names)
            leaves.append(self._placed(names, leaf, self.sharding(spec)))
            specs.append(spec)
        return leaves, tuple(specs)

    def _placed(self, names: tuple[str, ...], leaf: Any, target: NamedSharding) -> Any:
        """A leaf sharded as `target` is taken to be stored already (as the sharded loader and
        init leave it); any other is in the model's layout and is converted."""
        if isinstance(leaf, jax.ShapeDtypeStruct):  # abstract leaves are in the model's layout
            return jax.ShapeDtypeStruct(self.storage_shape(names, leaf.shape), leaf.dtype,
                                        sharding=target)
        if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(target, leaf.ndim):
            if leaf.shape[-1:] != self.storage_shape(names, leaf.shape)[-1:]:
                raise ValueError(f"{'.'.join(names)} is sharded but not in the stored layout")
            return leaf
        return jax.jit(lambda x: self.to_storage(names, x), out_shardings=target)(leaf)


def _misfits(size: int, devices: int, config: DecoderConfig) -> list[str]:
    """Why a tp of `size` cannot serve `config` on `devices` devices; empty when it can."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return ["expected an int >= 1"]
    kv = config.num_key_value_heads
    checks = [
        (devices % size == 0, f"must divide the device count ({devices})"),
        (config.num_attention_heads % size == 0,
         f"must divide num_attention_heads ({config.num_attention_heads})"),
        (kv % size == 0 if kv >= size else size % kv == 0,
         f"must divide num_key_value_heads ({kv}) or, above it, be a multiple of it "
         "(KV heads are then replicated)"),
        (config.intermediate_size % size == 0,
         f"must divide intermediate_size ({config.intermediate_size})"),
        (config.vocab_size % size == 0, f"must divide vocab_size ({config.vocab_size})"),
    ]
    return [reason for ok, reason in checks if not ok]
