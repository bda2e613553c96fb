"""Qwen2Config validation: every ill-typed, missing or unsupported config.json field is a ValueError
that names the field, whether the config comes from a dict or is constructed directly."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
from jhicache.models import Qwen2Config

from tests.models.numpy_reference import small_hf_config

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def _direct_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return {**kwargs, **overrides}


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_key_value_heads", 0),  # was ZeroDivisionError
        ("num_attention_heads", 0),
        ("hidden_size", "64"),  # was TypeError
        ("hidden_size", 64.0),
        ("num_hidden_layers", True),  # a bool is an int in Python; not a layer count
        ("vocab_size", -1),
        ("intermediate_size", [64]),
        ("max_position_embeddings", 1.5),
        ("rms_norm_eps", "1e-6"),
        ("rms_norm_eps", float("nan")),
        ("rms_norm_eps", 0.0),
        ("rope_theta", float("inf")),
        ("rope_theta", -10000.0),
        ("tie_word_embeddings", "false"),
        ("tie_word_embeddings", 1),
        ("use_sliding_window", 0),
        ("sliding_window", "4096"),
        ("max_window_layers", -1),
        ("head_dim", 0),
        ("head_dim", 15),  # odd: RoPE rotates two halves
        ("head_dim", "16"),
    ],
)
def test_bad_field_is_value_error_naming_it(field: str, value: Any):
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        Qwen2Config.from_hf_dict(small_hf_config(**{field: value}))
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    with pytest.raises(ValueError, match=re.escape(field)):
        Qwen2Config(**_direct_kwargs(**{field: value}))


@pytest.mark.parametrize("field", _REQUIRED)
@pytest.mark.parametrize("how", ["absent", "null"])
def test_missing_required_field_is_named(field: str, how: str):
    cfg = small_hf_config()
    if how == "absent":
        del cfg[field]
    else:
        cfg[field] = None
    with pytest.raises(ValueError, match=f"required field.*{field}"):
        Qwen2Config.from_hf_dict(cfg)


def test_missing_num_key_value_heads_means_one_per_head_as_in_transformers():
    cfg = small_hf_config()
    del cfg["num_key_value_heads"]
    assert Qwen2Config.from_hf_dict(cfg).num_key_value_heads == cfg["num_attention_heads"]


@pytest.mark.parametrize("value", [[{"hidden_size": 64}], "qwen2", 3, None])
def test_config_that_is_not_an_object(value: Any):
    with pytest.raises(ValueError, match="JSON object"):
        Qwen2Config.from_hf_dict(value)


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"hidden_size": 60, "num_attention_heads": 8},
         ("hidden_size 60", "num_attention_heads 8")),
        ({"num_attention_heads": 4, "num_key_value_heads": 3},
         ("num_attention_heads 4", "num_key_value_heads 3")),
        ({"num_attention_heads": 4, "num_key_value_heads": 8},
         ("num_attention_heads 4", "num_key_value_heads 8")),
    ],
)
def test_divisibility_errors_name_both_fields(overrides: dict[str, int], names: tuple[str, str]):
    for build in (lambda: Qwen2Config.from_hf_dict(small_hf_config(**overrides)),
                  lambda: Qwen2Config(**_direct_kwargs(**overrides))):
        with pytest.raises(ValueError) as info:
            build()
        assert all(n in str(info.value) for n in names), str(info.value)


def test_numbers_are_normalised():
    """numpy ints (e.g. from a shape) are accepted as ints; an int eps or theta becomes a float."""
    config = Qwen2Config(**_direct_kwargs(vocab_size=np.int64(97)), rms_norm_eps=1,
                         rope_theta=10000)
    assert type(config.vocab_size) is int and type(config.rms_norm_eps) is float
    assert type(config.rope_theta) is float and config.rope_theta == 10000.0


def test_head_dim_field():
    default = Qwen2Config.from_hf_dict(small_hf_config())
    assert default.head_dim == 16 and "head_dim" not in default.to_hf_dict()
    assert Qwen2Config.from_hf_dict(small_hf_config(head_dim=16)) == default
    assert Qwen2Config.from_hf_dict(small_hf_config(head_dim=None)) == default
    wide = Qwen2Config.from_hf_dict(small_hf_config(head_dim=32))
    assert wide.head_dim == 32 and wide.to_hf_dict()["head_dim"] == 32
    assert Qwen2Config.from_hf_dict(wide.to_hf_dict()) == wide
    # an explicit head_dim frees hidden_size from divisibility by the head count, as in transformers
    odd = Qwen2Config.from_hf_dict(small_hf_config(hidden_size=60, head_dim=16))
    assert (odd.hidden_size, odd.head_dim) == (60, 16)
    assert dataclasses.replace(odd, num_hidden_layers=3).head_dim == 16


def test_layer_types_other_than_full_attention_are_refused_by_name():
    full = ["full_attention", "full_attention"]
    assert Qwen2Config.from_hf_dict(small_hf_config(layer_types=full)).num_hidden_layers == 2
    with pytest.raises(ValueError, match=r"layer_types.*\[1\].*sliding_attention"):
        Qwen2Config.from_hf_dict(
            small_hf_config(layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(NotImplementedError):  # unsupported, not malformed: both types hold
        Qwen2Config.from_hf_dict(small_hf_config(layer_types=["sliding_attention"] * 2))


@pytest.mark.parametrize("layer_types", [["full_attention"] * 3, "full_attention", [1, 2]])
def test_malformed_layer_types(layer_types: Any):
    with pytest.raises(ValueError, match="layer_types"):
        Qwen2Config.from_hf_dict(small_hf_config(layer_types=layer_types))


def test_unsupported_features_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2Config.from_hf_dict(small_hf_config(use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2Config(**_direct_kwargs(use_sliding_window=True))
    with pytest.raises(ValueError, match="rope_scaling.*yarn"):
        Qwen2Config.from_hf_dict(small_hf_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_scaling"):
        Qwen2Config.from_hf_dict(small_hf_config(rope_scaling="yarn"))
    with pytest.raises(ValueError, match="architectures"):
        Qwen2Config.from_hf_dict(small_hf_config(architectures="Qwen2ForCausalLM"))
