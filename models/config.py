"""DecoderConfig: the config.json fields every family shares, their checks, RoPE's settings, and
the error for what jhicache does not implement."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, Self

_FULL_ATTENTION = "full_attention"

# config.json fields without a usable default: a published checkpoint always carries them.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_POSITIVE_INTS = _REQUIRED + ("num_key_value_heads", "max_position_embeddings")
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
# Mixture-of-experts fields of the families' MoE siblings: a dense family refuses them
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class UnsupportedConfigError(ValueError, NotImplementedError):
    """A well-formed config asking for a feature jhicache does not implement.

    A ValueError like every other config error; also a NotImplementedError, which it was before.
    """


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """RoPE scaling of type `llama3` (Llama 3.1+): frequencies whose wavelength exceeds the
    original context / low_freq_factor are divided by `factor`, those under original context /
    high_freq_factor kept, and those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        prefix = "rope_scaling."
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = checked_positive_float(prefix + name, getattr(self, name))
            object.__setattr__(self, name, value)
        name = "original_max_position_embeddings"
        value = checked_int(prefix + name, getattr(self, name), minimum=1)
        object.__setattr__(self, name, value)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor {self.high_freq_factor} must exceed "
                             f"low_freq_factor {self.low_freq_factor}")

    @classmethod
    def from_hf_dict(cls, spec: dict[str, Any], name: str) -> Llama3Scaling:
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [f for f in fields if spec.get(f) is None]
        if missing:
            raise ValueError(f"{name} of rope_type 'llama3' lacks {', '.join(missing)}")
        return cls(**{f: spec[f] for f in fields})

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding: base `theta` and, for Llama 3.1+, its frequency scaling."""

    theta: float
    scaling: Llama3Scaling | None = None


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and constants of a pre-norm decoder (GQA attention with RoPE, SwiGLU MLP, RMSNorm);
    field names follow Hugging Face's config.json. A family subclasses it (its file under
    models/), naming its architecture and the features of its layers in class variables.

    `head_dim` None means hidden_size // num_attention_heads (as transformers reads it) and is
    resolved to that int on construction, so `config.head_dim` is always an int. Because of
    that, `dataclasses.replace(config, hidden_size=...)` keeps the old head_dim: pass
    head_dim=None too. Every field is type- and range-checked here, so direct construction is
    validated like config.json.
    """

    # config.json's `architectures` entry and `model_type` of the family
    ARCHITECTURE: ClassVar[str] = ""
    MODEL_TYPE: ClassVar[str] = ""
    # The layer's features, which the shared modules (decoder.py) and the weight table
    # (weights.py) read: q, k and v projections with biases; an RMSNorm over each q and k head
    # before RoPE
    QKV_BIAS: ClassVar[bool] = False
    QK_NORM: ClassVar[bool] = False
    # Optional int fields: name -> minimum
    _OPTIONAL_INTS: ClassVar[dict[str, int]] = {"head_dim": 1}
    _BOOLS: ClassVar[tuple[str, ...]] = ("tie_word_embeddings",)

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
    # None: hidden_size // num_attention_heads, resolved to that int on construction
    head_dim: int = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            self._normalise(name, checked_int(name, getattr(self, name), minimum=1))
        for name in _POSITIVE_FLOATS:
            self._normalise(name, checked_positive_float(name, getattr(self, name)))
        for name in self._BOOLS:
            _check_bool(name, getattr(self, name))
        for name, minimum in self._OPTIONAL_INTS.items():
            if getattr(self, name) is not None:
                self._normalise(name, checked_int(name, getattr(self, name), minimum=minimum))
        self._check_shapes()

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

    @property
    def rope(self) -> Rope:
        """The layers' rotary embedding."""
        return Rope(self.rope_theta)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Self:
        """Builds a config from a parsed config.json; rejects other architectures and unsupported
        features, naming the field.

        A null field counts as absent. num_key_value_heads defaults to num_attention_heads, as in
        transformers; `layer_types`, when present, must list one "full_attention" per layer.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        cls._check_architecture(d)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(
                f"hidden_act {d['hidden_act']!r} not supported (SwiGLU with 'silu' only)")
        for name in _MOE_FIELDS:
            if d.get(name):
                raise UnsupportedConfigError(
                    f"{name}={d[name]!r}: mixture-of-experts layers are not supported")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config lacks required field(s) {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        kwargs.update(cls._family_fields(d))
        config = cls(rope_theta=rope_theta(d), **kwargs)
        _check_layer_types(d.get("layer_types"), config.num_hidden_layers)
        return config

    @classmethod
    def _family_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Fields a family parses itself from config.json (overriding the plain copies), after
        refusing what it does not implement. Here: only default RoPE is implemented."""
        rope_spec(d, allowed=("default",))
        return {}

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face checkpoint of this shape carries."""
        d = dataclasses.asdict(self)
        if d.get("head_dim") == self.hidden_size // self.num_attention_heads:
            del d["head_dim"]  # the default: published configs may leave it out
        d.update(architectures=[self.ARCHITECTURE], model_type=self.MODEL_TYPE, hidden_act="silu")
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def _check_architecture(cls, d: dict[str, Any]) -> None:
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if not isinstance(archs, list):
            raise ValueError(f"architectures must be a list, got {archs!r}")
        if archs and cls.ARCHITECTURE not in archs:
            raise ValueError(f"unsupported architecture {archs}: "
                             f"{cls.__name__} reads {cls.ARCHITECTURE} only")
        if model_type != cls.MODEL_TYPE:
            raise ValueError(f"unsupported model_type {model_type!r}: "
                             f"{cls.__name__} reads {cls.MODEL_TYPE!r} only")


def checked_int(name: str, value: Any, *, minimum: int) -> int:
    """`value` as an int >= minimum; a ValueError naming the field otherwise."""
    # bool is an int subclass: `true` where a count belongs is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def checked_positive_float(name: str, value: Any) -> float:
    """`value` as a finite float > 0; a ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return number


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")


def refuse_true(d: dict[str, Any], *names: str) -> None:
    """An UnsupportedConfigError naming the first of `names` that config.json sets true."""
    for name in names:
        value = d.get(name, False)
        if value is not None and value is not False:
            raise UnsupportedConfigError(f"{name}={value!r} is not supported "
                                         f"(jhicache implements {name}=false only)")


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


def rope_spec(d: dict[str, Any], allowed: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """(field name, its object) of the RoPE settings in config.json: `rope_scaling` (published
    checkpoints) or `rope_parameters` (recent transformers), whichever names a type other than
    default, its `rope_type` (or older `type`) checked to be one of `allowed`."""
    found: tuple[str, dict[str, Any]] = ("rope_scaling", {})
    for name in ("rope_parameters", "rope_scaling"):
        spec = d.get(name) or {}
        if not isinstance(spec, dict):
            raise ValueError(f"{name} must be an object, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in allowed:
            raise UnsupportedConfigError(
                f"{name}: rope_type {kind!r} not supported: this family implements "
                f"{', '.join(repr(a) for a in allowed)}")
        if kind != "default":
            found = (name, spec)
    return found


def rope_theta(d: dict[str, Any]) -> Any:
    """rope_theta from the top level (published checkpoints) or `rope_parameters` (recent
    transformers).

    Returned unconverted: the config checks its type and range and names the field.
    """
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    return theta if theta is not None else 10_000.0
