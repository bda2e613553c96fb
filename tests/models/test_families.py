"""The family protocol: the registry's choice from config.json, each family's refusals (naming
the field), presets with the published shapes, and checkpoints written and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jhicache.models import (
    FAMILIES,
    PRESETS,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    UnsupportedConfigError,
    config_from_hf_dict,
    family_of,
    family_of_config,
    init_random,
    load_pretrained,
    preset_config,
    read_config,
    save_checkpoint,
)

from tests.models.hf_references import ROOT


def hf_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A reference checkpoint's config.json (as transformers wrote it), with overrides."""
    return {**json.loads((ROOT / name / "config.json").read_text()), **overrides}


def test_the_registry_chooses_the_family_from_architectures_or_model_type() -> None:
    assert [f.name for f in FAMILIES] == ["qwen2", "qwen3", "llama"]
    for name, config_class in (("qwen2", Qwen2Config), ("qwen3", Qwen3Config),
                               ("llama3", LlamaConfig)):
        cfg = hf_config(name)
        assert family_of(cfg).config_class is config_class
        assert family_of({**cfg, "architectures": None}).config_class is config_class
        assert type(config_from_hf_dict(cfg)) is config_class
    with pytest.raises(ValueError, match="MistralForCausalLM.*jhicache serves Qwen2ForCausalLM"):
        family_of(hf_config("llama3", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="model_type 'qwen2' is not 'qwen3'"):
        family_of(hf_config("qwen3", model_type="qwen2"))
    with pytest.raises(ValueError, match="no registered family"):
        family_of_config(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("name, overrides, field", [
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ("qwen3", {"num_experts": 8}, "num_experts"),
    ("llama3", {"attention_bias": True}, "attention_bias"),
    ("llama3", {"mlp_bias": True}, "mlp_bias"),
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
    ("llama3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama3", {"num_local_experts": 8}, "num_local_experts"),
    ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama3", {"pretraining_tp": 2}, "pretraining_tp"),
])
def test_what_a_family_cannot_run_is_refused_naming_the_field(name: str, overrides: dict,
                                                              field: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf_dict(hf_config(name, **overrides))


@pytest.mark.parametrize("spec, match", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "high_freq_factor"),
    ({"rope_type": "llama3", "factor": -1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, "rope_scaling.factor"),
])
def test_bad_llama3_scaling_is_a_value_error_naming_the_field(spec: dict, match: str) -> None:
    cfg = hf_config("llama3", rope_parameters=None, rope_theta=10000.0, rope_scaling=spec)
    with pytest.raises(ValueError, match=match):
        config_from_hf_dict(cfg)


def test_llama3_scaling_reads_from_rope_scaling_or_rope_parameters() -> None:
    new = config_from_hf_dict(hf_config("llama3"))  # transformers 5: rope_parameters
    params = hf_config("llama3")["rope_parameters"]
    old = config_from_hf_dict(hf_config(  # published Llama 3.1 checkpoints: rope_scaling
        "llama3", rope_parameters=None, rope_theta=params["rope_theta"],
        rope_scaling={k: v for k, v in params.items() if k != "rope_theta"}))
    assert new == old and new.rope_scaling is not None
    assert new.rope_scaling.original_max_position_embeddings == 64
    assert config_from_hf_dict(hf_config("llama3-tied")).rope_scaling is None


def test_presets_have_the_published_shapes_and_round_trip() -> None:
    # (class, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, theta)
    shapes = {
        "qwen3-0.6b": (Qwen3Config, 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
        "qwen3-8b": (Qwen3Config, 4096, 36, 32, 8, 128, 12288, 151936, False, 1e6),
        "llama3-8b": (LlamaConfig, 4096, 32, 32, 8, 128, 14336, 128256, False, 5e5),
    }
    for name, want in shapes.items():
        c = preset_config(name)
        assert (type(c), c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size,
                c.tie_word_embeddings, c.rope_theta) == want
    llama = preset_config("meta-llama/llama3-8b")
    assert isinstance(llama, LlamaConfig) and llama.rope_scaling is not None
    assert (llama.rope_scaling.factor, llama.rope_scaling.original_max_position_embeddings,
            llama.max_position_embeddings, llama.rms_norm_eps) == (8.0, 8192, 131072, 1e-5)
    for name, config in PRESETS.items():
        assert config_from_hf_dict(config.to_hf_dict()) == config, name


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3"])
def test_checkpoint_round_trip(tmp_path: Path, preset: str) -> None:
    config = preset_config(preset)
    model = init_random(config, seed=3)
    save_checkpoint(model, config, tmp_path, shards=2)
    assert read_config(tmp_path) == config
    loaded = load_pretrained(tmp_path)
    assert type(loaded.config) is type(config)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_reference_checkpoints_hold_the_family_s_own_tensors() -> None:
    """What the weight table reads from transformers' files: q/k norms for Qwen3, biases for
    Qwen2 only, lm_head only untied; every tensor of each file is read."""
    from jhicache.models.weights import weight_table
    from safetensors import safe_open

    for name in ("qwen2", "qwen3", "llama3", "llama3-tied"):
        with safe_open(ROOT / name / "model.safetensors", framework="np") as f:
            stored = set(f.keys())
        table = {n for names, _, _ in weight_table(read_config(ROOT / name)) for n in names}
        assert table == stored, name
