"""On-device page gather: the staging copy a write-back reads, in one launch for K and V."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jhicache.pallas_kernels._common import check, check_ids, row_chunk
from jhicache.pallas_kernels.backend import use_interpreter

Arrays = tuple[jax.Array, ...]


# ---------------------------------------------------------------- kernel
def _copy_kernel(src_ids_ref, dst_ids_ref, *refs, num_arrays, stacked_src, stacked_dst, per_program,
                 count, chunk):
    """Copies page src_ids[i] -> dst_ids[i] of every array; a program owns `per_program` pairs."""
    srcs = refs[: 1 if stacked_src else num_arrays]
    outs = refs[-(1 if stacked_dst else num_arrays) :]
    row = outs[0].shape[-1]
    base = pl.program_id(0) * per_program

    def pair(j, carry):
        # tail programs repeat the last pair: same bytes, harmless
        i = jnp.minimum(base + j, count - 1)
        s, d = src_ids_ref[i], dst_ids_ref[i]
        for a in range(num_arrays):
            src, s_at = (srcs[0], (a, s)) if stacked_src else (srcs[a], (s,))
            out, d_at = (outs[0], (a, d)) if stacked_dst else (outs[a], (d,))

            def piece(c, carry2, src=src, out=out, s_at=s_at, d_at=d_at):
                sl = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
                out[(*d_at, sl)] = src[(*s_at, sl)]
                return carry2

            jax.lax.fori_loop(0, row // chunk, piece, 0)
        return carry

    jax.lax.fori_loop(0, per_program, pair, 0)


# ---------------------------------------------------------------- pallas_call builder
def _copy_call(srcs: Sequence[jax.Array], dsts: Sequence, src_ids, dst_ids, *, num_arrays: int,
               num_programs: int):
    """Row-major copy of pages. srcs/dsts: m arrays [pages, row] or one stacked [m, pages, row].

    A dst given as a ShapeDtypeStruct is a fresh output (every page of it must be listed in
    dst_ids); a dst given as an array is aliased to the output, so untouched pages keep their bytes.
    """
    count = src_ids.shape[0]
    grid = max(1, min(num_programs, count))
    per_program = pl.cdiv(count, grid)
    aliased = [d for d in dsts if isinstance(d, jax.Array)]
    kernel = functools.partial(
        _copy_kernel, num_arrays=num_arrays, stacked_src=srcs[0].ndim == 3,
        stacked_dst=dsts[0].ndim == 3, per_program=per_program, count=count,
        chunk=row_chunk(dsts[0].shape[-1]),
    )
    first_alias = 2 + len(srcs)
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(d.shape, d.dtype) for d in dsts],
        grid=(grid,),
        input_output_aliases={first_alias + i: i for i in range(len(aliased))},
        interpret=use_interpreter(),
    )(src_ids, dst_ids, *srcs, *aliased)


def _rows(x: jax.Array) -> jax.Array:
    """[pages, page_size, heads, dim] -> [pages, page_size*heads*dim] (a bitcast: pages are
    contiguous)."""
    return x.reshape(x.shape[0], -1)


# ---------------------------------------------------------------- public
@functools.partial(jax.jit, static_argnames=("num_programs",))
def _gather(arrays: Arrays, page_ids, *, num_programs: int) -> jax.Array:
    n, first = page_ids.shape[0], arrays[0]
    dst = jax.ShapeDtypeStruct((len(arrays), n, first[0].size), first.dtype)
    (out,) = _copy_call([_rows(a) for a in arrays], [dst], page_ids, jnp.arange(n, dtype=jnp.int32),
                        num_arrays=len(arrays), num_programs=num_programs)
    return out.reshape(len(arrays), n, *first.shape[1:])


def _check_staging_arrays(arrays: Sequence[jax.Array]) -> None:
    check(len(arrays) > 0, "need at least one page array")
    for a in arrays:
        check(a.ndim == 4 and a.shape == arrays[0].shape and a.dtype == arrays[0].dtype,
              "page arrays must all be [pages, S, H, D] of one shape/dtype; "
              f"got {a.shape} {a.dtype}")


def gather_pages_layers(arrays: Sequence[jax.Array], page_ids, *,
                        num_programs: int = 64) -> jax.Array:
    """Pages `page_ids` of each array -> one contiguous staging array [len(arrays), n, S, H, D]."""
    _check_staging_arrays(arrays)
    check_ids("page ids", page_ids, arrays[0].shape[0])
    if page_ids.shape[0] == 0:
        return jnp.zeros((len(arrays), 0, *arrays[0].shape[1:]), arrays[0].dtype)
    return _gather(tuple(arrays), page_ids, num_programs=num_programs)


def gather_pages(device_k: jax.Array, page_ids, *, num_programs: int = 64) -> jax.Array:
    """[P, S, H, D] -> staging [n, S, H, D] holding pages `page_ids` in order."""
    return gather_pages_layers([device_k], page_ids, num_programs=num_programs)[0]


# ---------------------------------------------------------------- reference
def copy_pages_reference(src: jax.Array, dst: jax.Array, src_ids, dst_ids) -> jax.Array:
    """Pure-jnp reference for the copy kernel: dst with pages dst_ids replaced by src[src_ids]."""
    return jnp.asarray(dst).at[jnp.asarray(dst_ids)].set(jnp.asarray(src)[jnp.asarray(src_ids)])
