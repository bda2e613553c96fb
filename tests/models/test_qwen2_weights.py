"""Qwen2 config parsing, presets, and the HF safetensors loader: round trips and each bad input."""

from __future__ import annotations

import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jhicache.models import (
    Qwen2Config,
    init_random,
    load_pretrained,
    preset_config,
    save_checkpoint,
)
from safetensors.numpy import load_file, save_file

from tests.models.numpy_reference import random_hf_weights, small_hf_config, write_hf_checkpoint


def leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model))]


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path: Path, shards: int, tied: bool):
    config = Qwen2Config.from_hf_dict(small_hf_config(tied=tied))
    model = init_random(config, seed=5)
    save_checkpoint(model, config, tmp_path, shards=shards)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == shards
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    names = set().union(*(load_file(str(tmp_path / f)).keys() for f in files))
    assert ("lm_head.weight" in names) == (not tied)
    assert ("model.layers.1.self_attn.q_proj.bias" in names
            and "model.layers.1.self_attn.o_proj.bias" not in names)
    loaded = load_pretrained(tmp_path)
    assert loaded.config == config
    for a, b in zip(leaves(model), leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_hf_linear_weights_are_transposed(tmp_path: Path):
    cfg = small_hf_config()
    weights = random_hf_weights(cfg)
    model = load_pretrained(write_hf_checkpoint(tmp_path, cfg, weights))
    kernel = model.layers[0].self_attn.qkv_proj.kernel[...]  # q, k and v side by side
    hf = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    chex.assert_shape(kernel, (64, sum(w.shape[0] for w in hf)))
    np.testing.assert_array_equal(np.asarray(kernel), np.concatenate(hf).T)
    gate_up = model.layers[1].mlp.gate_up_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(gate_up), np.concatenate(
        [weights[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]).T)
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].mlp.down_proj.kernel[...]),
        weights["model.layers.1.mlp.down_proj.weight"].T
    )


def test_merged_parts_load_from_different_files(tmp_path: Path):
    """A sharded checkpoint that puts q, k and v (and gate and up) of a layer in three different
    files loads them side by side, as from a single file."""
    cfg = small_hf_config()
    weights = random_hf_weights(cfg, seed=3)
    names = sorted(weights)
    part = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    index = {name: next((i for p, i in part.items() if p in name), 2) for name in names}
    files = {name: f"model-{index[name] + 1:05d}-of-00003.safetensors" for name in names}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for fname in sorted(set(files.values())):
        save_file({n: weights[n] for n in names if files[n] == fname}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    whole = load_pretrained(write_hf_checkpoint(tmp_path / "one", cfg, weights))
    for a, b in zip(leaves(load_pretrained(tmp_path)), leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_bfloat16_from_float32_and_back(tmp_path: Path):
    cfg = small_hf_config(tied=False)
    model = load_pretrained(write_hf_checkpoint(tmp_path / "f32", cfg, random_hf_weights(cfg)),
                            dtype=jnp.bfloat16)
    for x in jax.tree_util.tree_leaves(nnx.state(model)):
        chex.assert_type(x, jnp.bfloat16)
    save_checkpoint(model, model.config, tmp_path / "bf16")
    again = load_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for a, b in zip(leaves(model), leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def _break(directory: Path, case: str) -> str:
    """Damages a valid sharded checkpoint in one way; returns text the error must contain."""
    if case == "no_config":
        (directory / "config.json").unlink()
        return "config.json"
    if case == "architecture":
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(
            json.dumps({**cfg, "architectures": ["GemmaForCausalLM"]}))
        return "GemmaForCausalLM"
    if case == "missing_shard":
        (directory / "model-00002-of-00002.safetensors").unlink()
        return "model-00002-of-00002.safetensors"
    shard = directory / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = "model.embed_tokens.weight"
    if case == "missing_tensor":
        del tensors[name]
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    else:  # wrong_shape
        tensors[name] = tensors[name][:-1]
    save_file(tensors, str(shard))
    return name


@pytest.mark.parametrize(
    "case, error",
    [
        ("no_config", FileNotFoundError), ("architecture", ValueError),
        ("missing_shard", FileNotFoundError), ("missing_tensor", ValueError),
        ("wrong_shape", ValueError),
    ],
)
def test_bad_checkpoints_raise_clear_errors(tmp_path: Path, case: str, error: type[Exception]):
    config = Qwen2Config.from_hf_dict(small_hf_config())
    save_checkpoint(init_random(config, seed=0), config, tmp_path, shards=2)
    expected = _break(tmp_path, case)
    with pytest.raises(error, match=expected.replace(".", r"\.")):
        load_pretrained(tmp_path)


def test_directory_without_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(small_hf_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_rope_theta_from_rope_parameters():
    cfg = small_hf_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": 123456.0, "rope_type": "default"}
    assert Qwen2Config.from_hf_dict(cfg).rope_theta == 123456.0
    assert Qwen2Config.from_hf_dict(small_hf_config(rope_theta=5e5)).rope_theta == 5e5


def test_sliding_window_flag():
    config = Qwen2Config.from_hf_dict(small_hf_config(use_sliding_window=False, sliding_window=16))
    assert not config.use_sliding_window
    with pytest.raises(NotImplementedError, match="sliding"):
        Qwen2Config.from_hf_dict(small_hf_config(use_sliding_window=True, sliding_window=16))


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_type": "llama"},
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
        {"hidden_act": "gelu"},
        {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    ],
)
def test_unsupported_configs_raise(overrides):
    with pytest.raises((ValueError, NotImplementedError)):
        Qwen2Config.from_hf_dict(small_hf_config(**overrides))


def test_presets():
    shapes = {
        "qwen2-0.5b": (896, 24, 14, 2, 64, True, 151936),
        "qwen2-1.5b": (1536, 28, 12, 2, 128, True, 151936),
        "qwen2-7b": (3584, 28, 28, 4, 128, False, 152064),
        "qwen2-72b": (8192, 80, 64, 8, 128, False, 152064),
    }
    for name, (hid, layers, heads, kv, hd, tied, vocab) in shapes.items():
        c = preset_config(name)
        got = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
        assert got + (c.head_dim, c.tie_word_embeddings, c.vocab_size) == (hid, layers, heads, kv,
                                                                           hd, tied, vocab)
        assert Qwen2Config.from_hf_dict(c.to_hf_dict()) == c
    tiny = preset_config("tiny")
    assert tiny.head_dim == 16 and tiny.tie_word_embeddings
    big = preset_config("qwen2-72b")
    assert (big.intermediate_size, big.rope_theta, big.rms_norm_eps) == (29568, 1e6, 1e-6)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("qwen2-99b")


def test_init_random_is_seeded():
    config = preset_config("tiny")
    a, b, c = init_random(config, seed=1), init_random(config, seed=1), init_random(config, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not np.array_equal(leaves(a)[0], leaves(c)[0])
