"""The benchmark's fixed shapes (Qwen2 models, page 64, bf16) and its random arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SHAPES: dict[str, dict[str, int]] = {"qwen2-0.5b": dict(layers=24, kv_heads=2, dim=64, heads=14),
          "qwen2-7b": dict(layers=28, kv_heads=4, dim=128, heads=28)}
PAGE = 64
DT = jnp.bfloat16


def random_array(key: int, shape: tuple[int, ...], dtype: jnp.dtype = DT,
                 sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """Standard normal values (drawn in float32) from seed `key` in dtype, optionally placed."""
    x = jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)
    return x if sharding is None else jax.device_put(x, sharding)

