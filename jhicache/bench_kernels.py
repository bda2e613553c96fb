"""Kernel benchmark on the GPU: pallas_kernels ops at Qwen2 shapes, ceilings, attention targets.

Page 64, bf16. Parts (--only, comma-separated; default: all):
  ceilings     PCIe both ways (device_put of pinned host arrays); HBM copy (x + 1 on 1 GiB)
  hbm_read     HBM read ceiling: read-only reductions over 4 distinct 1 GiB arrays, one program
  transfers    the host tier's write-back and load-back of scattered pages
  kv_write     write_kv vs XLA's scatter
  gathers      the write-back's staging gather
  extend_long  target: 64 new tokens over 8192 cached, 7B and 0.5B heads, >= 0.40 of hbm_read
  decode_long  target: 32 x 4096 and 8 x 32768, 7B heads, >= 0.50 of hbm_read
  prefill      target: 4 x 2048 and 1 x 8192 fresh tokens, 7B heads, <= 1.05 x cuDNN's time
The target parts time per layer from one program over the model's layers (TIMING_NOTE), sweep the
kernel's tuning arguments, check the fastest config against the float32 reference, and run
hbm_read before and after them (its best counts). Results: attention_targets (every config) and
attention_summary (per case: per_layer_ms, bytes, fraction_of_hbm_read, target, met).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jhicache.pallas_kernels as pk
from jhicache.cache import DevicePool, HostPool, PoolLayout, TransferController, make_copier
from jhicache.pallas_kernels.decode_attention import paged_decode_attention_reference
from jhicache.pallas_kernels.extend_attention import (
    choose_extend_splits,
    paged_attention_reference,
)
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


# ---------------------------------------------------------------- attention targets
# Each target case times its kernel in one dispatch: one jitted program runs it over L layers, and
# the host clock around the whole program, over L, is the per-layer time. Dispatch and sync (tens
# of microseconds) then count once per L layers, not once per 10-100 us kernel as when a single
# call is timed.
TIMING_NOTE = ("per-layer time from one program running the kernel over L layers: distinct K/V "
               "buffers per layer (so L2 serves no repeats), each layer's query the previous "
               "layer's output; median of reps after warm-up, blocked on around the whole "
               "program, divided by L. It includes the ops around the kernel (extend's split-K "
               "merge kernel, decode's XLA merge), which the model pays too")
REF_BYTES = 8 << 30  # float32 working set of one reference call at most ([rows, keys, H, D] x 3)
TOL = 2e-2  # bf16 output vs the float32 reference: atol = rtol, as in the kernel tests
KINDS = ("extend", "decode", "prefill")
SUMMARY_KEYS = ("per_layer_ms", "bytes", "fraction_of_hbm_read", "ours_over_peer", "target", "met")

# a stage of the sweep: (KernelConfig field, values) pairs whose product is tried
Stage = tuple[tuple[str, tuple[int | None, ...]], ...]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning arguments of one kernel call. None leaves the public function's choice: extend's
    splits (choose_extend_splits); block_q is None for decode, which has none."""

    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None
    block_q: int | None = None

    def kwargs(self) -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def label(self) -> str:
        bq = [] if self.block_q is None else [f"bq{self.block_q}"]
        splits = "auto" if self.splits is None else self.splits
        return "_".join([*bq, f"bk{self.block_k}", f"splits{splits}", f"w{self.num_warps}",
                         f"s{self.num_stages}"])


@dataclasses.dataclass(frozen=True)
class AttnCase:
    """One attention target: kernel kind, head shape, batch, target, and the sweep (a coordinate
    search: `start`, then each stage's product of values around the best so far)."""

    name: str
    kind: str  # "extend": new tokens over a cached prefix; "decode"; "prefill": nothing cached
    heads: int
    kv_heads: int
    dim: int
    layers: int
    batch: int
    seq_len: int  # tokens per request in the cache after the step (prefix + new)
    query_len: int  # new tokens per request: 1 for decode, seq_len for prefill
    target: float  # fraction_of_hbm_read at least; prefill: ours_over_peer at most
    start: KernelConfig
    stages: tuple[Stage, ...]
    peer: str | None = None  # prefill: jax.nn.dot_product_attention's `implementation`

    def __post_init__(self) -> None:
        ok = self.kind in KINDS and (self.start.block_q is None) == (self.kind == "decode")
        ok &= self.kind != "decode" or self.query_len == 1
        ok &= self.kind != "prefill" or (self.query_len == self.seq_len and self.peer is not None)
        if not ok:
            raise ValueError(f"inconsistent case {self}")

    @property
    def pages_per_request(self) -> int:
        return -(-self.seq_len // PAGE)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the kernel must read per layer: every request's cached tokens."""
        return 2 * self.batch * self.seq_len * self.kv_heads * self.dim * jnp.dtype(DT).itemsize


@dataclasses.dataclass(frozen=True)
class CaseInputs:
    """One case's arrays: passed to the timed programs as arguments, never closed over (closed-over
    arrays would be baked into the program as constants)."""

    q: jax.Array
    ks: tuple[jax.Array, ...]  # one [pages, PAGE, kv_heads, dim] buffer per layer
    vs: tuple[jax.Array, ...]
    meta: tuple[jax.Array, ...]  # page_table, seq_lens (+ query_start, query_lens for extend)


WARPS_STAGES: Stage = (("num_warps", (4, 8)), ("num_stages", (2, 3)))
# A short turn over a long prefix: row tile and warps together first (a 256-row tile needs 8
# warps for its accumulator; each tile of a kv head reads all of its keys, so larger tiles read
# fewer bytes from L2), then the split count around them, then key block and pipeline depth.
EXTEND_STAGES: tuple[Stage, ...] = ((("block_q", (64, 128, 256)), ("num_warps", (4, 8))),
                                    (("splits", (None, 8, 16, 32)),),
                                    (("block_k", (64, 128)), ("num_stages", (2, 3))))
# fresh prefill fills the GPU without split-K (choose_extend_splits gives 1)
PREFILL_STAGES: tuple[Stage, ...] = ((("block_q", (64, 128)), ("block_k", (64, 128))),
                                     WARPS_STAGES)


def _decode_stages(splits: tuple[int, ...]) -> tuple[Stage, ...]:
    return ((("splits", splits),), (("block_k", (64, 128, 256)),), WARPS_STAGES)


def target_cases() -> dict[str, tuple[AttnCase, ...]]:
    """The cases of each target part (H200, bf16, page 64, the layers of each Qwen2 model)."""
    def case(kind: str, shape: str, batch: int, seq: int, new: int, target: float,
             **kw) -> AttnCase:
        s = SHAPES[shape]
        tag = f"{new}_over_{seq - new}" if kind == "extend" else f"{batch}x{seq}"
        return AttnCase(f"{kind}_{shape}_{tag}", kind, s["heads"], s["kv_heads"], s["dim"],
                        s["layers"], batch, seq, new, target, **kw)

    extend = dict(start=KernelConfig(block_q=128, block_k=64), stages=EXTEND_STAGES)
    decode = KernelConfig(block_k=128, splits=16)  # paged_decode_attention's defaults
    prefill = dict(start=KernelConfig(block_q=128, block_k=64), stages=PREFILL_STAGES,
                   peer="cudnn")
    return {
        "extend_long": tuple(case("extend", s, 1, 8256, 64, 0.40, **extend)
                             for s in ("qwen2-7b", "qwen2-0.5b")),
        "decode_long": (case("decode", "qwen2-7b", 32, 4096, 1, 0.50, start=decode,
                             stages=_decode_stages((8, 16, 32, 64))),
                        case("decode", "qwen2-7b", 8, 32768, 1, 0.50, start=decode,
                             stages=_decode_stages((16, 32, 64, 128)))),
        "prefill": tuple(case("prefill", "qwen2-7b", b, t, t, 1.05, **prefill)
                         for b, t in ((4, 2048), (1, 8192))),
    }


TARGET_PARTS = ("extend_long", "decode_long", "prefill")

# read-only passes for the HBM read ceiling; each output is at most 1/1024 of the bytes read
READS: tuple[tuple[str, Callable[[jax.Array], jax.Array]], ...] = (
    ("sum_f32", lambda x: jnp.sum(x.astype(jnp.float32))),
    ("row_max_1024", lambda x: x.reshape(-1, 1024).max(axis=1)),
    ("row_sum_f32_8192", lambda x: x.reshape(-1, 8192).astype(jnp.float32).sum(axis=1)),
)


def per_layer_seconds(program: Callable[..., object], args: tuple, layers: int, reps: int = 7,
                      warm: int = 2) -> float:
    """Median seconds of one call of jit(program)(*args) (a program over `layers` layers, all in
    one dispatch) after warm-up calls (the first compiles), divided by `layers`."""
    f = jax.jit(program)
    return timeit(lambda: f(*args), reps, warm) / layers


def hbm_read(res: dict, mib: int = 1024, buffers: int = 4, reps: int = 21, warm: int = 10) -> None:
    """HBM read ceiling: each READS pass over `buffers` distinct `mib` MiB bf16 arrays (well above
    the 50 MB L2) in one program; bytes read / per-array time. A second call in the same run keeps
    each pass's best, so a cold first measurement cannot understate the ceiling."""
    n = (mib << 20) // 2
    xs = tuple(_rand(50 + i, (n,)) for i in range(buffers))
    row = res.setdefault("hbm_read", {"variants_gbps": {}, "passes": 0})
    for name, read in READS:
        s = _safe(lambda read=read: per_layer_seconds(lambda xs: [read(x) for x in xs], (xs,),
                                                      buffers, reps, warm))
        old = row["variants_gbps"].get(name)
        if isinstance(s, float):
            gbps = 2 * n / s / GB
            row["variants_gbps"][name] = max(gbps, old) if isinstance(old, float) else gbps
        elif not isinstance(old, float):
            row["variants_gbps"][name] = s
    row["passes"] += 1
    measured = {k: v for k, v in row["variants_gbps"].items() if isinstance(v, float)}
    if not measured:
        raise RuntimeError(f"no HBM read pass ran: {row['variants_gbps']}")
    best = max(measured, key=measured.get)
    res["hbm_read_gbps"] = measured[best]
    res["hbm_read_note"] = (f"{best}: jitted read-only pass over {buffers} distinct {mib} MiB bf16 "
                            f"arrays in one program, bytes read / per-array time; the best of "
                            f"{len(READS)} passes (variants_gbps) over {row['passes']} "
                            f"measurement(s) in this run")


def _inputs(case: AttnCase, seed: int = 0) -> CaseInputs:
    """Random bf16 q and per-layer K/V pools of exactly the batch's pages, in scattered order."""
    num_pages = case.batch * case.pages_per_request
    table = jnp.asarray(np.random.default_rng(seed).permutation(num_pages)
                        .reshape(case.batch, -1).astype(np.int32))
    shape = (num_pages, PAGE, case.kv_heads, case.dim)
    ks = tuple(_rand(100 + 2 * i, shape) for i in range(case.layers))
    vs = tuple(_rand(101 + 2 * i, shape) for i in range(case.layers))
    lens = jnp.full((case.batch,), case.seq_len, jnp.int32)
    q = _rand(7, (case.batch * case.query_len, case.heads, case.dim))
    if case.kind == "decode":
        return CaseInputs(q, ks, vs, (table, lens))
    start = jnp.arange(case.batch, dtype=jnp.int32) * case.query_len
    return CaseInputs(q, ks, vs, (table, lens, start, jnp.full_like(lens, case.query_len)))


def _kernel(case: AttnCase, cfg: KernelConfig) -> Callable[..., jax.Array]:
    """(q, k, v, *meta) -> output shaped like q, for the case's public kernel function."""
    kw = dict(sm_scale=case.dim**-0.5, **cfg.kwargs())
    if case.kind == "decode":
        return lambda q, k, v, *meta: pk.paged_decode_attention(q, k, v, *meta, **kw)
    return lambda q, k, v, *meta: pk.paged_attention(q, k, v, *meta, **kw)


def _over_layers(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A program running `kernel` once per layer; each layer's query is the previous layer's
    output, as in the model, so XLA can neither drop nor merge a layer's call."""
    def program(q: jax.Array, ks: tuple, vs: tuple, *meta: jax.Array) -> jax.Array:
        for k, v in zip(ks, vs, strict=True):
            q = kernel(q, k, v, *meta)
        return q
    return program


def resolve(case: AttnCase, cfg: KernelConfig) -> KernelConfig:
    """cfg with extend's automatic split count made explicit: what paged_attention would pick."""
    if case.kind == "decode" or cfg.splits is not None:
        return cfg
    splits = choose_extend_splits(case.batch * case.query_len, case.batch,
                                  case.pages_per_request * PAGE, case.heads, case.kv_heads,
                                  case.dim, block_q=cfg.block_q, block_k=cfg.block_k)
    return dataclasses.replace(cfg, splits=splits)


def _best(times: dict[KernelConfig, float | str]) -> tuple[KernelConfig | None, float | None]:
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok, key=ok.get, default=None)
    return best, None if best is None else ok[best]


def sweep(case: AttnCase, measure: Callable[[KernelConfig], float | str]
          ) -> dict[KernelConfig, float | str]:
    """Every config tried -> its measure (seconds, or an error string). Coordinate search: start,
    then each stage's product around the best so far; configs equal once resolved run once."""
    times: dict[KernelConfig, float | str] = {}
    by_resolved: dict[KernelConfig, float | str] = {}

    def run(cfg: KernelConfig) -> None:
        key = resolve(case, cfg)
        if key not in by_resolved:
            by_resolved[key] = measure(key)
        times[cfg] = by_resolved[key]

    run(case.start)
    for stage in case.stages:
        around = _best(times)[0] or case.start
        names = [name for name, _ in stage]
        for values in itertools.product(*(vals for _, vals in stage)):
            run(dataclasses.replace(around, **dict(zip(names, values, strict=True))))
    return times


def _chunk(total: int, limit: int) -> int:
    """The largest power of two <= limit (at least 1) that divides total."""
    n = 1
    while n * 2 <= limit and total % (n * 2) == 0:
        n *= 2
    return n


def _errors(got: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Max |got - ref| and max(|got - ref| - TOL * (1 + |ref|)) (> 0: out of tolerance)."""
    d = jnp.abs(got.astype(jnp.float32) - ref)
    return d.max(), (d - TOL * (1 + jnp.abs(ref))).max()


def _extend_errors(case: AttnCase, got: jax.Array, data: CaseInputs, n: int) -> list[tuple]:
    """Per chunk of n new tokens of one request: the reference over that chunk alone, its key bound
    set to the chunk's last position + 1 so that the reference's positions are the chunk's."""
    scale = case.dim**-0.5

    @jax.jit
    def err(got, q, k, v, table, b, lo, seen):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, n)  # noqa: E731
        ref = paged_attention_reference(rows(q), k, v, jax.lax.dynamic_slice_in_dim(table, b, 1),
                                        seen[None], jnp.zeros((1,), jnp.int32),
                                        jnp.full((1,), n, jnp.int32), sm_scale=scale)
        return _errors(rows(got), ref)

    q32, prefix = data.q.astype(jnp.float32), case.seq_len - case.query_len  # f32 q: f32 output
    return [err(got, q32, data.ks[0], data.vs[0], data.meta[0], b, b * case.query_len + j,
                jnp.int32(prefix + j + n))
            for b in range(case.batch) for j in range(0, case.query_len, n)]


def _decode_errors(case: AttnCase, got: jax.Array, data: CaseInputs, n: int) -> list[tuple]:
    """Per chunk of n requests: paged_decode_attention_reference over those requests."""
    scale = case.dim**-0.5

    @jax.jit
    def err(got, q, k, v, table, lens, b0):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, b0, n)  # noqa: E731
        ref = paged_decode_attention_reference(rows(q), k, v, rows(table), rows(lens),
                                               sm_scale=scale)
        return _errors(rows(got), ref)

    q32 = data.q.astype(jnp.float32)
    return [err(got, q32, data.ks[0], data.vs[0], *data.meta, b0)
            for b0 in range(0, case.batch, n)]


def reference_check(case: AttnCase, data: CaseInputs, cfg: KernelConfig) -> dict:
    """Layer 0's output under cfg against the pure-jnp reference in float32, run in chunks of rows
    that keep its [rows, keys, heads, dim] float32 copies of K and V under REF_BYTES."""
    got = jax.jit(_kernel(case, cfg))(data.q, data.ks[0], data.vs[0], *data.meta)
    per_row = 3 * case.pages_per_request * PAGE * case.heads * case.dim * 4
    limit = REF_BYTES // per_row
    if case.kind == "decode":
        n = _chunk(case.batch, limit)
        errs = _decode_errors(case, got, data, n)
    else:
        n = _chunk(case.query_len, limit)
        errs = _extend_errors(case, got, data, n)
    worst = np.asarray([[float(a), float(e)] for a, e in errs]).max(axis=0)  # NaN propagates
    return {"max_abs_err": float(worst[0]), "within_tolerance": bool(worst[1] <= 0),
            "tolerance": f"|err| <= {TOL} * (1 + |ref|)", "layer": 0,
            "rows_per_reference_call": n,
            "reference": ("paged_decode_attention_reference" if case.kind == "decode"
                          else "paged_attention_reference") + ", float32"}


def peer_seconds(case: AttnCase, reps: int = 7, warm: int = 2) -> float:
    """Per-layer time of jax.nn.dot_product_attention (causal, implementation=case.peer) on dense
    per-layer K/V, timed as the kernel is (one program over the layers)."""
    shape = (case.batch, case.seq_len, case.kv_heads, case.dim)
    q = _rand(9, (case.batch, case.query_len, case.heads, case.dim))
    ks = tuple(_rand(500 + 2 * i, shape) for i in range(case.layers))
    vs = tuple(_rand(501 + 2 * i, shape) for i in range(case.layers))
    attn = functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=case.dim**-0.5,
                             implementation=case.peer)
    return per_layer_seconds(_over_layers(attn), (q, ks, vs), case.layers, reps, warm)


def attention_case(res: dict, case: AttnCase, reps: int = 7, warm: int = 2) -> dict:
    """Sweeps the case's kernel configs, checks the fastest against the reference, times the peer
    (prefill) and stores the row under res["attention_targets"][case.name]; `judge` adds the
    fraction of the HBM read ceiling and whether the target is met."""
    data = _inputs(case)
    times = sweep(case, lambda cfg: _safe(lambda: per_layer_seconds(
        _over_layers(_kernel(case, cfg)), (data.q, data.ks, data.vs, *data.meta), case.layers,
        reps, warm)))
    kernel = "pk.paged_decode_attention" if case.kind == "decode" else "pk.paged_attention"
    row = {"kernel": kernel, "heads": case.heads, "kv_heads": case.kv_heads, "dim": case.dim,
           "layers": case.layers, "batch": case.batch, "seq_len": case.seq_len,
           "query_len": case.query_len, "bytes": case.kv_bytes,
           "bytes_note": "K+V of every request's seq_len tokens, bf16, per layer",
           "timing": TIMING_NOTE,
           "sweep_per_layer_ms": {c.label(): t * 1e3 if isinstance(t, float) else t
                                  for c, t in times.items()}}
    if case.kind != "decode":
        row["auto_splits"] = resolve(case, case.start).splits
    row["target"] = ({"metric": "ours_over_peer", "at_most": case.target} if case.kind == "prefill"
                     else {"metric": "fraction_of_hbm_read", "at_least": case.target})
    res.setdefault("attention_targets", {})[case.name] = row
    best, seconds = _best(times)
    if best is None:
        raise RuntimeError(f"{case.name}: every config failed, first: {next(iter(times.values()))}")
    row.update(best=best.label(), best_config=dataclasses.asdict(resolve(case, best)),
               per_layer_ms=seconds * 1e3, gbps=case.kv_bytes / seconds / GB)
    row["reference_check"] = _safe(lambda: reference_check(case, data, resolve(case, best)))
    if case.peer is not None:
        row["peer"] = f"jax.nn.dot_product_attention(is_causal=True, implementation={case.peer!r})"
        peer = _safe(lambda: peer_seconds(case, reps, warm))
        row["peer_per_layer_ms"] = peer * 1e3 if isinstance(peer, float) else peer
        if isinstance(peer, float):
            row["ours_over_peer"] = seconds / peer
    return row


def _met(row: dict) -> bool | None:
    """The row's target metric within its bound and its reference check passed; None: no metric
    (no ceiling in this run, or the peer or every config failed)."""
    target, value = row["target"], row.get(row["target"]["metric"])
    if value is None:
        return None
    check = row.get("reference_check")
    correct = isinstance(check, dict) and check["within_tolerance"]
    fast = value >= target["at_least"] if "at_least" in target else value <= target["at_most"]
    return bool(fast and correct)


def judge(res: dict, names: list[str]) -> None:
    """For the named rows of this run: fraction of this run's hbm_read_gbps and `met` (the target
    met and the reference check passed; None: not judged, for want of the ceiling or the peer);
    then res["attention_summary"] over every row on record."""
    rows = res.get("attention_targets", {})
    ceiling = res.get("hbm_read_gbps")
    for name in names:
        row = rows[name]
        if "gbps" in row:
            row["fraction_of_hbm_read"] = (row["gbps"] / ceiling if isinstance(ceiling, float)
                                           else None)
        row["met"] = _met(row)
        # the summary fields first, for whoever reads the JSON
        rows[name] = {**{k: row[k] for k in SUMMARY_KEYS if k in row}, **row}
    res["attention_summary"] = {name: {k: row[k] for k in SUMMARY_KEYS if k in row}
                                for name, row in rows.items()}


def _run_targets(res: dict, only: set[str], targets: list[str]) -> None:
    """hbm_read (if selected), the target parts' cases, hbm_read again after them (so a cold GPU
    cannot understate the ceiling and overstate the fractions), then `judge`."""
    def record(err: object, what: str) -> None:
        if isinstance(err, str):
            res.setdefault("errors", []).append(f"{what}: {err}")

    if "hbm_read" in only:
        record(_safe(lambda: hbm_read(res)), "hbm_read")
    names = []
    for part in targets:
        for case in target_cases()[part]:
            record(_safe(lambda case=case: attention_case(res, case)), f"{part} {case.name}")
            if case.name in res.get("attention_targets", {}):
                names.append(case.name)
    if targets:
        record(_safe(lambda: hbm_read(res)), "hbm_read (after the targets)")
        judge(res, names)


PARTS = ("ceilings", "hbm_read", "transfers", "kv_write", "gathers", *TARGET_PARTS)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--merge", default=None,
                        help="earlier result JSON whose parts not re-run are kept")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(PARTS):
        parser.error(f"unknown parts {sorted(only - set(PARTS))}; choose from {PARTS}")
    targets = [p for p in TARGET_PARTS if p in only]
    if targets:  # their fractions are of the read ceiling measured in the same run
        only.add("hbm_read")
    res = json.load(open(args.merge)) if args.merge else {}
    if "hbm_read" in only:  # a merged ceiling is another run's
        for key in ("hbm_read", "hbm_read_gbps", "hbm_read_note"):
            res.pop(key, None)
    if args.merge:  # the kernels' numbers before this round stay on record beside the new ones
        res.setdefault("previous_round",
                       {k: res[k] for k in ("date", "hbm_copy_gbps", "kv_write") if k in res})
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
        for key, part in (("kv_write", kv_write), ("gathers", gathers)):
            if key in only:
                err = _safe(lambda part=part: part(res, name, **shape))
                if isinstance(err, str):
                    res.setdefault("errors", []).append(f"{name} {key}: {err}")
    _run_targets(res, only, targets)
    res["kv_write_gbps"] = max((v for s in res.get("kv_write", {}).values()
                                for v in s["gbps"].values()
                                if isinstance(v, float)), default=None)
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
