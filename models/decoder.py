"""CausalLM: the Flax NNX decoder every family shares (RMSNorm, RoPE and Llama 3's scaling, GQA
attention through `attend`, the one paged-attention call, SwiGLU MLP, head), its layers shaped
by the family's config."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jhicache.models.config import DecoderConfig, Llama3Scaling, Rope
from jhicache.models.metadata import AttentionMetadata
from jhicache.models.sharding import LOCAL, Collectives
from jhicache.pallas_kernels import LayerGate
from jhicache.pallas_kernels.decode_attention import paged_decode_attention
from jhicache.pallas_kernels.extend_attention import paged_attention
from jhicache.pallas_kernels.fresh_attention import attend_fresh_apart
from jhicache.pallas_kernels.kv_write import write_kv
from jhicache.pallas_kernels.skinny_matmul import skinny_applies, skinny_matmul

_INIT_STD = 0.02  # HF's initializer_range; keeps random-weight activations O(1)

KVPages = tuple[jax.Array, jax.Array]  # ([num_pages, page_size, num_kv_heads, head_dim]) * 2


def _normal() -> nnx.Initializer:
    return nnx.initializers.normal(_INIT_STD)


def _precision(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """float32 models are for exactness (tests, HF parity): keep GPUs from using TF32 in their
    matmuls."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _linear(n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, precision=_precision(dtype),
        kernel_init=_normal(), bias_init=_normal(), rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """HF's RMSNorm (Qwen2, Qwen3, Llama alike): normalise the last axis in float32, cast back
    to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        return self.weight[...] * (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Llama3Scaling | None = None) -> jax.Array:
    """HF's RoPE inverse frequencies in float32, [head_dim / 2]; with `scaling`, Llama 3's: long
    wavelengths (past the original context / low_freq_factor) slowed by `factor`, short ones
    (under original context / high_freq_factor) kept, those between interpolated."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)  # 0 at the long end, 1 at the short end
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen > context / low, inv_freq / scaling.factor,
                     jnp.where(wavelen < context / high, inv_freq, blended))


def rope_cos_sin(positions: jax.Array, head_dim: int, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """HF RoPE tables in float32: ([T, head_dim], [T, head_dim]), halves repeated."""
    inv_freq = rope_inv_freq(head_dim, rope.theta, rope.scaling)  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF rotate_half convention (not interleaved); tables cast to x's dtype first, as HF does."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [T, H, D]
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def attend(q: jax.Array, new_kv: tuple[jax.Array, jax.Array], k_pages: jax.Array,
           v_pages: jax.Array, meta: AttentionMetadata, sm_scale: float, layer: int) -> jax.Array:
    """The one attention call of every family's layer: paged attention of q [T, H, D] over layer
    `layer`'s cache (this step's K/V, `new_kv`, written
    in it), by the decode kernel when the batch is decode-only; a long extend batch hands its new
    tokens' attention among themselves to cuDNN (`attend_fresh_apart`). This is where a forward
    waits for loaded pages: with `load_flags`, the kernel first waits on the device until the
    layer's flag says its loads have landed."""
    gate = None
    if meta.load_flags is not None:
        assert meta.load_seq is not None  # set with the flags (`build_metadata`)
        gate = LayerGate(meta.load_flags, meta.load_seq, jnp.full((1,), layer, jnp.int32))
    if meta.decode_only:
        return paged_decode_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens,
                                      sm_scale=sm_scale, gate=gate)
    apart = attend_fresh_apart(q.shape[0], q.dtype)
    return paged_attention(
        q, k_pages, v_pages, meta.page_table, meta.seq_lens, meta.query_start, meta.query_lens,
        sm_scale=sm_scale, gate=gate, new_kv=new_kv if apart else None
    )


class Attention(nnx.Module):
    """GQA self-attention: q, k and v as one projection (`qkv_proj`, columns [q | k | v]; with
    biases where the family's QKV_BIAS says), o_proj without bias; with QK_NORM an RMSNorm over
    each q and k head before RoPE (Qwen3); K/V go through the paged cache (`attend`).

    One merged projection rather than three: the forward reads its weights in one matmul and
    passes one array instead of three (vLLM's QKVParallelLinear does the same). Head counts are
    read off the weights, not the config: inside `shard_map` a device holds only its heads (its
    [q | k | v] columns, `TensorParallel.to_storage`) and its shard of the pages, and `comm`
    sums o_proj's partial outputs over the devices.
    """

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = _linear(config.hidden_size, (h + 2 * kv) * d, config.QKV_BIAS, dtype,
                                rngs)
        self.o_proj = _linear(h * d, config.hidden_size, False, dtype, rngs)
        norm = config.QK_NORM
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype) if norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype) if norm else None
        self.head_dim = d
        self.rope = config.rope

    def __call__(
        self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
        comm: Collectives = LOCAL, layer: int = 0,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # x [T, hidden] -> ([T, hidden], pages, pages)
        d, t = self.head_dim, x.shape[0]
        q_cols = self.o_proj.kernel.shape[0]  # this device's query heads x head_dim
        qkv = self.qkv_proj(x)
        kv_cols = (qkv.shape[1] - q_cols) // 2
        cos, sin = rope_cos_sin(meta.positions, d, self.rope)
        q = qkv[:, :q_cols].reshape(t, -1, d)  # [T, H, D]
        k = qkv[:, q_cols:q_cols + kv_cols].reshape(t, -1, d)  # [T, KV, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = qkv[:, q_cols + kv_cols:].reshape(t, -1, d)  # [T, KV, D]
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, meta.page_table, meta.token_req,
                                    meta.positions)
        out = attend(q, (k, v), k_pages, v_pages, meta, d**-0.5, layer)  # [T, H, D]
        return comm.sum(self._o_proj(out.reshape(t, -1).astype(x.dtype))), k_pages, v_pages

    def _o_proj(self, x: jax.Array) -> jax.Array:
        """o_proj, by the skinny-matmul kernel for a few 16-bit rows: XLA's own kernel reads
        this weight far below HBM speed inside the forward (`skinny_matmul`'s docstring); the
        other projections' weights are read near it by XLA's."""
        weight = self.o_proj.kernel[...]
        return skinny_matmul(x, weight) if skinny_applies(x, weight) else self.o_proj(x)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases, gate and up as one projection
    (`gate_up_proj`, columns [gate | up], as vLLM's MergedColumnParallelLinear); `comm` sums
    down's partial outputs."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        inter = config.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * inter, False, dtype, rngs)
        self.down_proj = _linear(inter, config.hidden_size, False, dtype, rngs)

    # [T, hidden] -> [T, hidden]
    def __call__(self, x: jax.Array, comm: Collectives = LOCAL) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return comm.sum(self.down_proj(jax.nn.silu(gate) * up))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(
        self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
        comm: Collectives = LOCAL, layer: int = 0,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # x [T, hidden]; `layer`: this layer's index
        attn, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, meta,
                                                comm, layer)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), comm), k_pages, v_pages


class LMHead(nnx.Module):
    """Final norm and vocabulary projection; reuses the embedding table when tied. Sharded, each
    device projects onto its slice of the vocabulary and `comm` gathers the slices."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, embed: nnx.Embed | None,
                 rngs: nnx.Rngs):
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.embed = embed
        shape = (config.hidden_size, config.vocab_size)
        self.kernel = (None if embed is not None
                       else nnx.Param(_normal()(rngs.params(), shape, dtype)))

    # [T, hidden] -> [T, vocab] f32
    def __call__(self, x: jax.Array, comm: Collectives = LOCAL) -> jax.Array:
        x = self.norm(x)
        # [hidden, vocab]
        if self.embed is not None:
            weight = self.embed.embedding[...].T
        else:
            assert self.kernel is not None  # untied: __init__ made it
            weight = self.kernel[...]
        return comm.gather_last(jnp.dot(x, weight, precision=_precision(x.dtype),
                                        preferred_element_type=jnp.float32))


class CausalLM(nnx.Module):
    """A family's decoder (its config's class says which layers) exposed in pieces (embed,
    layer i, head) so a runner can drive layers one by one."""

    def __init__(self, config: DecoderConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
            embedding_init=_normal(), rngs=rngs
        )
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs)
                                for _ in range(config.num_hidden_layers)])
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.head_module = LMHead(config, dtype, tied, rngs)

    def embed(self, tokens: jax.Array) -> jax.Array:  # [T] int32 -> [T, hidden]
        return self.embed_tokens(tokens)

    def layer(
        self, i: int, hidden: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
        meta: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Decoder layer i; writes this step's K/V into the layer's pages and returns the new pages.

        The page arguments are consumed (write_kv donates them), also when called eagerly.
        """
        return self.layers[i](hidden, k_pages, v_pages, meta, layer=i)

    def head(self, hidden: jax.Array) -> jax.Array:  # [T, hidden] -> [T, vocab] float32
        return self.head_module(hidden)

    def forward(
        self, tokens: jax.Array, kv: list[KVPages], meta: AttentionMetadata
    ) -> tuple[jax.Array, list[KVPages]]:  # tokens [T] -> (logits [T, vocab] float32, new kv)
        hidden = self.embed(tokens)
        new_kv = []
        for i, (k_pages, v_pages) in enumerate(kv):
            hidden, k_pages, v_pages = self.layer(i, hidden, k_pages, v_pages, meta)
            new_kv.append((k_pages, v_pages))
        return self.head(hidden), new_kv

    __call__ = forward


def init_kv_pages(config: DecoderConfig, num_pages: int, page_size: int,
                  dtype: jnp.dtype = jnp.float32) -> list[KVPages]:
    """Zeroed per-layer (k_pages, v_pages), each [num_pages, page_size, num_kv_heads, head_dim]."""
    shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(config.num_hidden_layers)]
