"""Three ways to hand a stack of Qwen2 layers' projection weights to one jitted program, timed
on the device and on the host: the question is whether fewer, larger weight arrays would cut the
forward's dispatch cost (`dispatch_probe.py`) without costing GPU time.

    PYTHONPATH=. python3 benchmarks/weight_layout_probe.py [--preset qwen2-7b] [--layers 8]
        [--tokens 64] --out FILE.json

Each program runs, per layer, the matmuls of Qwen2's projections on `--tokens` rows (no
attention, norms or biases: only the weight reads the layouts differ in):
- `separate`: q, k, v, o, gate, up and down as arrays of their own per layer, as the engine holds
  them (7 arrays a layer);
- `merged`: q, k and v as one [hidden, q + k + v] array and gate with up as one (4 a layer),
  as vLLM's merged linear layers hold them;
- `stacked`: each of the seven stacked over the layers ([layers, in, out]; 7 arrays in all), a
  layer's weight taken by a static index inside the program.
Per layout: the GPU time of one call (`back_to_back_ms`: 10 calls dispatched back to back,
host hidden), the host time of a dispatch (`dispatch_us`, median, device idle), and the weight
bytes read per call over the GPU time. A layout whose GPU time grows reads its weights more than
once (a copy of a slice, or of a concatenation). Run it a second time with
`XLA_FLAGS=--xla_disable_hlo_passes=dot-merger` to see whether XLA's merging of the separate
q/k/v matmuls costs a concatenation each call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jhicache.models.presets import PRESETS

from benchmarks.kernels.timing import dispatch_us
from jhicache.bench.command import save_json


def shapes(config: Any) -> dict[str, tuple[int, int]]:
    """[in, out] of each projection of one layer."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, inter),
            "up": (h, inter), "down": (inter, h)}


def layer_forward(x: jax.Array, w: Callable[[str], jax.Array], merged: bool) -> jax.Array:
    """The projections' matmuls of one layer, shaped as Qwen2's (`w(name)` gives a weight;
    `merged`: q/k/v as one "qkv" weight and gate/up as one "gate_up"). Every product feeds the
    output, so that none is dropped as dead code."""
    if merged:
        qkv = x @ w("qkv")
        q_cols = w("o").shape[0]
        kv_cols = (qkv.shape[1] - q_cols) // 2
        q, k, v = jnp.split(qkv, [q_cols, q_cols + kv_cols], axis=-1)
        gate, up = jnp.split(x @ w("gate_up"), 2, axis=-1)
    else:
        q, k, v = x @ w("q"), x @ w("k"), x @ w("v")
        gate, up = x @ w("gate"), x @ w("up")
    x = x + q @ w("o") + k.mean(axis=-1, keepdims=True) + v.mean(axis=-1, keepdims=True)
    return x + (jax.nn.silu(gate) * up) @ w("down")


def program(layout: str, layers: int) -> Callable[..., jax.Array]:
    """The jitted stack of `layers` layers over weights held as `layout` says."""
    def run(x: jax.Array, weights: Any) -> jax.Array:
        for i in range(layers):
            if layout == "stacked":
                x = layer_forward(x, lambda n, i=i: weights[n][i], merged=False)
            else:
                x = layer_forward(x, lambda n, i=i: weights[i][n], merged=layout == "merged")
        return x
    return jax.jit(run)


def make_weights(layout: str, config: Any, layers: int, key: jax.Array) -> Any:
    """Random bf16 weights of `layers` layers, held as `layout` says."""
    dims = shapes(config)
    per_layer = []
    for i in range(layers):
        keys = jax.random.split(jax.random.fold_in(key, i), len(dims))
        w = {n: (jax.random.normal(k, s, jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
             for k, (n, s) in zip(keys, dims.items())}
        if layout == "merged":
            w = {"qkv": jnp.concatenate([w["q"], w["k"], w["v"]], axis=1), "o": w["o"],
                 "gate_up": jnp.concatenate([w["gate"], w["up"]], axis=1), "down": w["down"]}
        per_layer.append(w)
    if layout == "stacked":
        return {n: jnp.stack([w[n] for w in per_layer]) for n in dims}
    return per_layer


def measure(layout: str, config: Any, layers: int, tokens: int) -> dict[str, Any]:
    weights = make_weights(layout, config, layers, jax.random.key(0))
    fn = program(layout, layers)
    x = jnp.ones((tokens, config.hidden_size), jnp.bfloat16) * 0.01
    call = lambda: fn(x, weights)  # noqa: E731
    jax.block_until_ready(call())  # compiles
    start = time.perf_counter()
    jax.block_until_ready([call() for _ in range(10)])
    gpu_ms = (time.perf_counter() - start) / 10 * 1e3
    nbytes = sum(a.nbytes for a in jax.tree.leaves(weights))
    return {"layout": layout, "arrays": len(jax.tree.leaves(weights)),
            "back_to_back_ms": gpu_ms, "dispatch_us": dispatch_us(call),
            "weight_bytes": nbytes, "weight_read_gbps": nbytes / gpu_ms / 1e6,
            "output_checksum": float(jnp.sum(call().astype(jnp.float32)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-7b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = PRESETS[args.preset]
    rows = [measure(layout, config, args.layers, args.tokens)
            for layout in ("separate", "merged", "stacked")]
    for row in rows:
        print(row, flush=True)
    save_json({"device": str(jax.devices()[0]), "jax": jax.__version__, "preset": args.preset,
               "layers": args.layers, "tokens": args.tokens, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
