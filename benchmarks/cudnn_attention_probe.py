"""What cuDNN's fused attention (through JAX's cuDNN custom calls) does for our attention shapes.

    PYTHONPATH=. python3 benchmarks/cudnn_attention_probe.py --out cudnn_probe.json

Parts, each timed per layer as the kernel bench does (one program over a model's layers, distinct
K/V buffers per layer), each output checked against a float32 reference:
- fresh tokens, packed: requests' new tokens one after another in [T, H, D] (as the engine packs
  them), causal within each request, through cuDNN's packed (ragged) layout; against our extend
  kernel on the same tokens paged, and cuDNN on the padded [B, S, H, D] batch;
- its softmax statistics: shape, and which log-sum-exp they hold (natural or base 2, per token);
- cached prefixes, paged: new tokens over a prefix in pages, no mask (every prefix key visible to
  every new token), through cuDNN's paged attention; against our extend kernel's whole extend.
"""

from __future__ import annotations

import argparse
import inspect
import math

import jax
import jax.numpy as jnp
import jhicache.pallas_kernels as pk
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa

from jhicache.bench.command import save_json
from jhicache.bench.kernels.shapes import PAGE, SHAPES, random_array
from jhicache.bench.kernels.timing import per_layer_seconds, safe


def _over_layers(kernel):
    def program(q, ks, vs, *meta):
        for k, v in zip(ks, vs, strict=True):
            q = kernel(q, k, v, *meta).astype(q.dtype)
        return q
    return program


def _reference(q, k, v, segs, scale):
    """Causal attention within each segment of packed rows: (out [T, H, D] f32, lse natural
    [T, H])."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf, vf = (jnp.repeat(x, heads // kv_heads, axis=1) for x in (kf, vf))
    t = q.shape[0]
    seg_id = np.full(t, -1)
    start = 0
    for i, n in enumerate(segs):
        seg_id[start:start + n] = i
        start += n
    pos = np.arange(t)
    visible = (seg_id[:, None] == seg_id[None, :]) & (pos[None, :] <= pos[:, None]) & (
        seg_id[:, None] >= 0)
    s = jnp.einsum("thd,shd->hts", qf, kf) * scale
    s = jnp.where(jnp.asarray(visible)[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [H, T]
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    p = jnp.where(jnp.asarray(visible)[None], p, 0.0)
    out = jnp.einsum("hts,shd->thd", p, vf)
    return out, lse.T


def _packed_args(segs, total):
    """cuDNN's packed layout for one batch row of segments: seqlens [1, M], offsets [1, M + 1]."""
    lens = np.asarray(segs, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert offsets[-1] <= total
    return jnp.asarray(lens[None]), jnp.asarray(offsets[None])


def _cudnn_packed(q, k, v, lens, offsets, *, scale, residual=False):
    """q [T, H, D], k/v [T, KV, D] -> out [1, T, H, D] (and stats). One segment: the padded
    layout (cuDNN's packed one needs two or more)."""
    if offsets.shape[1] == 2:
        lens, offsets = lens[0], None
    return fa.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=lens, kv_seqlen=lens, q_offsets=offsets,
        kv_offsets=offsets, scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
        return_residual=residual)


def fresh(res: dict, shape: str, segs: list[int], total: int, layers: int | None = None) -> None:
    s = SHAPES[shape]
    heads, kv_heads, dim = s["heads"], s["kv_heads"], s["dim"]
    layers = layers or s["layers"]
    scale = dim**-0.5
    name = f"fresh_{shape}_{'+'.join(map(str, segs))}_in_{total}"
    row: dict = res.setdefault("fresh", {}).setdefault(name, {})
    q = random_array(1, (total, heads, dim))
    k = random_array(2, (total, kv_heads, dim))
    v = random_array(3, (total, kv_heads, dim))
    lens, offsets = _packed_args(segs, total)
    n = sum(segs)

    def check():
        out, stats = jax.jit(lambda q, k, v, a, b: _cudnn_packed(q, k, v, a, b, scale=scale,
                                                                 residual=True))(
            q, k, v, lens, offsets)
        ref, lse = _reference(q, k, v, segs, scale)
        out = out[0]
        got = {"out_shape": list(out.shape), "stats_shape": list(stats.shape),
               "max_abs_err_out": float(jnp.max(jnp.abs(out[:n].astype(jnp.float32) - ref[:n])))}
        st = np.asarray(stats, np.float32)
        lse_np = np.asarray(lse)  # [T, H]
        # candidate readings of the stats: [seg or batch, H, T] with T the packed row index
        if st.ndim == 3 and st.shape[1] == heads:
            flat = st[0].T  # [T, H] when stats index packed rows of batch row 0
            for label, scale_ in (("natural", 1.0), ("log2", math.log2(math.e))):
                got[f"stats_row0_vs_lse_{label}_max_err"] = float(
                    np.max(np.abs(flat[:n] - lse_np[:n] * scale_)))
            per_seg = []
            start = 0
            for i, m in enumerate(segs):
                if i < st.shape[0]:
                    per_seg.append(float(np.max(np.abs(st[i, :, :m].T - lse_np[start:start + m]))))
                start += m
            got["stats_per_segment_local_vs_natural_max_err"] = per_seg
        got["stats_sample"] = st.reshape(-1)[:8].tolist()
        got["lse_sample"] = lse_np[:2].reshape(-1)[:8].tolist()
        return got

    row["check"] = safe(check)
    row["cudnn_packed_ms"] = safe(lambda: 1e3 * per_layer_seconds(
        _over_layers(lambda q, k, v, a, b: _cudnn_packed(q, k, v, a, b, scale=scale)[0]),
        (q, tuple(random_array(100 + i, k.shape) for i in range(layers)),
         tuple(random_array(200 + i, v.shape) for i in range(layers)), lens, offsets), layers))
    if len(set(segs)) == 1 and n == total:
        b, t = len(segs), segs[0]
        row["cudnn_padded_ms"] = safe(lambda: 1e3 * per_layer_seconds(
            _over_layers(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, scale=scale, implementation="cudnn")),
            (q.reshape(b, t, heads, dim),
             tuple(random_array(100 + i, (b, t, kv_heads, dim)) for i in range(layers)),
             tuple(random_array(200 + i, (b, t, kv_heads, dim)) for i in range(layers))), layers))
    # ours: the same tokens in pages (each request's pages in order), nothing cached before them
    pages_per = [-(-m // PAGE) for m in segs]
    num_pages = sum(pages_per)
    table = np.zeros((len(segs), max(pages_per)), np.int32)
    first = 0
    for i, p in enumerate(pages_per):
        table[i, :p] = np.arange(first, first + p)
        first += p
    starts = np.concatenate([[0], np.cumsum(segs)[:-1]]).astype(np.int32)
    meta = (jnp.asarray(table), jnp.asarray(np.asarray(segs, np.int32)), jnp.asarray(starts),
            jnp.asarray(np.asarray(segs, np.int32)))
    shape_pages = (num_pages, PAGE, kv_heads, dim)
    row["ours_ms"] = safe(lambda: 1e3 * per_layer_seconds(
        _over_layers(lambda q, k, v, *m: pk.paged_attention(q, k, v, *m, sm_scale=scale)),
        (q, tuple(random_array(100 + i, shape_pages) for i in range(layers)),
         tuple(random_array(200 + i, shape_pages) for i in range(layers)), *meta), layers))
    flops = sum(4 * m * (m + 1) / 2 * heads * dim for m in segs)
    row["flops_per_layer"] = flops
    for key in ("cudnn_packed_ms", "cudnn_padded_ms", "ours_ms"):
        if isinstance(row.get(key), float):
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12


def prefix(res: dict, shape: str, batch: int, cached: int, new: int, pool_factor: int = 1) -> None:
    """New tokens over a cached prefix in pages: cuDNN paged (prefix only, no mask) and our
    kernel's whole extend."""
    s = SHAPES[shape]
    heads, kv_heads, dim, layers = s["heads"], s["kv_heads"], s["dim"], s["layers"]
    scale = dim**-0.5
    name = f"prefix_{shape}_{batch}x{new}_over_{cached}_pool_x{pool_factor}"
    row: dict = res.setdefault("prefix", {}).setdefault(name, {})
    per = cached // PAGE
    num_pages = batch * per * pool_factor
    rng = np.random.default_rng(0)
    table = rng.permutation(num_pages)[:batch * per * pool_factor].reshape(batch, -1).astype(
        np.int32)
    q = random_array(1, (batch, new, heads, dim))
    shape_pages = (num_pages, PAGE, kv_heads, dim)
    ks = tuple(random_array(100 + i, shape_pages) for i in range(layers))
    vs = tuple(random_array(200 + i, shape_pages) for i in range(layers))
    pt = jnp.asarray(table[:, None, :, None])
    q_len = jnp.full((batch,), new, jnp.int32)
    kv_len = jnp.full((batch,), cached, jnp.int32)

    def cudnn(q, k, v, pt, ql, kl):
        return fa.paged_attention(q, k, v, ql, kl, pt, pt, scale=scale,
                                  mask_type=fa.MaskType.PADDING, qkv_layout="BTNH")

    def check():
        out = jax.jit(cudnn)(q, ks[0], vs[0], pt, q_len, kv_len)
        keys = ks[0][table[:, :per]].reshape(batch, cached, kv_heads, dim).astype(jnp.float32)
        vals = vs[0][table[:, :per]].reshape(batch, cached, kv_heads, dim).astype(jnp.float32)
        keys, vals = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (keys, vals))
        sc = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), keys) * scale
        ref = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(sc, axis=-1), vals)
        return {"max_abs_err": float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))}

    row["check"] = safe(check)
    row["cudnn_paged_prefix_ms"] = safe(lambda: 1e3 * per_layer_seconds(
        _over_layers(cudnn), (q, ks, vs, pt, q_len, kv_len), layers))
    # ours: the whole extend (prefix + the new tokens, causal), as the engine runs it
    seq = cached + new
    pages_ours = -(-seq // PAGE)
    table_ours = np.arange(batch * pages_ours, dtype=np.int32).reshape(batch, -1)
    shape_ours = (batch * pages_ours, PAGE, kv_heads, dim)
    meta = (jnp.asarray(table_ours), jnp.full((batch,), seq, jnp.int32),
            jnp.arange(batch, dtype=jnp.int32) * new, jnp.full((batch,), new, jnp.int32))
    row["ours_whole_extend_ms"] = safe(lambda: 1e3 * per_layer_seconds(
        _over_layers(lambda q, k, v, *m: pk.paged_attention(q, k, v, *m, sm_scale=scale)),
        (q.reshape(batch * new, heads, dim),
         tuple(random_array(300 + i, shape_ours) for i in range(layers)),
         tuple(random_array(400 + i, shape_ours) for i in range(layers)), *meta), layers))
    row["kv_bytes"] = 2 * batch * cached * kv_heads * dim * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cudnn_attention_probe.json")
    args = parser.parse_args()
    res: dict = {"jax": jax.__version__, "device": str(jax.devices()[0])}
    res["cudnn_version"] = safe(fa.check_cudnn_version)
    res["signature_dot_product_attention"] = str(inspect.signature(fa.dot_product_attention))
    res["signature_paged_attention"] = safe(lambda: str(inspect.signature(fa.paged_attention)))
    fresh(res, "qwen2-7b", [64, 100, 37, 300], 512, layers=2)  # a small ragged check first
    fresh(res, "qwen2-7b", [2048] * 4, 8192)
    fresh(res, "qwen2-7b", [8192], 8192)
    fresh(res, "qwen2-7b", [3000, 1000, 57, 2000], 8192)
    fresh(res, "qwen2-7b", [1024] * 8, 8192)
    fresh(res, "qwen2-0.5b", [2048] * 4, 8192)
    for shape in ("qwen2-7b", "qwen2-0.5b"):
        prefix(res, shape, 1, 8192, 64)
        prefix(res, shape, 1, 8192, 64, pool_factor=8)
    prefix(res, "qwen2-7b", 8, 8192, 64)
    prefix(res, "qwen2-7b", 32, 1024, 1024)
    save_json(res, args.out)
    print(res)


if __name__ == "__main__":
    main()
