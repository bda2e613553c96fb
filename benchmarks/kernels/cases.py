"""The attention targets' cases: kernel configs, sweep stages, each part's cases, their inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jhicache.pallas_kernels as pk
import numpy as np
from jhicache.pallas_kernels.extend_attention import choose_extend_splits
from jhicache.pallas_kernels.fresh_attention import attend_fresh_apart

from benchmarks.kernels.shapes import DT, PAGE, SHAPES, random_array

KINDS = ("extend", "decode", "prefill")
JAX_PAGED = "jax_pallas_paged"  # decode's peer: jax.experimental.pallas.ops.gpu.paged_attention

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
    # prefill: jax.nn.dot_product_attention's `implementation`; decode: JAX_PAGED or None
    peer: str | None = None

    def __post_init__(self) -> None:
        ok = self.kind in KINDS and (self.start.block_q is None) == (self.kind == "decode")
        ok &= self.kind != "decode" or self.query_len == 1
        ok &= self.kind != "prefill" or (self.query_len == self.seq_len and self.peer is not None)
        ok &= (self.peer == JAX_PAGED) == (self.kind == "decode" and self.peer is not None)
        ok &= self.kind != "extend" or self.peer is None
        if not ok:
            raise ValueError(f"inconsistent case {self}")

    @property
    def pages_per_request(self) -> int:
        return -(-self.seq_len // PAGE)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the kernel must read per layer: every request's cached tokens."""
        return 2 * self.batch * self.seq_len * self.kv_heads * self.dim * jnp.dtype(DT).itemsize

    @property
    def flops(self) -> int:
        """FLOPs of the attention per layer: QK and PV, 2 a multiply-add each, for every query
        head of every new token against each key it sees (the prefix, and the new tokens up to
        itself)."""
        prefix = self.seq_len - self.query_len
        pairs = self.query_len * prefix + self.query_len * (self.query_len + 1) // 2
        return 4 * self.batch * self.heads * self.dim * pairs


@dataclasses.dataclass(frozen=True)
class CaseInputs:
    """One case's arrays: passed to the timed programs as arguments, never closed over (closed-over
    arrays would be baked into the program as constants)."""

    q: jax.Array
    ks: tuple[jax.Array, ...]  # one [pages, PAGE, kv_heads, dim] buffer per layer
    vs: tuple[jax.Array, ...]
    # per layer, the new tokens' K and V rows as the model has them (read out of the pages), for
    # extend and prefill, whose new tokens the model may attend among themselves apart; decode: None
    news: tuple[tuple[jax.Array, jax.Array] | None, ...]
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
             **kw: Any) -> AttnCase:
        s = SHAPES[shape]
        tag = f"{new}_over_{seq - new}" if kind == "extend" else f"{batch}x{seq}"
        return AttnCase(f"{kind}_{shape}_{tag}", kind, s["heads"], s["kv_heads"], s["dim"],
                        s["layers"], batch, seq, new, target, **kw)

    extend = dict(start=KernelConfig(block_q=128, block_k=64), stages=EXTEND_STAGES)
    decode = dict(start=KernelConfig(block_k=128, splits=16),  # paged_decode_attention's defaults
                  peer=JAX_PAGED)
    prefill = dict(start=KernelConfig(block_q=128, block_k=64), stages=PREFILL_STAGES,
                   peer="cudnn")
    return {
        "extend_long": tuple(case("extend", s, 1, 8256, 64, 0.40, **extend)
                             for s in ("qwen2-7b", "qwen2-0.5b")),
        "decode_long": (case("decode", "qwen2-7b", 32, 4096, 1, 0.50,
                             stages=_decode_stages((8, 16, 32, 64)), **decode),
                        case("decode", "qwen2-7b", 8, 32768, 1, 0.50,
                             stages=_decode_stages((16, 32, 64, 128)), **decode)),
        "prefill": tuple(case("prefill", "qwen2-7b", b, t, t, 1.05, **prefill)
                         for b, t in ((4, 2048), (1, 8192))),
    }


TARGET_PARTS = ("extend_long", "decode_long", "prefill")


def page_table(case: AttnCase, seed: int = 0) -> jax.Array:
    """[batch, pages_per_request] int32: every page of a pool of exactly the batch's pages, in
    scattered order."""
    num_pages = case.batch * case.pages_per_request
    return jnp.asarray(np.random.default_rng(seed).permutation(num_pages)
                       .reshape(case.batch, -1).astype(np.int32))


def inputs(case: AttnCase, seed: int = 0) -> CaseInputs:
    """Random bf16 q and per-layer K/V pools of exactly the batch's pages, in scattered order."""
    table = page_table(case, seed)
    shape = (table.size, PAGE, case.kv_heads, case.dim)
    ks = tuple(random_array(100 + 2 * i, shape) for i in range(case.layers))
    vs = tuple(random_array(101 + 2 * i, shape) for i in range(case.layers))
    lens = jnp.full((case.batch,), case.seq_len, jnp.int32)
    q = random_array(7, (case.batch * case.query_len, case.heads, case.dim))
    if case.kind == "decode":
        return CaseInputs(q, ks, vs, (None,) * case.layers, (table, lens))
    start = jnp.arange(case.batch, dtype=jnp.int32) * case.query_len
    positions = np.arange(case.seq_len - case.query_len, case.seq_len)
    pages = np.asarray(table)[:, positions // PAGE].reshape(-1)
    slots = np.tile(positions % PAGE, case.batch)
    news = tuple((k[pages, slots], v[pages, slots]) for k, v in zip(ks, vs))
    return CaseInputs(q, ks, vs, news, (table, lens, start, jnp.full_like(lens, case.query_len)))


def kernel(case: AttnCase, cfg: KernelConfig) -> Callable[..., jax.Array]:
    """(q, k, v, new, *meta) -> output shaped like q, for the case's public kernel function as the
    model calls it: extend gets the new tokens' K/V `new` where the model would attend them
    apart (`apart`)."""
    kw = dict(sm_scale=case.dim**-0.5, **cfg.kwargs())
    if case.kind == "decode":
        return lambda q, k, v, new, *meta: pk.paged_decode_attention(q, k, v, *meta, **kw)

    def extend(q: jax.Array, k: jax.Array, v: jax.Array, new: Any, *meta: jax.Array) -> jax.Array:
        return pk.paged_attention(q, k, v, *meta, new_kv=new if apart(case) else None, **kw)
    return extend


def apart(case: AttnCase) -> bool:
    """Whether the model computes this case's new tokens' attention among themselves apart."""
    return case.kind != "decode" and attend_fresh_apart(case.batch * case.query_len, DT)


def resolve(case: AttnCase, cfg: KernelConfig) -> KernelConfig:
    """cfg with extend's automatic split count made explicit: what paged_attention would pick."""
    if case.kind == "decode" or cfg.splits is not None or cfg.block_q is None:
        return cfg
    splits = choose_extend_splits(case.batch * case.query_len, case.batch,
                                  case.pages_per_request * PAGE, case.heads, case.kv_heads,
                                  case.dim, block_q=cfg.block_q, block_k=cfg.block_k)
    return dataclasses.replace(cfg, splits=splits)

