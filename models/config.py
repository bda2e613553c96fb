"""Qwen2 model configuration: the HF config.json subset we implement, and named shape presets."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

_ARCHITECTURE = "Qwen2ForCausalLM"
_MODEL_TYPE = "qwen2"
_FULL_ATTENTION = "full_attention"

# config.json fields without a usable default: a published checkpoint always carries them.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_POSITIVE_INTS = _REQUIRED + ("num_key_value_heads", "max_position_embeddings")
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
_BOOLS = ("tie_word_embeddings", "use_sliding_window")
# name -> minimum; the sliding-window fields are recorded but unused (use_sliding_window is
# refused), so a 0 there is let through rather than refusing a checkpoint that loads fine
_OPTIONAL_INTS = {"sliding_window": 0, "max_window_layers": 0, "head_dim": 1}


class UnsupportedConfigError(ValueError, NotImplementedError):
    """A well-formed config asking for a feature jhicache does not implement.

    A ValueError like every other config error; also a NotImplementedError, which it was before.
    """


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Shapes and constants of a Qwen2 decoder; field names follow Hugging Face's config.json.

    `head_dim` None means hidden_size // num_attention_heads (as transformers' Qwen2 reads it) and
    is resolved to that int on construction, so `config.head_dim` is always an int. Because of that,
    `dataclasses.replace(config, hidden_size=...)` keeps the old head_dim: pass head_dim=None too.
    Every field is type- and range-checked here, so direct construction is validated like
    config.json.
    """

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
    # None: hidden_size // num_attention_heads, resolved to that int on construction
    head_dim: int = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            self._normalise(name, _checked_int(name, getattr(self, name), minimum=1))
        for name in _POSITIVE_FLOATS:
            self._normalise(name, _checked_positive_float(name, getattr(self, name)))
        for name in _BOOLS:
            _check_bool(name, getattr(self, name))
        for name, minimum in _OPTIONAL_INTS.items():
            if getattr(self, name) is not None:
                self._normalise(name, _checked_int(name, getattr(self, name), minimum=minimum))
        self._check_shapes()
        if self.use_sliding_window:
            raise UnsupportedConfigError(
                "use_sliding_window=true is not supported: jhicache implements full attention only"
            )

    def _normalise(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: numpy ints become int, ints become float

    def _check_shapes(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} not divisible by num_attention_heads {heads} "
                    "(and no head_dim given)"
                )
            self._normalise("head_dim", self.hidden_size // heads)
        if self.head_dim % 2:  # RoPE rotates the two halves of each head
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates its two halves)")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen2Config:
        """Builds a config from a parsed config.json; rejects other architectures and unsupported
        features.

        A null field counts as absent. num_key_value_heads defaults to num_attention_heads, as in
        transformers; `layer_types`, when present, must list one "full_attention" per layer.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        _check_architecture(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} not supported (Qwen2 uses 'silu')")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config lacks required field(s) {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        config = cls(rope_theta=_rope_theta(d), **kwargs)
        _check_layer_types(d.get("layer_types"), config.num_hidden_layers)
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face Qwen2 checkpoint of this shape carries."""
        d = dataclasses.asdict(self)
        if self.head_dim == self.hidden_size // self.num_attention_heads:
            del d["head_dim"]  # the default: published Qwen2 configs leave it out
        d.update(architectures=[_ARCHITECTURE], model_type=_MODEL_TYPE, hidden_act="silu")
        return {k: v for k, v in d.items() if v is not None}


def _checked_int(name: str, value: Any, *, minimum: int) -> int:
    # bool is an int subclass: `true` where a count belongs is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _checked_positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return number


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")


def _check_layer_types(layer_types: Any, num_layers: int) -> None:
    """transformers' per-layer attention kinds: only full attention is implemented here."""
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ValueError(f"layer_types must be a list of strings, got {layer_types!r}")
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    bad = {i: t for i, t in enumerate(layer_types) if t != _FULL_ATTENTION}
    if bad:
        raise UnsupportedConfigError(
            f"layer_types: layers {sorted(bad)} are {sorted(set(bad.values()))}; "
            f"jhicache implements {_FULL_ATTENTION!r} only"
        )


def _check_architecture(d: dict[str, Any]) -> None:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if not isinstance(archs, list):
        raise ValueError(f"architectures must be a list, got {archs!r}")
    if archs and _ARCHITECTURE not in archs:
        raise ValueError(f"unsupported architecture {archs}: only {_ARCHITECTURE} is implemented")
    if model_type != _MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r}: "
                         f"only {_MODEL_TYPE!r} is implemented")


def _rope_spec(d: dict[str, Any], name: str) -> dict[str, Any]:
    spec = d.get(name) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be an object, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
        raise UnsupportedConfigError(
            f"{name}: rope_type {kind!r} not supported: only default RoPE is implemented"
        )
    return spec


def _rope_theta(d: dict[str, Any]) -> Any:
    """rope_theta from the top level (published checkpoints) or `rope_parameters` (recent
    transformers).

    Returned unconverted: Qwen2Config checks its type and range and names the field.
    """
    params = _rope_spec(d, "rope_parameters")
    _rope_spec(d, "rope_scaling")
    theta = d.get("rope_theta", params.get("rope_theta"))
    return theta if theta is not None else 10_000.0


# Shapes of the published Qwen2 base checkpoints (config.json of Qwen/Qwen2-*), plus a CPU-test
# size.
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
}


def preset_config(name: str) -> Qwen2Config:
    """The config of a named preset (case-insensitive): 'tiny', 'tiny-tp', 'qwen2-0.5b',
    'qwen2-1.5b', 'qwen2-7b' or 'qwen2-72b'."""
    key = name.lower().replace("qwen/", "").replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key]
