"""Kernel benchmark on the GPU: every pallas_kernels op at Qwen2 shapes, page 64, bf16, with
ceilings."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jhicache.pallas_kernels as pk
from jhicache.cache import DevicePool, HostPool, PoolLayout, TransferController, make_copier
from jhicache.pallas_kernels.kv_write import write_kv_reference

SHAPES = {"qwen2-0.5b": dict(layers=24, kv_heads=2, dim=64, heads=14),
          "qwen2-7b": dict(layers=28, kv_heads=4, dim=128, heads=28)}
PAGE = 64
DT = jnp.bfloat16
GB = 1e9


def _shardings():
    d = jax.devices()[0]
    mk = jax.sharding.SingleDeviceSharding
    return mk(d, memory_kind="device"), mk(d, memory_kind="pinned_host")


def timeit(step: Callable[[], object], reps: int = 7, warm: int = 2) -> float:
    """Median seconds of `step` (which must return what to block on) after warm-up calls."""
    for _ in range(warm):
        jax.block_until_ready(step())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rand(key, shape, dtype=DT, sharding=None):
    x = jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)
    return x if sharding is None else jax.device_put(x, sharding)


def ceilings(res: dict) -> None:
    dev, host = _shardings()
    n = 512 << 20
    h = jax.device_put(np.ones(n // 2, np.float16), host)
    d = jax.device_put(np.ones(n // 2, np.float16), dev)
    res["pcie_h2d_gbps"] = n / timeit(lambda: jax.device_put(h, dev)) / GB
    res["pcie_d2h_gbps"] = n / timeit(lambda: jax.device_put(d, host)) / GB
    big = _rand(0, (1 << 29,), jnp.bfloat16)  # 1 GiB
    copy = jax.jit(lambda x: x + jnp.bfloat16(1))
    res["hbm_copy_gbps"] = 2 * big.nbytes / timeit(lambda: copy(big)) / GB  # read + write
    res["hbm_copy_note"] = "elementwise x+1 on 1 GiB bf16, bytes read + written"


def transfers(res: dict, layers=24, kv_heads=2, dim=64, n=512, host_pages=2048,
              dev_pages=1024) -> None:
    """The host tier's own copies (TransferController over the platform's copier): write-back
    (gather + device->host) and load-back (host->device, layer by layer) of `n` scattered pages."""
    layout = PoolLayout(layers, dev_pages + 1, PAGE, kv_heads, dim, DT)
    device = DevicePool(layout)
    for l in range(layers):
        device.set_layer(l, _rand(l, layout.page_shape), _rand(100 + l, layout.page_shape))
    copier, drivers = make_copier(jax.default_backend())
    host = HostPool(dataclasses.replace(layout, num_pages=host_pages), drivers)
    ctl = TransferController(device, host, copier)
    rng = np.random.default_rng(0)
    hid = rng.permutation(host_pages)[:n].tolist()
    did = (rng.permutation(dev_pages)[:n] + 1).tolist()
    nbytes = n * layout.page_bytes
    res["transfer_bytes"] = nbytes

    def write_back():
        ctl.queue_write_back(did, hid)
        ctl.flush()

    def load_back():
        ticket = ctl.queue_load_back(hid, did)
        ctl.launch()
        ticket.wait_all()
        ctl.poll()

    res["writeback_gbps"] = nbytes / timeit(write_back) / GB
    res["load_gbps"] = nbytes / timeit(load_back) / GB
    res["transfer_note"] = "end to end, scattered pages; compare pcie_h2d_gbps / pcie_d2h_gbps"
    host.close()


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  a failing path is a result to record, not a crash
        return f"ERROR {type(e).__name__}: {str(e)[:300]}"


def _pallas_write(**tuning) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`write_kv` with a fixed program size and warp count (the peer is `write_kv_reference`, the
    XLA scatter the kernel replaced)."""
    return lambda k, v, *meta: pk.write_kv(k, v, *meta, **tuning)


def kv_write(res: dict, name: str, layers: int, kv_heads: int, dim: int, tokens=65536, pages=2048,
             **_) -> None:
    """Three timings: eager calls (host checks of concrete metadata included, as in the first
    round), one call inside jit (how the model calls it: no host checks), and every layer of a step
    in one jit (dispatch amortised)."""
    k = jnp.zeros((pages, PAGE, kv_heads, dim), DT)
    v = jnp.zeros_like(k)
    kn, vn = _rand(1, (tokens, kv_heads, dim)), _rand(2, (tokens, kv_heads, dim))
    per_req = tokens // 8
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[: 8 * (per_req // PAGE)]
                        .reshape(8, -1).astype(np.int32))
    req = jnp.repeat(jnp.arange(8, dtype=jnp.int32), per_req)
    pos = jnp.tile(jnp.arange(per_req, dtype=jnp.int32), 8)
    box = [k, v]
    nbytes = 2 * 2 * kn.nbytes  # K and V, read + write
    out = {}

    def eager(tpp=64, warps=4):
        box[:] = pk.write_kv(box[0], box[1], kn, vn, table, req, pos, tokens_per_program=tpp,
                             num_warps=warps)
        return box

    out["eager_pallas_t64_w4"] = _safe(lambda: nbytes / timeit(eager) / GB)
    for label, write in (("pallas_t32_w4", _pallas_write(tokens_per_program=32, num_warps=4)),
                         ("pallas_t64_w4", _pallas_write(tokens_per_program=64, num_warps=4)),
                         ("pallas_t128_w8", _pallas_write(tokens_per_program=128, num_warps=8)),
                         ("xla_scatter", write_kv_reference)):
        f = jax.jit(write, donate_argnums=(0, 1))

        # metadata as arguments (tracers inside), as in the model: no closed-over constants
        def step(f=f):
            box[:] = f(box[0], box[1], kn, vn, table, req, pos)
            return box
        out[f"jit_{label}"] = _safe(lambda step=step: nbytes / timeit(step) / GB)
    del box[:], k, v
    lk = [jnp.zeros((pages, PAGE, kv_heads, dim), DT) for _ in range(2 * layers)]
    # per layer: no L2 reuse
    new = [_rand(10 + i, (tokens, kv_heads, dim)) for i in range(2 * layers)]
    for label, write in (("pallas_t64_w4", pk.write_kv), ("xla_scatter", write_kv_reference)):
        def all_layers(pages_kv, rows, *meta, write=write):
            done = [write(pages_kv[2 * i], pages_kv[2 * i + 1], rows[2 * i], rows[2 * i + 1],
                          *meta)
                    for i in range(layers)]
            return [x for pair in done for x in pair]
        f = jax.jit(all_layers, donate_argnums=(0,))

        def step(f=f):
            lk[:] = f(lk, new, table, req, pos)
            return lk
        out[f"jit_{layers}_layers_{label}"] = _safe(
            lambda step=step: layers * nbytes / timeit(step) / GB)
    res.setdefault("kv_write", {})[name] = {"tokens": tokens, "gbps": out}


def attention(res: dict, name: str, kv_heads: int, dim: int, heads: int, decode: bool = True,
              **_) -> None:
    rng = np.random.default_rng(0)
    b, t = 4, 2048
    pages_per = t // PAGE
    table = jnp.asarray(rng.permutation(b * pages_per + 8)[: b * pages_per].reshape(b, -1)
                        .astype(np.int32))
    k = _rand(3, (b * pages_per + 8, PAGE, kv_heads, dim))
    v = _rand(4, k.shape)
    q = _rand(5, (b * t, heads, dim))
    lens = jnp.full((b,), t, jnp.int32)
    start = jnp.arange(b, dtype=jnp.int32) * t
    scale = dim**-0.5
    r = {"batch": b, "tokens_per_request": t, "prefix": 0,
         "note": "block_q = packed (token, GQA-group head) rows per program; s = num_stages"}
    for bq, bk, w, st in ((128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2),
                          (128, 128, 8, 2)):
        f = jax.jit(lambda q, k, v: pk.paged_attention(q, k, v, table, lens, start, lens,
                                                       sm_scale=scale, block_q=bq, block_k=bk,
                                                       num_warps=w, num_stages=st))
        r[f"extend_ms_bq{bq}_bk{bk}_w{w}_s{st}"] = _safe(
            lambda f=f: timeit(lambda: f(q, k, v)) * 1e3)
    kc = k[table].reshape(b, t, kv_heads, dim)
    vc = v[table].reshape(b, t, kv_heads, dim)
    qc = q.reshape(b, t, heads, dim)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                 scale=scale,
                                                                 implementation="cudnn"))
    r["cudnn_ms"] = _safe(lambda: timeit(lambda: cudnn(qc, kc, vc)) * 1e3)
    res.setdefault("extend_attention", {})[name] = r
    if decode:
        decode_attention(res, name, kv_heads, dim, heads)


def decode_attention(res: dict, name: str, kv_heads: int, dim: int, heads: int) -> None:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    rng = np.random.default_rng(1)
    b, seq = 32, 4096
    per = seq // PAGE
    num_pages = b * per + 8
    table = jnp.asarray(rng.permutation(num_pages)[: b * per].reshape(b, per).astype(np.int32))
    k, v = _rand(6, (num_pages, PAGE, kv_heads, dim)), _rand(7, (num_pages, PAGE, kv_heads, dim))
    q = _rand(8, (b, heads, dim))
    lens = jnp.full((b,), seq, jnp.int32)
    r = {"batch": b, "seq_len": seq, "kv_bytes": 2 * b * seq * kv_heads * dim * 2}
    for splits, bk in ((8, 64), (16, 64), (32, 64), (16, 128)):
        f = jax.jit(lambda q, k, v: pk.paged_decode_attention(q, k, v, table, lens,
                                                              sm_scale=dim**-0.5, splits=splits,
                                                              block_k=bk))
        r[f"ours_ms_splits{splits}_bk{bk}"] = _safe(lambda f=f: timeit(lambda: f(q, k, v)) * 1e3)
    kh, vh = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))  # jax's layout [Hkv, pages, S, D]
    g = jax.jit(lambda q, k, v: jax_paged.paged_attention(q, k, v, table, lens))
    r["jax_pallas_paged_ms"] = _safe(lambda: timeit(lambda: g(q, kh, vh)) * 1e3)
    res.setdefault("decode_attention", {})[name] = r


def gathers(res: dict, name: str, layers: int, kv_heads: int, dim: int, pages: int = 128,
            pool_pages: int = 4096, **_) -> None:
    """A write-back's staging gather as the engine runs it (XLA gathers, one [2, n, S, H, D]
    array per layer) of `pages` scattered pages of every layer (8192 tokens at page 64). Bytes
    moved count a read and a write of each page; compare hbm_copy_gbps."""
    from jhicache.cache import transfer  # the engine's gather, a private program of its controller

    shape = (pool_pages, PAGE, kv_heads, dim)
    ks = tuple(_rand(200 + i, shape) for i in range(layers))
    vs = tuple(_rand(300 + i, shape) for i in range(layers))
    ids = jnp.asarray(np.random.default_rng(2).permutation(pool_pages)[:pages].astype(np.int32))
    staging = transfer._gather_kv(ks, vs, ids)
    same = all(bool((s[0] == k[ids]).all() and (s[1] == v[ids]).all())
               for s, k, v in zip(staging, ks, vs))
    moved = 2 * 2 * layers * pages * PAGE * kv_heads * dim * 2  # K and V, read + write, bf16
    r = {"pages": pages, "layers": layers, "bytes_read_and_written": moved,
         "staging_is_the_pages": same}
    seconds = _safe(lambda: timeit(lambda: transfer._gather_kv(ks, vs, ids)))
    r["xla_gather_ms"] = seconds * 1e3 if isinstance(seconds, float) else seconds
    if isinstance(seconds, float):
        r["xla_gather_gbps"] = moved / seconds / GB
    res.setdefault("write_back_gather", {})[name] = r


PARTS = ("ceilings", "transfers", "kv_write", "extend", "decode", "gathers")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--merge", default=None,
                        help="earlier result JSON whose parts not re-run are kept")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    res = json.load(open(args.merge)) if args.merge else {}
    if args.merge:  # the kernels' numbers before this round stay on record beside the new ones
        res.setdefault("previous_round",
                       {k: res[k] for k in ("date", "hbm_copy_gbps", "kv_write", "extend_attention")
                        if k in res})
    res.update({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "page_size": PAGE, "dtype": "bfloat16"})
    if args.merge:
        res["parts_rerun"] = {"parts": sorted(only), "date": res["date"],
                              "note": "other fields come from the earlier run in --merge"}
    for key, part in (("ceilings", lambda: ceilings(res)), ("transfers", lambda: transfers(res))):
        err = _safe(part) if key in only else None
        if isinstance(err, str):
            res.setdefault("errors", []).append(err)
    for name, shape in SHAPES.items():
        parts = [("kv_write", kv_write),
                 ("extend", functools.partial(attention, decode="decode" in only)),
                 ("gathers", gathers)]
        for key, part in parts:
            if key in only:
                err = _safe(lambda part=part: part(res, name, **shape))
                if isinstance(err, str):
                    res.setdefault("errors", []).append(f"{name} {key}: {err}")
    best = lambda d: min((v for k, v in d.items()  # noqa: E731
                          if k.startswith(("extend_ms", "ours_ms")) and isinstance(v, float)),
                         default=None)
    res["kv_write_gbps"] = max((v for s in res.get("kv_write", {}).values()
                                for v in s["gbps"].values()
                                if isinstance(v, float)), default=None)
    for name in SHAPES:
        for key in ("extend_attention", "decode_attention"):
            if name in res.get(key, {}):
                res[key][name]["ours_best_ms"] = best(res[key][name])
        ext = res.get("extend_attention", {}).get(name, {})
        if isinstance(ext.get("cudnn_ms"), float) and ext.get("ours_best_ms"):
            ext["ours_over_cudnn"] = ext["ours_best_ms"] / ext["cudnn_ms"]
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
