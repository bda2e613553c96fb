"""The model families jhicache serves, and the choice of one from a config.json or a config."""

from __future__ import annotations

from typing import Any

from jhicache.models.config import DecoderConfig
from jhicache.models.family import Family
from jhicache.models.llama import LLAMA
from jhicache.models.qwen2 import QWEN2
from jhicache.models.qwen3 import QWEN3

FAMILIES: tuple[Family, ...] = (QWEN2, QWEN3, LLAMA)


def family_of(d: Any) -> Family:
    """The family of a parsed config.json: by its `architectures`, else its `model_type`; a
    ValueError naming both and the families served when none matches."""
    if not isinstance(d, dict):
        raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
    archs, model_type = d.get("architectures") or [], d.get("model_type")
    if not isinstance(archs, list):
        raise ValueError(f"architectures must be a list, got {archs!r}")
    for family in FAMILIES:
        if family.architecture in archs or (not archs and family.model_type == model_type):
            if model_type != family.model_type:
                raise ValueError(f"architectures {archs} is {family.name}'s but model_type "
                                 f"{model_type!r} is not {family.model_type!r}")
            return family
    served = ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in FAMILIES)
    raise ValueError(f"unsupported architecture {archs} / model_type {model_type!r}: "
                     f"jhicache serves {served}")


def config_from_hf_dict(d: Any) -> DecoderConfig:
    """A parsed config.json as its family's validated config."""
    return family_of(d).config_class.from_hf_dict(d)


def family_of_config(config: DecoderConfig) -> Family:
    """The family whose config class `config` is (exactly: Qwen3Config extends Qwen2Config)."""
    for family in FAMILIES:
        if type(config) is family.config_class:
            return family
    raise ValueError(f"{type(config).__name__} is no registered family's config")
