"""Flax NNX Qwen2 model over a paged KV cache, its config presets and its HF checkpoint loader."""

from jhicache.models.config import Qwen2Config, preset_config
from jhicache.models.functional import ModelPrograms, forward_apply
from jhicache.models.metadata import (
    AttentionMetadata,
    build_metadata,
    metadata_arrays,
    pack_token_array,
    pack_tokens,
    put_int32,
)
from jhicache.models.qwen2 import Qwen2ForCausalLM, init_kv_pages
from jhicache.models.qwen2_weights import init_random, load_pretrained, save_checkpoint

__all__ = [
    "AttentionMetadata",
    "ModelPrograms",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "build_metadata",
    "forward_apply",
    "init_kv_pages",
    "init_random",
    "load_pretrained",
    "metadata_arrays",
    "pack_token_array",
    "pack_tokens",
    "preset_config",
    "put_int32",
    "save_checkpoint",
]
