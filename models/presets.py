"""Named model shapes: the published checkpoints' config.json shapes of each family, and tiny
ones for CPU tests."""

from __future__ import annotations

from jhicache.models.config import DecoderConfig, Llama3Scaling
from jhicache.models.llama import LlamaConfig
from jhicache.models.qwen2 import Qwen2Config
from jhicache.models.qwen3 import Qwen3Config

# Shapes of the published base checkpoints (config.json of Qwen/Qwen2-*, Qwen/Qwen3-*,
# meta-llama/Llama-3.1-8B), plus CPU-test sizes.
PRESETS: dict[str, DecoderConfig] = {
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
    # Tensor-parallel tests: 8 query and 4 KV heads split 1, 2 or 4 ways without replication.
    "tiny-tp": Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
    ),
    "qwen2-7b": Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
        sliding_window=131072, max_window_layers=28,
    ),
    "qwen2-72b": Qwen2Config(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
        sliding_window=131072, max_window_layers=80,
    ),
    # A CPU-test Qwen3: head_dim 32 with 4 heads over hidden 64 (explicit, != hidden / heads,
    # as the published ones' 128)
    "tiny-qwen3": Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
    ),
    "qwen3-0.6b": Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=True, sliding_window=None, max_window_layers=28,
    ),
    "qwen3-8b": Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=False, sliding_window=None, max_window_layers=36,
    ),
    # A CPU-test Llama 3.1: its RoPE scaling's original context short enough (64) that the
    # scaled, blended and kept frequencies all occur at head_dim 16
    "tiny-llama3": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10_000.0, tie_word_embeddings=False,
        rope_scaling=Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64),
    ),
    # meta-llama/Llama-3.1-8B (Meta-Llama-3-8B: the same shapes, 8192 positions, no scaling)
    "llama3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False,
        rope_scaling=Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192),
    ),
}


def preset_config(name: str) -> DecoderConfig:
    """The config of a named preset (case-insensitive, an `org/` prefix dropped): one of
    PRESETS' names."""
    key = name.lower().split("/")[-1].replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key]
