"""Random ragged batches for the kernel tests: page tables, token layout, prefixes ending
mid-page."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    page_table: np.ndarray  # [B, max_pages] int32, distinct pages, unused columns = 0
    seq_lens: np.ndarray  # [B] int32, prefix + new
    query_lens: np.ndarray  # [B] int32
    query_start: np.ndarray  # [B] int32
    token_req: np.ndarray  # [T] int32, -1 = padding
    positions: np.ndarray  # [T] int32
    num_pages: int


def make_batch(rng, prefix_lens, new_lens, page_size: int, *, pad_tokens: int = 0,
               pad_requests: int = 0, spare_pages: int = 2) -> Batch:
    """Requests i with prefix_lens[i] cached and new_lens[i] new tokens, then padding
    tokens/requests."""
    prefix = np.array(list(prefix_lens) + [0] * pad_requests, np.int32)
    new = np.array(list(new_lens) + [0] * pad_requests, np.int32)
    seq = prefix + new
    pages_needed = -(-seq // page_size)
    max_pages = max(1, int(pages_needed.max(initial=0)))
    num_pages = int(pages_needed.sum()) + spare_pages
    pool = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(seq), max_pages), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = pool[used:used + n]
        used += n
    start = np.concatenate([[0], np.cumsum(new)[:-1]]).astype(np.int32)
    token_req = np.concatenate([np.full(n, b, np.int32) for b, n in enumerate(new)]
                               + [np.full(pad_tokens, -1, np.int32)])
    positions = np.concatenate([np.arange(p, s, dtype=np.int32) for p, s in zip(prefix, seq)]
                               + [np.zeros(pad_tokens, np.int32)])
    return Batch(table, seq.astype(np.int32), new, start, token_req.astype(np.int32),
                 positions.astype(np.int32), num_pages)
