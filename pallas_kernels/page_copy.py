"""Page transfers between tiers (host <-> device) and on-device page gather/scatter, K and V."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jhicache.pallas_kernels._common import check, check_copy_pairs, check_ids, check_pages_pair, is_concrete, row_chunk
from jhicache.pallas_kernels.backend import use_interpreter

Arrays = tuple[jax.Array, ...]


# ---------------------------------------------------------------- kernel
def _copy_kernel(src_ids_ref, dst_ids_ref, *refs, num_arrays, stacked_src, stacked_dst, per_program, count, chunk):
    """Copies page src_ids[i] -> dst_ids[i] of every array; a program owns `per_program` pairs."""
    srcs = refs[: 1 if stacked_src else num_arrays]
    outs = refs[-(1 if stacked_dst else num_arrays) :]
    row = outs[0].shape[-1]
    base = pl.program_id(0) * per_program

    def pair(j, carry):
        i = jnp.minimum(base + j, count - 1)  # tail programs repeat the last pair: same bytes, harmless
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
def _copy_call(srcs: Sequence[jax.Array], dsts: Sequence, src_ids, dst_ids, *, num_arrays: int, num_programs: int):
    """Row-major copy of pages. srcs/dsts: m arrays [pages, row] or one stacked [m, pages, row].

    A dst given as a ShapeDtypeStruct is a fresh output (every page of it must be listed in
    dst_ids); a dst given as an array is aliased to the output, so untouched pages keep their bytes.
    """
    count = src_ids.shape[0]
    grid = max(1, min(num_programs, count))
    per_program = pl.cdiv(count, grid)
    aliased = [d for d in dsts if isinstance(d, jax.Array)]
    kernel = functools.partial(
        _copy_kernel, num_arrays=num_arrays, stacked_src=srcs[0].ndim == 3, stacked_dst=dsts[0].ndim == 3,
        per_program=per_program, count=count, chunk=row_chunk(dsts[0].shape[-1]),
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
    """[pages, page_size, heads, dim] -> [pages, page_size*heads*dim] (a bitcast: pages are contiguous)."""
    return x.reshape(x.shape[0], -1)


def _to_device(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """Interpreter only: interpret-mode kernels refuse host-memory operands. On GPU this would be a copy."""
    if not use_interpreter():
        return list(xs)
    return [jax.device_put(x, jax.memory.Space.Device) for x in xs]


def _to_host(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """Interpreter only: returns the kernel's device-memory results to host memory."""
    if not use_interpreter():
        return list(xs)
    return [jax.device_put(x, jax.memory.Space.Host) for x in xs]


# ---------------------------------------------------------------- traced bodies
def _transfer_impl(srcs: Arrays, dsts: Arrays, src_ids, dst_ids, *, to_host: bool, num_programs: int) -> Arrays:
    """Copies pages src_ids -> dst_ids from every srcs[i] into dsts[i] (aliased)."""
    if to_host:
        dsts = tuple(_to_device(dsts))
    else:
        srcs = tuple(_to_device(srcs))
    outs = _copy_call([_rows(s) for s in srcs], [_rows(d) for d in dsts], src_ids, dst_ids,
                      num_arrays=len(srcs), num_programs=num_programs)
    outs = [o.reshape(d.shape) for o, d in zip(outs, dsts)]
    return tuple(_to_host(outs) if to_host else outs)


@functools.lru_cache(maxsize=64)
def _jitted_transfer(src_sharding, dst_sharding, ids_sharding, num_arrays: int, to_host: bool, num_programs: int):
    """One compiled transfer per (placement, arity): explicit shardings keep pinned_host operands zero-copy."""
    body = functools.partial(_transfer_impl, to_host=to_host, num_programs=num_programs)
    srcs, dsts = (src_sharding,) * num_arrays, (dst_sharding,) * num_arrays
    return jax.jit(body, in_shardings=(srcs, dsts, ids_sharding, ids_sharding), out_shardings=dsts,
                   donate_argnums=(1,))


def _transfer(srcs: Arrays, dsts: Arrays, src_ids, dst_ids, *, to_host: bool, num_programs: int) -> Arrays:
    """Validates, then runs the transfer jitted (concrete inputs) or inline (inside a caller's jit)."""
    for i in range(0, len(srcs), 2):
        check_pages_pair("source", srcs[i], srcs[i + 1])
        check_pages_pair("destination", dsts[i], dsts[i + 1])
        check(srcs[i].shape[1:] == dsts[i].shape[1:], f"page shape {srcs[i].shape[1:]} != {dsts[i].shape[1:]}")
        check(srcs[i].dtype == dsts[i].dtype, f"dtype {srcs[i].dtype} != {dsts[i].dtype}")
    check_ids("source page ids", src_ids, srcs[0].shape[0])
    check_ids("destination page ids", dst_ids, dsts[0].shape[0], length=src_ids.shape[0])
    check_copy_pairs(src_ids, dst_ids)
    if src_ids.shape[0] == 0:
        return dsts
    if not all(is_concrete(x) for x in (*srcs, *dsts)):
        return _transfer_impl(srcs, dsts, src_ids, dst_ids, to_host=to_host, num_programs=num_programs)
    ids_sharding = jax.sharding.SingleDeviceSharding(list(dsts[0].devices())[0], memory_kind="device")
    fn = _jitted_transfer(srcs[0].sharding, dsts[0].sharding, ids_sharding, len(srcs), to_host, num_programs)
    return fn(srcs, dsts, jnp.asarray(src_ids), jnp.asarray(dst_ids))


# ---------------------------------------------------------------- public: one layer and all layers
def load_pages(host_k, host_v, device_k, device_v, host_page_ids, device_page_ids, *, num_programs: int = 64):
    """Host pages -> device pages of one layer. host_*: [Ph, S, H, D] pinned_host; device_*: [Pd, S, H, D],
    donated; page ids: int32 [n]. Returns (device_k, device_v)."""
    return _transfer((host_k, host_v), (device_k, device_v), host_page_ids, device_page_ids,
                     to_host=False, num_programs=num_programs)


def write_back_pages(device_k, device_v, host_k, host_v, device_page_ids, host_page_ids, *, num_programs: int = 64):
    """Device pages -> host pages of one layer; host_* [Ph, S, H, D] pinned_host, donated. Returns (host_k, host_v)."""
    return _transfer((device_k, device_v), (host_k, host_v), device_page_ids, host_page_ids,
                     to_host=True, num_programs=num_programs)


def _interleave(ks: Sequence[jax.Array], vs: Sequence[jax.Array]) -> Arrays:
    check(len(ks) == len(vs) and len(ks) > 0, f"need as many K as V layers (>0), got {len(ks)} and {len(vs)}")
    return tuple(x for pair in zip(ks, vs) for x in pair)


def load_pages_layers(host_ks, host_vs, device_ks, device_vs, host_page_ids, device_page_ids, *,
                      num_programs: int = 64) -> tuple[Arrays, Arrays]:
    """All layers in one kernel launch (same page ids per layer); sequences of per-layer arrays."""
    out = _transfer(_interleave(host_ks, host_vs), _interleave(device_ks, device_vs), host_page_ids,
                    device_page_ids, to_host=False, num_programs=num_programs)
    return tuple(out[0::2]), tuple(out[1::2])


def write_back_pages_layers(device_ks, device_vs, host_ks, host_vs, device_page_ids, host_page_ids, *,
                            num_programs: int = 64) -> tuple[Arrays, Arrays]:
    """All layers' write-back in one kernel launch; host arrays donated. Returns (host_ks, host_vs)."""
    out = _transfer(_interleave(device_ks, device_vs), _interleave(host_ks, host_vs), device_page_ids,
                    host_page_ids, to_host=True, num_programs=num_programs)
    return tuple(out[0::2]), tuple(out[1::2])


# ---------------------------------------------------------------- public: on-device staging
@functools.partial(jax.jit, static_argnames=("num_programs",))
def _gather(arrays: Arrays, page_ids, *, num_programs: int) -> jax.Array:
    n, first = page_ids.shape[0], arrays[0]
    dst = jax.ShapeDtypeStruct((len(arrays), n, first[0].size), first.dtype)
    (out,) = _copy_call([_rows(a) for a in arrays], [dst], page_ids, jnp.arange(n, dtype=jnp.int32),
                        num_arrays=len(arrays), num_programs=num_programs)
    return out.reshape(len(arrays), n, *first.shape[1:])


@functools.partial(jax.jit, static_argnames=("num_programs",), donate_argnums=(0,))
def _scatter(arrays: Arrays, staging: jax.Array, rows, page_ids, *, num_programs: int) -> Arrays:
    flat = staging.reshape(len(arrays), staging.shape[1], -1)
    outs = _copy_call([flat], [_rows(a) for a in arrays], rows, page_ids,
                      num_arrays=len(arrays), num_programs=num_programs)
    return tuple(o.reshape(a.shape) for o, a in zip(outs, arrays))


def _check_staging_arrays(arrays: Sequence[jax.Array]) -> None:
    check(len(arrays) > 0, "need at least one page array")
    for a in arrays:
        check(a.ndim == 4 and a.shape == arrays[0].shape and a.dtype == arrays[0].dtype,
              f"page arrays must all be [pages, S, H, D] of one shape/dtype; got {a.shape} {a.dtype}")


def gather_pages_layers(arrays: Sequence[jax.Array], page_ids, *, num_programs: int = 64) -> jax.Array:
    """Pages `page_ids` of each array -> one contiguous staging array [len(arrays), n, S, H, D]."""
    _check_staging_arrays(arrays)
    check_ids("page ids", page_ids, arrays[0].shape[0])
    if page_ids.shape[0] == 0:
        return jnp.zeros((len(arrays), 0, *arrays[0].shape[1:]), arrays[0].dtype)
    return _gather(tuple(arrays), page_ids, num_programs=num_programs)


def scatter_pages_layers(arrays: Sequence[jax.Array], staging: jax.Array, page_ids, *,
                         num_programs: int = 64) -> Arrays:
    """staging [len(arrays), n, S, H, D] -> pages `page_ids` of each array (arrays donated)."""
    _check_staging_arrays(arrays)
    n = page_ids.shape[0]
    want = (len(arrays), n, *arrays[0].shape[1:])
    check(staging.shape == want, f"staging shape {staging.shape} != {want}")
    check(staging.dtype == arrays[0].dtype, f"staging dtype {staging.dtype} != {arrays[0].dtype}")
    check_ids("page ids", page_ids, arrays[0].shape[0], unique=True)
    if n == 0:
        return tuple(arrays)
    return _scatter(tuple(arrays), staging, jnp.arange(n, dtype=jnp.int32), page_ids, num_programs=num_programs)


def scatter_rows_layers(arrays: Sequence[jax.Array], staging: jax.Array, rows, page_ids, *,
                        num_programs: int = 64) -> Arrays:
    """Rows `rows` of staging [len(arrays), m, S, H, D] -> pages `page_ids` of each array (donated;
    int32 [n] each). An identical (row, page) pair may repeat (padding); inside a caller's jit the
    ids are not value-checked. The segments path's load-back placement."""
    _check_staging_arrays(arrays)
    check(staging.ndim == 5 and staging.shape[0] == len(arrays) and staging.shape[2:] == arrays[0].shape[1:],
          f"staging shape {staging.shape} does not hold [{len(arrays)}, m, *{arrays[0].shape[1:]}] rows")
    check(staging.dtype == arrays[0].dtype, f"staging dtype {staging.dtype} != {arrays[0].dtype}")
    check_ids("rows", rows, staging.shape[1])
    check_ids("page ids", page_ids, arrays[0].shape[0], length=rows.shape[0])
    check_copy_pairs(rows, page_ids)
    if rows.shape[0] == 0:
        return tuple(arrays)
    return _scatter(tuple(arrays), staging, rows, page_ids, num_programs=num_programs)


def gather_pages(device_k: jax.Array, page_ids, *, num_programs: int = 64) -> jax.Array:
    """[P, S, H, D] -> staging [n, S, H, D] holding pages `page_ids` in order."""
    return gather_pages_layers([device_k], page_ids, num_programs=num_programs)[0]


def scatter_pages(device_k: jax.Array, staging: jax.Array, page_ids, *, num_programs: int = 64) -> jax.Array:
    """staging [n, S, H, D] -> pages `page_ids` of device_k (donated)."""
    return scatter_pages_layers([device_k], staging[None], page_ids, num_programs=num_programs)[0]


# ---------------------------------------------------------------- reference
def copy_pages_reference(src: jax.Array, dst: jax.Array, src_ids, dst_ids) -> jax.Array:
    """Pure-jnp reference for every transfer above: dst with pages dst_ids replaced by src[src_ids]."""
    return jnp.asarray(dst).at[jnp.asarray(dst_ids)].set(jnp.asarray(src)[jnp.asarray(src_ids)])
