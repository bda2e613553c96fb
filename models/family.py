"""Family: the record a model family gives the engine (its config class and decoder module), the
protocol a new family follows."""

from __future__ import annotations

import dataclasses

from jhicache.models.config import DecoderConfig
from jhicache.models.decoder import CausalLM


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family as the engine, warm-up, server and bench take it (`registry.FAMILIES`).

    What a family provides, and where:

    - `config_class`: a `DecoderConfig` subclass naming the family's `ARCHITECTURE` and
      `MODEL_TYPE` (how `registry.family_of` picks it from config.json) and its layers'
      features (`QKV_BIAS`, `QK_NORM`, `rope`); its `from_hf_dict` validates config.json and
      refuses what the family cannot run with an `UnsupportedConfigError` naming the field
      (`_family_fields` is the family's own hook), `to_hf_dict` writes it back.
    - `model_class`: the Flax NNX module built from that config, `model_class(config, dtype=,
      rngs=)`, with `embed(tokens)`, `layer(i, hidden, k_pages, v_pages, meta)` and
      `head(hidden)` (the runner's split: `ModelPrograms`), `embed_tokens`, `layers` and
      `head_module` as submodules, and every layer's attention calling
      `decoder.attend` (paged attention over the device pool, gated per layer on its loads).
      The shared `decoder.CausalLM` serves every family here: its config's features shape it.
    - Weights: the weight table (`weights.weight_table`) and the tensor-parallel rules
      (`sharding.TensorParallel.spec`, `sharding.column_parts`) are derived from the same
      features and parameter names, so a family whose layer uses only the shared modules needs
      none of its own; safetensors loading, single or sharded, is shared (`load_pretrained`).

    Adding a family: a file under models/ with its config subclass and its `Family` record,
    listed in `registry.FAMILIES`, and presets of its published shapes in `presets.PRESETS`.
    """

    name: str  # e.g. "qwen3"; the presets' and the README's name
    config_class: type[DecoderConfig]
    model_class: type[CausalLM] = CausalLM

    @property
    def architecture(self) -> str:
        return self.config_class.ARCHITECTURE

    @property
    def model_type(self) -> str:
        return self.config_class.MODEL_TYPE
