"""Llama 3 (and 3.1+, with RoPE scaling of type llama3): its config.json fields and its Family
record."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jhicache.models.config import (
    DecoderConfig,
    Llama3Scaling,
    Rope,
    UnsupportedConfigError,
    refuse_true,
    rope_spec,
)
from jhicache.models.family import Family


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """A Llama decoder: no biases (`attention_bias` and `mlp_bias` true are refused), RoPE
    default or scaled as Llama 3.1+'s (`rope_scaling` of rope_type llama3), embeddings tied or
    not."""

    ARCHITECTURE: ClassVar[str] = "LlamaForCausalLM"
    MODEL_TYPE: ClassVar[str] = "llama"

    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: Llama3Scaling | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        scaling = self.rope_scaling
        if scaling is not None and not isinstance(scaling, Llama3Scaling):
            raise ValueError(f"rope_scaling must be a Llama3Scaling or None, got {scaling!r}")

    @property
    def rope(self) -> Rope:
        return Rope(self.rope_theta, self.rope_scaling)

    @classmethod
    def _family_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        refuse_true(d, "attention_bias", "mlp_bias")
        if d.get("pretraining_tp", 1) != 1:  # sliced matmuls in transformers: same maths, but
            # a checkpoint asking for them is one we have not checked
            raise UnsupportedConfigError(f"pretraining_tp={d['pretraining_tp']!r} not supported")
        name, spec = rope_spec(d, allowed=("default", "llama3"))
        return {"rope_scaling": Llama3Scaling.from_hf_dict(spec, name) if spec else None}

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return {**d, "attention_bias": False, "mlp_bias": False}


LLAMA = Family("llama", LlamaConfig)
