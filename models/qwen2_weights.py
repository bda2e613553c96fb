"""Qwen2 weights: Hugging Face safetensors checkpoints in and out, and seeded random init for presets."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jhicache.models.config import Qwen2Config
from jhicache.models.qwen2 import Qwen2ForCausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# HF tensor name -> (attribute path in our model, transpose). HF Linear weights are [out, in].
_TOP_TABLE: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("model.embed_tokens.weight", ("embed_tokens", "embedding"), False),
    ("model.norm.weight", ("head_module", "norm", "weight"), False),
)
_LM_HEAD = ("lm_head.weight", ("head_module", "kernel"), True)
_LAYER_TABLE: tuple[tuple[str, tuple[str, ...], bool], ...] = tuple(
    [(f"self_attn.{p}.weight", ("self_attn", p, "kernel"), True) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    + [(f"self_attn.{p}.bias", ("self_attn", p, "bias"), False) for p in ("q_proj", "k_proj", "v_proj")]
    + [(f"mlp.{p}.weight", ("mlp", p, "kernel"), True) for p in ("gate_proj", "up_proj", "down_proj")]
    + [(f"{n}.weight", (n, "weight"), False) for n in ("input_layernorm", "post_attention_layernorm")]
)


def weight_table(config: Qwen2Config) -> list[tuple[str, tuple[Any, ...], bool]]:
    """Every HF tensor of a checkpoint of this config with its model path and transpose flag."""
    table = list(_TOP_TABLE)
    for i in range(config.num_hidden_layers):
        table += [(f"model.layers.{i}.{name}", ("layers", i, *path), t) for name, path, t in _LAYER_TABLE]
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


def read_config(ckpt_dir: str | Path) -> Qwen2Config:
    """Parses `config.json` of a checkpoint directory; FileNotFoundError names the missing file."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {Path(ckpt_dir)}: {path} is missing")
    return Qwen2Config.from_hf_dict(json.loads(path.read_text()))


def tensor_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, single-file or sharded; checks the files exist."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = {name: ckpt_dir / f for name, f in weight_map.items()}
    elif (ckpt_dir / SINGLE_FILE).is_file():
        with safe_open(ckpt_dir / SINGLE_FILE, framework="np") as f:
            files = {name: ckpt_dir / SINGLE_FILE for name in f.keys()}
    else:
        raise FileNotFoundError(f"neither {SINGLE_FILE} nor {INDEX_FILE} found in {ckpt_dir}")
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in {index_path} is missing")
    return files


def load_pretrained(ckpt_dir: str | Path, dtype: jnp.dtype = jnp.float32) -> Qwen2ForCausalLM:
    """Loads a HF Qwen2 checkpoint directory into a model whose parameters are `dtype`.

    The model is built abstractly (no random init) and each parameter is set straight from its
    tensor, so peak memory is one copy of the weights plus one tensor. `model.config` holds the config.
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
        with safe_open(path, framework="np") as f:
            for name, var_path, transpose in entries:
                _load_tensor(model, f.get_tensor(name), name, path, var_path, transpose, dtype)
    return model


def _load_tensor(
    model: Qwen2ForCausalLM, array: np.ndarray, name: str, path: Path, var_path: tuple[Any, ...],
    transpose: bool, dtype: jnp.dtype,
) -> None:
    var = _variable(model, var_path)
    expected = _hf_shape(var, transpose)
    if tuple(array.shape) != expected:
        raise ValueError(f"tensor {name} in {path.name} has shape {tuple(array.shape)}, expected {expected}")
    array = np.ascontiguousarray(array.T) if transpose else array
    _set(var, jnp.asarray(array.astype(jnp.dtype(dtype))))


def _hf_tensors(model: Qwen2ForCausalLM) -> Iterator[tuple[str, np.ndarray]]:
    for name, var_path, transpose in weight_table(model.config):
        value = np.asarray(_variable(model, var_path)[...])
        yield name, np.ascontiguousarray(value.T) if transpose else value


def save_checkpoint(model: Qwen2ForCausalLM, config: Qwen2Config, ckpt_dir: str | Path, *, shards: int = 1) -> Path:
    """Writes `model` as a HF checkpoint (config.json + safetensors; sharded with an index when shards > 1)."""
    if config != model.config:
        raise ValueError("config does not match model.config")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    hf_config = {**config.to_hf_dict(), "torch_dtype": "bfloat16" if model.dtype == jnp.bfloat16 else "float32"}
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


def init_random(config: Qwen2Config, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Qwen2ForCausalLM:
    """A model with seeded random weights (normal, std 0.02; norms at 1), e.g. for presets without weights."""
    return Qwen2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
