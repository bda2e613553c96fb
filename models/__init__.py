"""Flax NNX decoders over a paged KV cache (Qwen2, Qwen3, Llama 3: `FAMILIES`), their config
presets and their HF checkpoint loader."""

from jhicache.models.config import DecoderConfig, Llama3Scaling, UnsupportedConfigError
from jhicache.models.decoder import CausalLM, attend, init_kv_pages
from jhicache.models.family import Family
from jhicache.models.functional import ModelPrograms, forward_apply
from jhicache.models.llama import LlamaConfig
from jhicache.models.metadata import (
    AttentionMetadata,
    build_metadata,
    metadata_arrays,
    pack_token_array,
    pack_tokens,
    put_int32,
)
from jhicache.models.presets import PRESETS, preset_config
from jhicache.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from jhicache.models.qwen3 import Qwen3Config
from jhicache.models.registry import FAMILIES, config_from_hf_dict, family_of, family_of_config
from jhicache.models.weights import (
    init_random,
    load_pretrained,
    read_config,
    save_checkpoint,
)

__all__ = [
    "FAMILIES",
    "PRESETS",
    "AttentionMetadata",
    "CausalLM",
    "DecoderConfig",
    "Family",
    "Llama3Scaling",
    "LlamaConfig",
    "ModelPrograms",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "Qwen3Config",
    "UnsupportedConfigError",
    "attend",
    "build_metadata",
    "config_from_hf_dict",
    "family_of",
    "family_of_config",
    "forward_apply",
    "init_kv_pages",
    "init_random",
    "load_pretrained",
    "metadata_arrays",
    "pack_token_array",
    "pack_tokens",
    "preset_config",
    "put_int32",
    "read_config",
    "save_checkpoint",
]
