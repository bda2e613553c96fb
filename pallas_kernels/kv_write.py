"""Paged KV write: new tokens' K and V of one layer into their page slots (donated, aliased
pages)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jhicache.pallas_kernels._common import check, check_pages_pair, is_concrete, row_chunk
from jhicache.pallas_kernels.backend import use_interpreter

# Path: the Pallas kernel below, because on the GPU it beat an XLA scatter on the donated flat
# buffer (`write_kv_reference`, the peer `bench kernels` times it against) several times over, at
# both Qwen2 shapes, one layer per call and a whole step in one jit (the figures: the kernels
# section of benchmarks/LOG.md, 2026-11-30).

# ---------------------------------------------------------------- kernel
def slots_of_block(pt_ref, req_ref, pos_ref, *, block_t, count, page_size, max_pages):
    """Token rows and flat slots of this program's block_t tokens, computed once per token (no XLA
    prologue).

    Padding lanes (token_req -1, or past the last token) repeat the block's first live token's row
    and slot, so a repeated store writes identical bytes (the interpreter's masked store is a
    read-modify-write scatter, where a masked lane aliasing a live one could write stale bytes). A
    block with no live token is masked off."""
    lane = jnp.arange(block_t, dtype=jnp.int32)
    t = jnp.minimum(pl.program_id(0) * block_t + lane, count - 1)
    req, pos = req_ref[t], pos_ref[t]
    live = (pl.program_id(0) * block_t + lane < count) & (req >= 0)
    col = jnp.clip(pos // page_size, 0, max_pages - 1)
    slot = pt_ref[jnp.maximum(req, 0) * max_pages + col] * page_size + pos % page_size
    # one-hot on the first live lane, or all False
    pick = lane == jnp.min(jnp.where(live, lane, block_t))
    first_t, first_slot = jnp.sum(jnp.where(pick, t, 0)), jnp.sum(jnp.where(pick, slot, 0))
    return (jnp.where(live, t, first_t), jnp.where(live, slot, first_slot),
            jnp.max(live.astype(jnp.int32)) > 0)


def _write_kernel(pt_ref, req_ref, pos_ref, k_new_ref, v_new_ref, _k_in, _v_in, k_out, v_out, *,
                  block_t, count, chunk, page_size, max_pages):
    """block_t tokens per program: whole [H*D] rows, loaded as one 2-D block and stored as one 2-D
    scatter (each row contiguous and 16-byte aligned, so Triton emits vector loads/stores)."""
    src, dst, any_live = slots_of_block(pt_ref, req_ref, pos_ref, block_t=block_t, count=count,
                                         page_size=page_size, max_pages=max_pages)
    shape = (block_t, chunk)
    mask = jnp.broadcast_to(any_live, shape)
    src2, dst2 = (jnp.broadcast_to(x[:, None], shape) for x in (src, dst))
    lanes = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32)[None, :], shape)

    def piece(c, carry):
        cols = pl.multiple_of(c * chunk, chunk) + lanes
        plgpu.store(k_out.at[dst2, cols], k_new_ref[src2, cols].astype(k_out.dtype), mask=mask)
        plgpu.store(v_out.at[dst2, cols], v_new_ref[src2, cols].astype(v_out.dtype), mask=mask)
        return carry

    jax.lax.fori_loop(0, k_out.shape[-1] // chunk, piece, 0)


# ---------------------------------------------------------------- pallas_call builder
def _write_call(k_flat, v_flat, k_rows, v_rows, page_table, token_req, positions, *, page_size: int,
                block_t: int, num_warps: int):
    """k_flat/v_flat: [num_pages*page_size, H*D] aliased to the outputs; k_rows/v_rows: [T, H*D]."""
    count = token_req.shape[0]
    block_t = min(block_t, pl.next_power_of_2(count))
    chunk = row_chunk(k_flat.shape[-1], limit=max(16, 8192 // block_t))
    kernel = functools.partial(_write_kernel, block_t=block_t, count=count, chunk=chunk,
                               page_size=page_size, max_pages=page_table.shape[1])
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype),
                   jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)],
        grid=(pl.cdiv(count, block_t),),
        input_output_aliases={5: 0, 6: 1},
        interpret=use_interpreter(),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
    )(page_table.reshape(-1), token_req, positions, k_rows, v_rows, k_flat, v_flat)


# ---------------------------------------------------------------- jitted public function
@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("block_t", "num_warps"))
def _write_kv(k_pages, v_pages, k_new, v_new, page_table, token_req, positions, *, block_t: int,
              num_warps: int):
    num_pages, page_size = k_pages.shape[:2]
    flat = lambda x: x.reshape(num_pages * page_size, -1)  # noqa: E731  [pages*S, H*D], a bitcast
    rows = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731  [T, H*D]
    k, v = _write_call(flat(k_pages), flat(v_pages), rows(k_new), rows(v_new), page_table,
                       token_req, positions, page_size=page_size, block_t=block_t,
                       num_warps=num_warps)
    return k.reshape(k_pages.shape), v.reshape(v_pages.shape)


def write_kv(
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], donated
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], donated
    k_new: jax.Array,  # [T, num_kv_heads, head_dim]
    v_new: jax.Array,  # [T, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, max_pages] int32
    token_req: jax.Array,  # [T] int32 request index per token, -1 = padding (not written)
    positions: jax.Array,  # [T] int32 position of each token in its request
    *,
    tokens_per_program: int = 64,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """Writes each token at page_table[req, pos // page_size], offset pos % page_size."""
    _validate(k_pages, v_pages, k_new, v_new, page_table, token_req, positions)
    # nothing to write (with no requests every token pads)
    if k_new.shape[0] == 0 or page_table.size == 0:
        return k_pages, v_pages
    return _write_kv(k_pages, v_pages, k_new, v_new, page_table, token_req, positions,
                     block_t=pl.next_power_of_2(tokens_per_program), num_warps=num_warps)


def _validate(k_pages, v_pages, k_new, v_new, page_table, token_req, positions) -> None:
    check_pages_pair("write_kv pages", k_pages, v_pages)
    t = k_new.shape[0]
    check(k_new.shape == (t, *k_pages.shape[2:]),
          f"k_new shape {k_new.shape} != [T, {k_pages.shape[2:]}]")
    check(v_new.shape == k_new.shape, f"v_new shape {v_new.shape} != k_new shape {k_new.shape}")
    check(page_table.ndim == 2 and page_table.dtype == np.int32,
          "page_table must be int32 [B, max_pages]")
    for name, x in (("token_req", token_req), ("positions", positions)):
        check(x.shape == (t,) and x.dtype == np.int32,
              f"{name} must be int32 [{t}], got {x.dtype} {x.shape}")
    if all(is_concrete(x) for x in (page_table, token_req, positions)):
        check_referenced_pages(np.asarray(page_table), np.asarray(token_req),
                                np.asarray(positions), k_pages.shape[0], k_pages.shape[1])


def check_referenced_pages(table, req, pos, num_pages: int, page_size: int) -> None:
    """Only the entries the tokens use must be valid: padding columns of the table may hold
    anything."""
    live = req >= 0
    req, pos = req[live], pos[live]
    check(bool((req < table.shape[0]).all()), f"token_req beyond the batch of {table.shape[0]}")
    check(bool((pos >= 0).all()), "negative positions")
    cols = pos // page_size
    check(bool((cols < table.shape[1]).all()),
          f"positions beyond the page table ({table.shape[1]} pages)")
    pages = table[req, cols]
    bad = pages[(pages < 0) | (pages >= num_pages)]
    check(bad.size == 0, f"page ids out of range [0, {num_pages}): {bad[:8].tolist()}")


# ---------------------------------------------------------------- reference
def write_kv_reference(k_pages, v_pages, k_new, v_new, page_table, token_req, positions):
    """Pure-jnp reference: a scatter into the flattened token slots; padding tokens dropped."""
    num_pages, page_size = k_pages.shape[:2]
    page = page_table[jnp.maximum(token_req, 0), positions // page_size]
    slot = jnp.where(token_req >= 0, page * page_size + positions % page_size,
                     num_pages * page_size)
    flat_k = k_pages.reshape(num_pages * page_size, *k_pages.shape[2:])
    flat_v = v_pages.reshape(num_pages * page_size, *v_pages.shape[2:])
    flat_k = flat_k.at[slot].set(k_new.astype(k_pages.dtype), mode="drop")
    flat_v = flat_v.at[slot].set(v_new.astype(v_pages.dtype), mode="drop")
    return flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)
