"""Page/slot allocation arithmetic for extend and decode (SGLang's alloc_extend / alloc_decode), vectorised jnp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _nonempty(free_pages: jax.Array) -> jax.Array:
    """An empty free list still needs one (never selected) entry to index into."""
    return free_pages if free_pages.shape[0] else jnp.zeros((1,), jnp.int32)


def new_page_counts(prefix_lens: jax.Array, seq_lens: jax.Array, page_size: int) -> jax.Array:
    """[B] pages each request needs beyond its prefix: ceil(s/P) - ceil(p/P)."""
    return -(-seq_lens // page_size) - (-(-prefix_lens // page_size))


@functools.partial(jax.jit, static_argnames=("page_size", "num_tokens"))
def alloc_extend_slots(prefix_lens: jax.Array, seq_lens: jax.Array, last_loc: jax.Array, free_pages: jax.Array,
                       *, page_size: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Slots of every new token (positions p..s-1 of each request, requests laid out in order).

    prefix_lens, seq_lens, last_loc: [B] int32 (last_loc = slot of the last prefix token, -1 if p = 0);
    free_pages: [F] int32 free device pages, consumed in order (earlier requests take earlier pages).
    Returns (slots [num_tokens] int32, -1 beyond the real tokens; pages_used scalar int32).
    Per request: the old partial tail page first (last_loc+1, ...), then whole new pages, then the
    head of one more new page. Callers check pages_used <= F (SGLang returns None otherwise).
    """
    if prefix_lens.shape[0] == 0:
        return jnp.full((num_tokens,), -1, jnp.int32), jnp.int32(0)
    free_pages = _nonempty(free_pages)
    new = seq_lens - prefix_lens  # [B]
    token_start = jnp.cumsum(new) - new  # [B] first output row of each request
    counts = new_page_counts(prefix_lens, seq_lens, page_size)
    page_start = jnp.cumsum(counts) - counts  # [B] first free-list index of each request
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(token_start + new, t, side="right").astype(jnp.int32)  # request owning row t
    live = req < new.shape[0]
    r = jnp.minimum(req, new.shape[0] - 1)
    pos = prefix_lens[r] + t - token_start[r]  # position of the token in its request
    tail_end = -(-prefix_lens[r] // page_size) * page_size  # end of the old partial page
    in_old = pos < tail_end
    fresh = pos - tail_end  # index among tokens placed on new pages
    page = free_pages[jnp.clip(page_start[r] + fresh // page_size, 0, free_pages.shape[0] - 1)]
    slot = jnp.where(in_old, last_loc[r] + 1 + (pos - prefix_lens[r]), page * page_size + fresh % page_size)
    return jnp.where(live, slot, -1).astype(jnp.int32), counts.sum().astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("page_size",))
def alloc_decode_slots(seq_lens: jax.Array, last_loc: jax.Array, free_pages: jax.Array, *,
                       page_size: int) -> tuple[jax.Array, jax.Array]:
    """One new token per request at position s-1: a fresh page's first slot if s-1 is page aligned,
    else last_loc + 1. Requests needing a page take free pages in order. Returns (slots [B], pages_used)."""
    free_pages = _nonempty(free_pages)
    needs = ((seq_lens - 1) % page_size == 0).astype(jnp.int32)
    index = jnp.cumsum(needs) - needs
    page = free_pages[jnp.clip(index, 0, free_pages.shape[0] - 1)]
    slot = jnp.where(needs == 1, page * page_size, last_loc + 1)
    return slot.astype(jnp.int32), needs.sum().astype(jnp.int32)


def alloc_extend_reference(prefix_lens, seq_lens, last_loc, free_pages, page_size: int) -> tuple[list[int], int]:
    """Plain-Python reference, written as SGLang's three-part Triton kernel describes it."""
    out, used = [], 0
    for p, s, last in zip(map(int, prefix_lens), map(int, seq_lens), map(int, last_loc)):
        tail_end = min(s, -(-p // page_size) * page_size)
        out += [last + 1 + i for i in range(tail_end - p)]
        for j in range(s - tail_end):
            if j % page_size == 0:
                used += 1
            out.append(int(free_pages[used - 1]) * page_size + j % page_size)
    return out, used


def alloc_decode_reference(seq_lens, last_loc, free_pages, page_size: int) -> tuple[list[int], int]:
    """Plain-Python reference for alloc_decode."""
    out, used = [], 0
    for s, last in zip(map(int, seq_lens), map(int, last_loc)):
        if (s - 1) % page_size == 0:
            out.append(int(free_pages[used]) * page_size)
            used += 1
        else:
            out.append(last + 1)
    return out, used
