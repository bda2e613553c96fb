"""Page keys: a page's storage identity, SHA-256 over the previous page's key and the page's
token ids, so that a prefix is a chain of keys and a key names its whole prefix."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 32
ROOT_KEY = b""  # what the first page of every prefix chains from


def chain_keys(tokens: Sequence[int], page_size: int, previous: bytes = ROOT_KEY) -> list[bytes]:
    """One key per whole page of `tokens` (a partial last page has none), each chained from
    the one before it, the first from `previous` (the key of the page before `tokens`)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    keys: list[bytes] = []
    packer = struct.Struct(f"<{page_size}I")  # token ids as 4-byte little-endian, as SGLang
    for start in range(0, len(tokens) - page_size + 1, page_size):
        digest = hashlib.sha256(previous)
        digest.update(packer.pack(*tokens[start:start + page_size]))
        previous = digest.digest()
        keys.append(previous)
    return keys
