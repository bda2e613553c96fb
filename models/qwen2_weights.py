"""Qwen2 weights: Hugging Face safetensors checkpoints in and out, and seeded random init for
presets."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jhicache.models.config import Qwen2Config
from jhicache.models.qwen2 import Qwen2ForCausalLM
from jhicache.models.sharding import TensorParallel, param_names
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names a weight may have; the loader casts them to the model's dtype
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class CheckpointError(ValueError):
    """A checkpoint file that exists but cannot be read as the weights it should hold."""

# HF tensor name -> (attribute path in our model, transpose). HF Linear weights are [out, in].
_TOP_TABLE: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("model.embed_tokens.weight", ("embed_tokens", "embedding"), False),
    ("model.norm.weight", ("head_module", "norm", "weight"), False),
)
_LM_HEAD = ("lm_head.weight", ("head_module", "kernel"), True)
_LAYER_TABLE: tuple[tuple[str, tuple[str, ...], bool], ...] = tuple(
    [(f"self_attn.{p}.weight", ("self_attn", p, "kernel"), True)
     for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    + [(f"self_attn.{p}.bias", ("self_attn", p, "bias"), False)
       for p in ("q_proj", "k_proj", "v_proj")]
    + [(f"mlp.{p}.weight", ("mlp", p, "kernel"), True)
       for p in ("gate_proj", "up_proj", "down_proj")]
    + [(f"{n}.weight", (n, "weight"), False)
       for n in ("input_layernorm", "post_attention_layernorm")]
)


def weight_table(config: Qwen2Config) -> list[tuple[str, tuple[Any, ...], bool]]:
    """Every HF tensor of a checkpoint of this config with its model path and transpose flag."""
    table = list(_TOP_TABLE)
    for i in range(config.num_hidden_layers):
        table += [(f"model.layers.{i}.{name}", ("layers", i, *path), t)
                  for name, path, t in _LAYER_TABLE]
    if not config.tie_word_embeddings:
        table.append(_LM_HEAD)
    return table


def _variable(model: nnx.Module, path: tuple[Any, ...]) -> nnx.Variable:
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _hf_shape(var: nnx.Variable, transpose: bool) -> tuple[int, ...]:
    shape = tuple(var.get_value().shape) if hasattr(var, "get_value") else tuple(var.value.shape)
    return shape[::-1] if transpose else shape


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


def read_config(ckpt_dir: str | Path) -> Qwen2Config:
    """Parses `config.json` of a checkpoint directory; FileNotFoundError names the missing file,
    and every ValueError (bad JSON, a missing or ill-typed field) starts with the file's path."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {Path(ckpt_dir)}: "
                                f"{path} is missing")
    data = _read_json(path)
    try:
        return Qwen2Config.from_hf_dict(data)
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
                    tp: TensorParallel | None = None) -> Qwen2ForCausalLM:
    """Loads a HF Qwen2 checkpoint directory into a model whose parameters are `dtype`.

    The model is built abstractly (no random init) and each parameter is set straight from its
    tensor, so peak memory is one copy of the weights plus one tensor. `model.config` holds the
    config. With `tp` (built for this checkpoint's config), each device's shard is read from the
    file's slice and put on that device alone: no tensor is ever whole on one device.
    A damaged safetensors file raises CheckpointError (a ValueError) naming the file and tensor.
    """
    config = read_config(ckpt_dir)
    files = tensor_files(ckpt_dir)
    table = weight_table(config)
    missing = [name for name, _, _ in table if name not in files]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {Path(ckpt_dir)} lacks tensor(s) {missing[:5]}{more}")
    model = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    by_file: dict[Path, list[tuple[str, tuple[Any, ...], bool]]] = {}
    for entry in table:
        by_file.setdefault(files[entry[0]], []).append(entry)
    for path, entries in by_file.items():
        with _open_shard(path) as f:
            _load_file(model, f, path, entries, dtype, tp)
    return model


def _load_file(
    model: Qwen2ForCausalLM, f: Any, path: Path, entries: list[tuple[str, tuple[Any, ...], bool]],
    dtype: jnp.dtype, tp: TensorParallel | None,
) -> None:
    names = set(f.keys())
    for name, var_path, transpose in entries:
        if name not in names:  # the index listed it in this file, which lacks it
            raise CheckpointError(f"tensor {name} is not in {path}")
        var = _variable(model, var_path)
        if tp is not None:
            _set(var, _read_sharded(f, name, path, var_path, _hf_shape(var, False), transpose,
                                    dtype, tp))
            continue
        array = _read_tensor(f, name, path, _hf_shape(var, transpose))
        array = np.ascontiguousarray(array.T) if transpose else array
        _set(var, jnp.asarray(array.astype(jnp.dtype(dtype))))


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


def _read_sharded(f: Any, name: str, path: Path, var_path: tuple[Any, ...], shape: tuple[int, ...],
                  transpose: bool, dtype: jnp.dtype, tp: TensorParallel) -> jax.Array:
    """Tensor `name` as a sharded array in the model's layout (`shape`, KV heads stored as `tp`
    repeats them), each device's block read from the file's slice of it."""
    names = param_names(var_path)
    header = _reading(name, path,
                      lambda: _checked_slice(f, name, path, shape[::-1] if transpose else shape))

    def block(index: tuple[slice, ...]) -> np.ndarray:
        index = (*index[:-1], tp.source_columns(names, index[-1]))  # stored columns -> file columns
        part = _reading(name, path, lambda: header[index[::-1] if transpose else index])
        return np.ascontiguousarray(part.T if transpose else part).astype(jnp.dtype(dtype))

    sharding = tp.sharding(tp.spec(names))
    return jax.make_array_from_callback(tp.storage_shape(names, shape), sharding, block)


def _hf_tensors(model: Qwen2ForCausalLM) -> Iterator[tuple[str, np.ndarray]]:
    for name, var_path, transpose in weight_table(model.config):
        value = np.asarray(_variable(model, var_path)[...])
        yield name, np.ascontiguousarray(value.T) if transpose else value


def save_checkpoint(model: Qwen2ForCausalLM, config: Qwen2Config, ckpt_dir: str | Path, *,
                    shards: int = 1) -> Path:
    """Writes `model` as a HF checkpoint (config.json + safetensors; sharded with an index when
    shards > 1)."""
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


def init_random(config: Qwen2Config, seed: int = 0, dtype: jnp.dtype = jnp.float32,
                tp: TensorParallel | None = None) -> Qwen2ForCausalLM:
    """A model with seeded random weights (normal, std 0.02; norms at 1), e.g. for presets without
    weights.

    With `tp`, the weights are drawn sharded: one jitted init whose outputs are in `tp`'s layout,
    so each device computes its own shard (a 72B preset never exists whole on one device).
    """
    build = lambda: Qwen2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))  # noqa: E731
    if tp is None:
        return build()
    graphdef, abstract = nnx.split(nnx.eval_shape(build))

    def stored_state() -> nnx.State:
        state = nnx.split(build())[1]
        return jax.tree_util.tree_map_with_path(lambda p, x: tp.to_storage(param_names(p), x),
                                                state)

    state = jax.jit(stored_state, out_shardings=tp.state_shardings(abstract))()
    return nnx.merge(graphdef, state)
