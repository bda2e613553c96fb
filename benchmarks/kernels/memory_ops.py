"""The memory parts: the host tier's transfers, write_kv against XLA's scatter, rope_write
against the forward's path without it, the gather."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jhicache.pallas_kernels as pk
import numpy as np
from jhicache.models.decoder import rope_inv_freq
from jhicache.pallas_kernels.kv_write import write_kv_reference
from jhicache.pallas_kernels.rope_write import rope_write as rope_write_kernel
from jhicache.pallas_kernels.rope_write import rope_write_reference

from benchmarks.kernels.shapes import DT, PAGE, random_array
from benchmarks.kernels.timing import GB, safe, timeit
from jhicache.cache import DevicePool, HostPool, PoolLayout, Transfers, make_copier
from jhicache.cache.write_back import gather_kv


def transfers(res: dict, layers: int = 24, kv_heads: int = 2, dim: int = 64, n: int = 512,
              host_pages: int = 2048, dev_pages: int = 1024) -> None:
    """The host tier's own copies (`Transfers` over the platform's copier): write-back
    (gather + device->host) and load-back (host->device, layer by layer) of `n` scattered pages."""
    layout = PoolLayout(layers, dev_pages + 1, PAGE, kv_heads, dim, DT)
    device = DevicePool(layout)
    for l in range(layers):
        device.set_layer(l, random_array(l, layout.page_shape),
                         random_array(100 + l, layout.page_shape))
    copier, drivers = make_copier(jax.default_backend())
    host = HostPool(dataclasses.replace(layout, num_pages=host_pages), drivers)
    ctl = Transfers(device, host, copier)
    rng = np.random.default_rng(0)
    hid = rng.permutation(host_pages)[:n].tolist()
    did = (rng.permutation(dev_pages)[:n] + 1).tolist()
    nbytes = n * layout.page_bytes
    res["transfer_bytes"] = nbytes

    def write_back() -> None:
        ctl.queue_write_back(did, hid)
        ctl.flush()

    def load_back() -> None:
        ticket = ctl.queue_load_back(hid, did)
        ctl.launch()
        ticket.wait_all()
        ctl.poll()

    res["writeback_gbps"] = nbytes / timeit(write_back) / GB
    res["load_gbps"] = nbytes / timeit(load_back) / GB
    res["transfer_note"] = "end to end, scattered pages; compare pcie_h2d_gbps / pcie_d2h_gbps"
    host.close()


def _pallas_write(tokens_per_program: int, num_warps: int
                  ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`write_kv` with a fixed program size and warp count (the peer is `write_kv_reference`, the
    XLA scatter the kernel replaced)."""
    return functools.partial(pk.write_kv, tokens_per_program=tokens_per_program,
                             num_warps=num_warps)


def kv_write(res: dict, name: str, layers: int, kv_heads: int, dim: int, tokens: int = 65536,
             pages: int = 2048, **_: int) -> None:
    """Three timings: eager calls (host checks of concrete metadata included, as in the first
    round), one call inside jit (how the model calls it: no host checks), and every layer of a step
    in one jit (dispatch amortised)."""
    k = jnp.zeros((pages, PAGE, kv_heads, dim), DT)
    v = jnp.zeros_like(k)
    kn, vn = random_array(1, (tokens, kv_heads, dim)), random_array(2, (tokens, kv_heads, dim))
    per_req = tokens // 8
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[: 8 * (per_req // PAGE)]
                        .reshape(8, -1).astype(np.int32))
    req = jnp.repeat(jnp.arange(8, dtype=jnp.int32), per_req)
    pos = jnp.tile(jnp.arange(per_req, dtype=jnp.int32), 8)
    box = [k, v]
    nbytes = 2 * 2 * kn.nbytes  # K and V, read + write
    out: dict[str, float | str] = {}

    def eager(tpp: int = 64, warps: int = 4) -> list[jax.Array]:
        box[:] = pk.write_kv(box[0], box[1], kn, vn, table, req, pos, tokens_per_program=tpp,
                             num_warps=warps)
        return box

    out["eager_pallas_t64_w4"] = safe(lambda: nbytes / timeit(eager) / GB)
    for label, write in (("pallas_t32_w4", _pallas_write(tokens_per_program=32, num_warps=4)),
                         ("pallas_t64_w4", _pallas_write(tokens_per_program=64, num_warps=4)),
                         ("pallas_t128_w8", _pallas_write(tokens_per_program=128, num_warps=8)),
                         ("xla_scatter", write_kv_reference)):
        f = jax.jit(write, donate_argnums=(0, 1))

        # metadata as arguments (tracers inside), as in the model: no closed-over constants
        def step(f: Callable = f) -> list[jax.Array]:
            box[:] = f(box[0], box[1], kn, vn, table, req, pos)
            return box
        out[f"jit_{label}"] = safe(functools.partial(_rate, nbytes, step))
    del box[:], k, v
    lk = [jnp.zeros((pages, PAGE, kv_heads, dim), DT) for _ in range(2 * layers)]
    # per layer: no L2 reuse
    new = [random_array(10 + i, (tokens, kv_heads, dim)) for i in range(2 * layers)]
    for label, write in (("pallas_t64_w4", pk.write_kv), ("xla_scatter", write_kv_reference)):
        def all_layers(pages_kv: list[jax.Array], rows: list[jax.Array], *meta: jax.Array,
                       write: Callable = write) -> list[jax.Array]:
            done = [write(pages_kv[2 * i], pages_kv[2 * i + 1], rows[2 * i], rows[2 * i + 1],
                          *meta)
                    for i in range(layers)]
            return [x for pair in done for x in pair]
        f = jax.jit(all_layers, donate_argnums=(0,))

        def step(f: Callable = f) -> list[jax.Array]:
            lk[:] = f(lk, new, table, req, pos)
            return lk
        out[f"jit_{layers}_layers_{label}"] = safe(functools.partial(_rate, layers * nbytes, step))
    res.setdefault("kv_write", {})[name] = {"tokens": tokens, "gbps": out}


# rope_write's cases: (new tokens, tokens cached before them)
ROPE_TURNS: tuple[tuple[int, int], ...] = ((64, 8192), (8192, 0))


def _rope_then_write_kv(qkv: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        *meta: jax.Array, heads: int) -> Any:
    """The forward's path without rope_write: XLA's split and rotations, then `write_kv` (the
    reference's own scatter is left unused, so XLA drops it)."""
    table, req, pos, inv_freq = meta
    rotated = rope_write_reference(qkv, k_pages, v_pages, table, req, pos, inv_freq, heads=heads)
    assert rotated.k is not None and rotated.v is not None  # the reference returns them
    k_pages, v_pages = pk.write_kv(k_pages, v_pages, rotated.k, rotated.v, table, req, pos)
    return rotated._replace(k_pages=k_pages, v_pages=v_pages)


def rope_write(res: dict, name: str, layers: int, kv_heads: int, dim: int, heads: int,
               **_: int) -> None:
    """Per layer, `rope_write` against the path it would replace in the forward (XLA's split
    and rotations, then `write_kv`) and against its reference compiled whole by XLA (the
    scatter too), every layer of a step in one jit (distinct rows and pages per layer, each
    layer's rotated queries returned, so no path is cut short), for each of ROPE_TURNS: a short
    turn over a long prefix and a prefill chunk."""
    inv_freq = rope_inv_freq(dim, 1_000_000.0)
    out: dict[str, dict[str, float | str]] = {}
    for tokens, cached in ROPE_TURNS:
        seq = cached + tokens
        table = jnp.arange(-(-seq // PAGE), dtype=jnp.int32)[None, :]
        req = jnp.zeros((tokens,), jnp.int32)
        pos = jnp.arange(cached, seq, dtype=jnp.int32)
        rows = [random_array(20 + i, (tokens, (heads + 2 * kv_heads) * dim))
                for i in range(layers)]
        pages = [jnp.zeros((table.shape[1], PAGE, kv_heads, dim), DT) for _ in range(2 * layers)]
        times: dict[str, float | str] = {}
        paths = (("pallas", rope_write_kernel), ("xla_rope_write_kv", _rope_then_write_kv),
                 ("xla", rope_write_reference))
        for label, write in paths:
            def all_layers(pages_kv: list[jax.Array], qkv: list[jax.Array], *meta: jax.Array,
                           write: Callable = write) -> tuple[list[jax.Array], list[jax.Array]]:
                done = [write(qkv[i], pages_kv[2 * i], pages_kv[2 * i + 1], *meta, inv_freq,
                              heads=heads) for i in range(layers)]
                return ([x for d in done for x in (d.k_pages, d.v_pages)], [d.q for d in done])
            f = jax.jit(all_layers, donate_argnums=(0,))

            def step(f: Callable = f) -> list[jax.Array]:
                pages[:], qs = f(pages, rows, table, req, pos)
                return [*pages, *qs]

            def per_layer_us(step: Callable[[], object] = step) -> float:
                return timeit(step) / layers * 1e6
            times[f"{label}_us_per_layer"] = safe(per_layer_us)
        out[f"{tokens}_after_{cached}"] = times
    res.setdefault("rope_write", {})[name] = out


def _rate(nbytes: int, step: Callable[[], object]) -> float:
    """GB/s of `nbytes` moved per `step`, timed."""
    return nbytes / timeit(step) / GB


def gathers(res: dict, name: str, layers: int, kv_heads: int, dim: int, pages: int = 128,
            pool_pages: int = 4096, **_: int) -> None:
    """A write-back's staging gather as the engine runs it (XLA gathers into one
    [layers, 2, n, S, H, D] array) of `pages` scattered pages of every layer (8192 tokens at
    page 64). Bytes moved count a read and a write of each page; compare hbm_copy_gbps."""
    shape = (pool_pages, PAGE, kv_heads, dim)
    ks = tuple(random_array(200 + i, shape) for i in range(layers))
    vs = tuple(random_array(300 + i, shape) for i in range(layers))
    ids = jnp.asarray(np.random.default_rng(2).permutation(pool_pages)[:pages].astype(np.int32))
    staging = gather_kv(ks, vs, ids)
    same = all(bool((s[0] == k[ids]).all() and (s[1] == v[ids]).all())
               for s, k, v in zip(staging, ks, vs))
    moved = 2 * 2 * layers * pages * PAGE * kv_heads * dim * 2  # K and V, read + write, bf16
    r: dict[str, object] = {"pages": pages, "layers": layers, "bytes_read_and_written": moved,
         "staging_is_the_pages": same}
    seconds = safe(lambda: timeit(lambda: gather_kv(ks, vs, ids)))
    r["xla_gather_ms"] = seconds * 1e3 if isinstance(seconds, float) else seconds
    if isinstance(seconds, float):
        r["xla_gather_gbps"] = moved / seconds / GB
    res.setdefault("write_back_gather", {})[name] = r
