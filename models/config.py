"""Qwen2 model configuration: the HF config.json subset we implement, and named shape presets."""

from __future__ import annotations

import dataclasses
from typing import Any

_ARCHITECTURE = "Qwen2ForCausalLM"
_MODEL_TYPE = "qwen2"


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Shapes and constants of a Qwen2 decoder; field names follow Hugging Face's config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.use_sliding_window:
            raise NotImplementedError(
                "use_sliding_window=true is not supported: jhicache implements full attention only"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen2Config:
        """Builds a config from a parsed config.json; rejects other architectures and unsupported features."""
        _check_architecture(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} not supported (Qwen2 uses 'silu')")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
        return cls(rope_theta=_rope_theta(d), **kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face Qwen2 checkpoint of this shape carries."""
        d = dataclasses.asdict(self)
        d.update(architectures=[_ARCHITECTURE], model_type=_MODEL_TYPE, hidden_act="silu")
        return {k: v for k, v in d.items() if v is not None}


def _check_architecture(d: dict[str, Any]) -> None:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs and _ARCHITECTURE not in archs:
        raise ValueError(f"unsupported architecture {archs}: only {_ARCHITECTURE} is implemented")
    if model_type != _MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r}: only {_MODEL_TYPE!r} is implemented")


def _rope_theta(d: dict[str, Any]) -> float:
    """rope_theta from the top level (published checkpoints) or `rope_parameters` (recent transformers)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise NotImplementedError(f"rope_type {kind!r} not supported: only default RoPE is implemented")
    theta = d.get("rope_theta", params.get("rope_theta"))
    return float(theta) if theta is not None else 10_000.0


# Shapes of the published Qwen2 base checkpoints (config.json of Qwen/Qwen2-*), plus a CPU-test size.
PRESETS: dict[str, Qwen2Config] = {
    "tiny": Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True,
    ),
    "qwen2-0.5b": Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        sliding_window=131072, max_window_layers=24,
    ),
    "qwen2-1.5b": Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        sliding_window=131072, max_window_layers=28,
    ),
    "qwen2-7b": Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
        sliding_window=131072, max_window_layers=28,
    ),
}


def preset_config(name: str) -> Qwen2Config:
    """The config of a named preset: 'tiny', 'qwen2-0.5b', 'qwen2-1.5b' or 'qwen2-7b' (case-insensitive)."""
    key = name.lower().replace("qwen/", "").replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key]
