"""Independent float64 numpy Qwen2 (HF semantics) over HF-named weights, and random HF
checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file


def small_hf_config(tied: bool = True, **overrides: Any) -> dict[str, Any]:
    """A config.json dict of a tiny Qwen2, in the published checkpoints' format.

    head_dim 16: Triton's bf16 dots need K >= 16, and real Qwen2 head_dims are 64 or 128.
    """
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": tied,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def head_dim(cfg: dict[str, Any]) -> int:
    """transformers' Qwen2: an explicit head_dim, else hidden_size // num_attention_heads."""
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def random_hf_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors ([out, in] Linear weights); norms and biases random too so they
    matter."""
    rng = np.random.default_rng(seed)
    hid, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = head_dim(cfg)
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape: int, scale: float = 0.1, loc: float = 0.0) -> np.ndarray:
        return (loc + scale * rng.standard_normal(shape)).astype(np.float32)

    w = {"model.embed_tokens.weight": rnd(vocab, hid, scale=0.5),
         "model.norm.weight": rnd(hid, loc=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": rnd(q_out, hid, scale=0.3),
            p + "self_attn.q_proj.bias": rnd(q_out),
            p + "self_attn.k_proj.weight": rnd(kv_out, hid, scale=0.3),
            p + "self_attn.k_proj.bias": rnd(kv_out),
            p + "self_attn.v_proj.weight": rnd(kv_out, hid, scale=0.3),
            p + "self_attn.v_proj.bias": rnd(kv_out),
            p + "self_attn.o_proj.weight": rnd(hid, q_out, scale=0.2),
            p + "mlp.gate_proj.weight": rnd(inter, hid, scale=0.2),
            p + "mlp.up_proj.weight": rnd(inter, hid, scale=0.2),
            p + "mlp.down_proj.weight": rnd(hid, inter, scale=0.2),
            p + "input_layernorm.weight": rnd(hid, loc=1.0),
            p + "post_attention_layernorm.weight": rnd(hid, loc=1.0),
        })
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(vocab, hid, scale=0.3)
    return w


def write_hf_checkpoint(directory: Path, cfg: dict[str, Any],
                        weights: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x: np.ndarray, theta: float) -> np.ndarray:  # [N, H, D], positions 0..N-1
    n, _, d = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = (np.cos(np.concatenate([ang, ang], -1))[:, None],
                np.sin(np.concatenate([ang, ang], -1))[:, None])
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def _attention(h: np.ndarray, w: dict[str, np.ndarray], p: str, cfg: dict[str, Any]) -> np.ndarray:
    n = h.shape[0]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = head_dim(cfg)
    proj = lambda name: h @ w[p + name + ".weight"].T + w[p + name + ".bias"]  # noqa: E731
    q = _rope(proj("self_attn.q_proj").reshape(n, nh, d), cfg["rope_theta"])
    k = _rope(proj("self_attn.k_proj").reshape(n, nkv, d), cfg["rope_theta"])
    v = proj("self_attn.v_proj").reshape(n, nkv, d)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * d)
    return out @ w[p + "self_attn.o_proj.weight"].T


def reference_logits(weights: dict[str, np.ndarray], cfg: dict[str, Any],
                     tokens: list[int]) -> np.ndarray:
    """Causal Qwen2 forward of one sequence in float64: logits [N, vocab]."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    eps = cfg["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + _attention(_rms(x, w[p + "input_layernorm.weight"], eps), w, p, cfg)
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate))
                 * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
