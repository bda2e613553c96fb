"""Qwen2 (and Qwen2.5): its config.json fields and its Family record."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jhicache.models.config import DecoderConfig, UnsupportedConfigError
from jhicache.models.decoder import CausalLM
from jhicache.models.family import Family

# The shared decoder: a Qwen2Config gives it Qwen2's layers (kept as the name callers know)
Qwen2ForCausalLM = CausalLM


@dataclasses.dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
    """A Qwen2 decoder: q, k and v projections with biases. The sliding-window fields are
    recorded but unused (use_sliding_window is refused, so a 0 there is let through rather than
    refusing a checkpoint that loads fine)."""

    ARCHITECTURE: ClassVar[str] = "Qwen2ForCausalLM"
    MODEL_TYPE: ClassVar[str] = "qwen2"
    QKV_BIAS: ClassVar[bool] = True
    _OPTIONAL_INTS: ClassVar[dict[str, int]] = {"sliding_window": 0, "max_window_layers": 0,
                                                "head_dim": 1}
    _BOOLS: ClassVar[tuple[str, ...]] = ("tie_word_embeddings", "use_sliding_window")

    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_sliding_window:
            raise UnsupportedConfigError(
                "use_sliding_window=true is not supported: jhicache implements full attention only"
            )


QWEN2 = Family("qwen2", Qwen2Config)
