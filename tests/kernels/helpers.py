"""Shared test helpers for the kernel tests: random page pools and placement."""

from __future__ import annotations

import numpy as np


def rand(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Fresh non-zero random data (never zeros, so an unwritten output can't pass by accident)."""
    return (rng.standard_normal(shape) + 3.0).astype(dtype)


def poisoned(shape, dtype) -> np.ndarray:
    """NaN-filled pages: compared with equal_nan, they prove untouched pages stay untouched."""
    return np.full(shape, np.nan, dtype)


def same(a, b) -> bool:
    """Bit-exact equality, NaN poison included."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
