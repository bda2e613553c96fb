"""Shared helpers for the kernels: row chunking and cheap argument validation."""

from __future__ import annotations

import jax
import numpy as np

_MAX_CHUNK = 4096  # elements per vector copy: a power of two, so Triton accepts the block


def row_chunk(row: int, limit: int = _MAX_CHUNK) -> int:
    """Largest power of two dividing `row`, capped at `limit`: chunks then need no masks."""
    return min(row & -row, limit)


def is_concrete(x: object) -> bool:
    """True for arrays whose values can be read now (not tracers inside a jit)."""
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def check(cond: bool, message: str) -> None:
    """Raises a ValueError with `message` unless `cond`."""
    if not cond:
        raise ValueError(message)


def check_pages_pair(name: str, k: jax.Array, v: jax.Array) -> None:
    """K and V page arrays must be 4-D [pages, page_size, kv_heads, head_dim] and alike."""
    check(k.ndim == 4,
          f"{name}: expected [num_pages, page_size, num_kv_heads, head_dim], got {k.shape}")
    check(k.shape == v.shape, f"{name}: K shape {k.shape} != V shape {v.shape}")
    check(k.dtype == v.dtype, f"{name}: K dtype {k.dtype} != V dtype {v.dtype}")


def check_ids(name: str, ids: jax.Array, limit: int, *, length: int | None = None,
              unique: bool = False) -> None:
    """Page ids: 1-D int32; when concrete, inside [0, limit) and (if `unique`) without repeats."""
    check(ids.ndim == 1, f"{name}: expected a 1-D array, got shape {ids.shape}")
    check(ids.dtype == np.int32, f"{name}: expected int32, got {ids.dtype}")
    check(length is None or ids.shape[0] == length, f"{name}: length {ids.shape[0]} != {length}")
    if not is_concrete(ids) or ids.shape[0] == 0:
        return
    values = np.asarray(ids)
    bad = values[(values < 0) | (values >= limit)]
    check(bad.size == 0, f"{name}: page ids out of range [0, {limit}): {bad[:8].tolist()}")
    check(not unique or np.unique(values).size == values.size,
          f"{name}: repeated destination page ids")
