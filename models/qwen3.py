"""Qwen3 (dense): its config.json fields and its Family record."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jhicache.models.config import refuse_true
from jhicache.models.family import Family
from jhicache.models.qwen2 import Qwen2Config


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    """A Qwen3 decoder: Qwen2's fields, without q/k/v biases (`attention_bias` false; true, which
    would also bias o_proj, is refused), with an RMSNorm over each q and k head before RoPE and
    usually an explicit head_dim (128 in the published ones, != hidden_size / heads)."""

    ARCHITECTURE: ClassVar[str] = "Qwen3ForCausalLM"
    MODEL_TYPE: ClassVar[str] = "qwen3"
    QKV_BIAS: ClassVar[bool] = False
    QK_NORM: ClassVar[bool] = True

    @classmethod
    def _family_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        refuse_true(d, "attention_bias")
        return super()._family_fields(d)

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "attention_bias": False, "head_dim": self.head_dim}


QWEN3 = Family("qwen3", Qwen3Config)
