"""Every family's weights: Hugging Face safetensors checkpoints in and out (single or sharded,
straight into a tensor-parallel layout), the weight table, and seeded random init for presets."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jhicache.models.config import DecoderConfig
from jhicache.models.decoder import CausalLM
from jhicache.models.registry import config_from_hf_dict, family_of_config
from jhicache.models.sharding import TensorParallel, column_parts, param_names
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names a weight may have; the loader casts them to the model's dtype
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class CheckpointError(ValueError):
    """A checkpoint file that exists but cannot be read as the weights it should hold."""

# An entry of the weight table: the HF tensors one parameter is made of (side by side along its
# output axis: the parts of a merged projection, `column_parts`), the parameter's attribute path
# in our model, and whether HF stores it transposed (HF Linear weights are [out, in]).
Entry = tuple[tuple[str, ...], tuple[Any, ...], bool]

_TOP_TABLE: tuple[Entry, ...] = (
    (("model.embed_tokens.weight",), ("embed_tokens", "embedding"), False),
    (("model.norm.weight",), ("head_module", "norm", "weight"), False),
)
_LM_HEAD: Entry = (("lm_head.weight",), ("head_module", "kernel"), True)
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LAYER_TABLE: tuple[Entry, ...] = (
    (tuple(f"{p}.weight" for p in _QKV), ("self_attn", "qkv_proj", "kernel"), True),
    (("self_attn.o_proj.weight",), ("self_attn", "o_proj", "kernel"), True),
    (("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("mlp", "gate_up_proj", "kernel"), True),
    (("mlp.down_proj.weight",), ("mlp", "down_proj", "kernel"), True),
    (("input_layernorm.weight",), ("input_layernorm", "weight"), False),
    (("post_attention_layernorm.weight",), ("post_attention_layernorm", "weight"), False),
)


# A family's layer features add these (`DecoderConfig.QKV_BIAS`, `QK_NORM`)
_QKV_BIAS: Entry = (tuple(f"{p}.bias" for p in _QKV), ("self_attn", "qkv_proj", "bias"), False)
_QK_NORM: tuple[Entry, ...] = (
    (("self_attn.q_norm.weight",), ("self_attn", "q_norm", "weight"), False),
    (("self_attn.k_norm.weight",), ("self_attn", "k_norm", "weight"), False),
)


def _layer_table(config: DecoderConfig) -> tuple[Entry, ...]:
    return (_LAYER_TABLE + ((_QKV_BIAS,) if config.QKV_BIAS else ())
            + (_QK_NORM if config.QK_NORM else ()))


def weight_table(config: DecoderConfig) -> list[Entry]:
    """Every parameter of a model of this config with the checkpoint tensors it is made of."""
    table = list(_TOP_TABLE)
    for i in range(config.num_hidden_layers):
        table += [(tuple(f"model.layers.{i}.{n}" for n in names), ("layers", i, *path), t)
                  for names, path, t in _layer_table(config)]
    if not config.tie_word_embeddings:
        table.append(_LM_HEAD)
    return table


def _part_shapes(config: DecoderConfig, var_path: tuple[Any, ...],
                 shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The model-layout shape of each tensor a parameter of model shape `shape` is made of."""
    parts = column_parts(config, param_names(var_path))
    if not parts:
        return [tuple(shape)]
    return [(*shape[:-1], part.width) for part in parts]


def _variable(model: nnx.Module, path: tuple[Any, ...]) -> nnx.Variable:
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _shape(var: nnx.Variable) -> tuple[int, ...]:
    return tuple(var.get_value().shape) if hasattr(var, "get_value") else tuple(var.value.shape)


def _set(var: nnx.Variable, value: jax.Array) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # flax releases before Variable.set_value
        var.value = value


def _read_json(path: Path) -> Any:
    """A JSON file's contents; a ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def read_config(ckpt_dir: str | Path) -> DecoderConfig:
    """Parses `config.json` of a checkpoint directory into its family's config (chosen by its
    `architectures` / `model_type`); FileNotFoundError names the missing file, and every
    ValueError (bad JSON, a missing or ill-typed field, an unsupported family or feature) starts
    with the file's path."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {Path(ckpt_dir)}: "
                                f"{path} is missing")
    data = _read_json(path)
    try:
        return config_from_hf_dict(data)
    except ValueError as e:  # same type (UnsupportedConfigError stays one), now naming the file
        raise type(e)(f"{path}: {e}") from e


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name map, checked to be one."""
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path} has no weight_map object (tensor name -> shard file)")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{index_path}: weight_map gives no shard file name for {bad[:5]}")
    return weight_map


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """safe_open, with errors opening the file (truncated, not safetensors) naming it."""
    try:
        handle = safe_open(path, framework="np")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
    with handle as f:
        yield f


def tensor_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, single-file or sharded; checks the files
    exist."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        files = {name: ckpt_dir / f for name, f in _weight_map(index_path).items()}
    elif (ckpt_dir / SINGLE_FILE).is_file():
        with _open_shard(ckpt_dir / SINGLE_FILE) as f:
            files = {name: ckpt_dir / SINGLE_FILE for name in f.keys()}
    else:
        raise FileNotFoundError(f"neither {SINGLE_FILE} nor {INDEX_FILE} found in {ckpt_dir}")
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in {index_path} is missing")
    return files


def load_pretrained(ckpt_dir: str | Path, dtype: jnp.dtype = jnp.float32,
                    tp: TensorParallel | None = None) -> CausalLM:
    """Loads a HF checkpoint directory of any family (`registry.FAMILIES`) into its family's
    model, whose parameters are `dtype`.

    The model is built abstractly (no random init) and each parameter is set straight from its
    tensors (a merged projection's side by side), so peak memory is one copy of the weights plus
    one parameter's tensors. `model.config` holds the config. With `tp` (built for this
    checkpoint's config), each device's shard is read from the files' slices and put on that
    device alone: no tensor is ever whole on one device.
    A damaged safetensors file raises CheckpointError (a ValueError) naming the file and tensor.
    """
    config = read_config(ckpt_dir)
    files = tensor_files(ckpt_dir)
    table = weight_table(config)
    missing = [name for names, _, _ in table for name in names if name not in files]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {Path(ckpt_dir)} lacks tensor(s) {missing[:5]}{more}")
    model_class = family_of_config(config).model_class
    model = nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(0)))
    with contextlib.ExitStack() as stack:
        source = _opened(stack, files)
        for names, var_path, transpose in table:
            var = _variable(model, var_path)
            sources = [source(name) for name in names]
            shapes = _part_shapes(config, var_path, _shape(var))
            _set(var, _read_whole(sources, shapes, transpose, dtype) if tp is None else
                 _read_sharded(sources, shapes, var_path, _shape(var), transpose, dtype, tp))
    return model


Source = tuple[str, Any, Path]  # a tensor's name, its open file, the file's path


def _opened(stack: contextlib.ExitStack, files: dict[str, Path]) -> Callable[[str], Source]:
    """Opens every file of the checkpoint in `stack`; returns where a tensor is found."""
    opened = {path: stack.enter_context(_open_shard(path)) for path in sorted(set(files.values()))}
    keys = {path: set(f.keys()) for path, f in opened.items()}

    def source(name: str) -> Source:
        path = files[name]
        if name not in keys[path]:  # the index listed it in this file, which lacks it
            raise CheckpointError(f"tensor {name} is not in {path}")
        return name, opened[path], path

    return source


def _read_whole(sources: list[Source], shapes: list[tuple[int, ...]], transpose: bool,
                dtype: jnp.dtype) -> jax.Array:
    """A parameter made of `sources` (model-layout `shapes`, side by side), on one device."""
    parts = []
    for (name, f, path), shape in zip(sources, shapes):
        array = _read_tensor(f, name, path, shape[::-1] if transpose else shape)
        parts.append(np.ascontiguousarray(array.T) if transpose else array)
    whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    return jnp.asarray(whole.astype(jnp.dtype(dtype)))


def _read_tensor(f: Any, name: str, path: Path, expected: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` of open file `f`, its shape and dtype checked from the header before
    reading."""
    def read() -> np.ndarray:
        _checked_slice(f, name, path, expected)
        return f.get_tensor(name)

    return _reading(name, path, read)


def _reading(name: str, path: Path, read: Callable[[], Any]) -> Any:
    """`read()`, with safetensors and I/O errors naming the tensor and the file."""
    try:
        return read()
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from e


def _checked_slice(f: Any, name: str, path: Path, expected: tuple[int, ...]) -> Any:
    """The lazily read tensor `name`, its shape and dtype checked from the header."""
    header = f.get_slice(name)
    shape, kind = tuple(header.get_shape()), header.get_dtype()
    if shape != expected:
        raise CheckpointError(f"tensor {name} in {path} has shape {shape}, expected {expected}")
    if kind not in _FLOAT_DTYPES:  # casting ints or bools to weights would load garbage silently
        raise CheckpointError(f"tensor {name} in {path} has dtype {kind}, "
                              f"expected one of {_FLOAT_DTYPES}")
    return header


def _read_sharded(sources: list[Source], shapes: list[tuple[int, ...]],
                  var_path: tuple[Any, ...], shape: tuple[int, ...], transpose: bool,
                  dtype: jnp.dtype, tp: TensorParallel) -> jax.Array:
    """A parameter made of `sources` (model-layout `shapes`) as a sharded array in the stored
    layout (`tp.to_storage`), each device's block read from the files' slices of its parts."""
    names = param_names(var_path)
    headers = []
    for (name, f, path), part_shape in zip(sources, shapes):
        expected = part_shape[::-1] if transpose else part_shape
        headers.append(_reading(name, path,
                                functools.partial(_checked_slice, f, name, path, expected)))

    def block(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # a sharded array's index names each axis
        pieces = []
        for part, cols in tp.source_columns(names, index[-1]):  # stored -> model-layout columns
            name, _, path = sources[part]
            at = (*index[:-1], cols)
            piece = _reading(name, path, lambda: headers[part][at[::-1] if transpose else at])
            pieces.append(np.ascontiguousarray(piece.T if transpose else piece))
        whole = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)
        return whole.astype(jnp.dtype(dtype))

    sharding = tp.sharding(tp.spec(names))
    return jax.make_array_from_callback(tp.storage_shape(names, shape), sharding, block)


def _hf_tensors(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors of a model in the model's layout (not `TensorParallel`'s)."""
    for names, var_path, transpose in weight_table(model.config):
        value = np.asarray(_variable(model, var_path)[...])
        shapes = _part_shapes(model.config, var_path, value.shape)
        bounds = np.cumsum([s[-1] for s in shapes])[:-1].tolist()
        for name, part in zip(names, np.split(value, bounds, axis=-1), strict=True):
            yield name, np.ascontiguousarray(part.T) if transpose else part


def save_checkpoint(model: CausalLM, config: DecoderConfig, ckpt_dir: str | Path, *,
                    shards: int = 1) -> Path:
    """Writes `model` as a HF checkpoint (config.json + safetensors; sharded with an index when
    shards > 1). The model must hold its weights in the model's layout: one not placed by
    `TensorParallel`, whose merged projections are stored per device."""
    if config != model.config:
        raise ValueError("config does not match model.config")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    hf_config = {**config.to_hf_dict(),
                 "torch_dtype": "bfloat16" if model.dtype == jnp.bfloat16 else "float32"}
    (ckpt_dir / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    tensors = dict(_hf_tensors(model))
    if shards <= 1:
        save_file(tensors, str(ckpt_dir / SINGLE_FILE), metadata={"format": "pt"})
        return ckpt_dir
    names = list(tensors)
    shards = min(shards, len(names))
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, str(ckpt_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (ckpt_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return ckpt_dir


def init_random(config: DecoderConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32,
                tp: TensorParallel | None = None) -> CausalLM:
    """A model with seeded random weights (normal, std 0.02; norms at 1), e.g. for presets without
    weights.

    With `tp`, the weights are drawn sharded: one jitted init whose outputs are in `tp`'s layout,
    so each device computes its own shard (a 72B preset never exists whole on one device).
    """
    model_class = family_of_config(config).model_class
    build = lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(seed))  # noqa: E731
    if tp is None:
        return build()
    graphdef, abstract = nnx.split(nnx.eval_shape(build))

    def stored_state() -> nnx.State:
        state = nnx.split(build())[1]
        return jax.tree_util.tree_map_with_path(lambda p, x: tp.to_storage(param_names(p), x),
                                                state)

    state = jax.jit(stored_state, out_shardings=tp.state_shardings(abstract))()
    return nnx.merge(graphdef, state)
