"""Probe: host-to-device and device-to-host copy rates of one 7B-shaped 8k load (128 pages of 64
tokens, 28 layers, K and V of 4 heads x 128) from a pinned host pool laid out two ways, through
the driver path the host tier uses (one cuMemcpyBatchAsync per layer, on a stream of ours):
layer-first (today's pool: a layer's run of 128 consecutive pages is one contiguous piece for K
and one for V, 2 copies a layer) and page-first (a page's 28 layers contiguous, so a layer's
K of a page is its own 64 KB piece, 256 copies a layer). Page-first is what a zero-copy store
(Mooncake's get into the pool) wants; this says what it costs the layer-wise load.

    PYTHONPATH=. python -m benchmarks.host_layout_probe [--pages 128] [--trials 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.cache.cuda_driver import CudaDriver, load_library
from jhicache.cache.host_memory import HostMemory

LAYERS, PAGE_TOKENS, KV_HEADS, HEAD_DIM, ITEM = 28, 64, 4, 128, 2
PIECE = PAGE_TOKENS * KV_HEADS * HEAD_DIM * ITEM  # a page's K (or V) of one layer: 64 KB


Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # host addresses, device addresses, sizes


def _plans(pages: int, host: int, device: int) -> dict[str, list[Batch]]:
    """Per layout, one (host addresses, device addresses, sizes) batch a layer. The device side
    is the pool's layer-first [layer][K|V][pages] in both; only the host side differs."""
    run = pages * PIECE
    dev = lambda layer, kv: device + (layer * 2 + kv) * run  # noqa: E731
    layer_first: list[Batch] = []
    page_first: list[Batch] = []
    for layer in range(LAYERS):
        layer_first.append((np.array([host + (layer * 2 + kv) * run for kv in (0, 1)], np.uint64),
                            np.array([dev(layer, kv) for kv in (0, 1)], np.uint64),
                            np.full(2, run, np.uint64)))
        page = np.arange(pages, dtype=np.uint64)
        srcs = [host + page * (LAYERS * 2 * PIECE) + (layer * 2 + kv) * PIECE for kv in (0, 1)]
        dsts = [dev(layer, kv) + page * PIECE for kv in (0, 1)]
        page_first.append((np.concatenate(srcs), np.concatenate(dsts),
                           np.full(2 * pages, PIECE, np.uint64)))
    return {"layer_first": layer_first, "page_first": page_first}


def _time(driver: CudaDriver, stream: int, plan, to_device: bool) -> float:
    """Seconds between events around the whole load's copies, layer by layer as the tier issues
    them."""
    start, end = driver.event(timing=True), driver.event(timing=True)
    driver.record(start, stream)
    for host_addr, dev_addr, sizes in plan:
        if to_device:
            driver.copy(dev_addr, host_addr, sizes, stream, to_device=True)
        else:
            driver.copy(host_addr, dev_addr, sizes, stream, to_device=False)
    driver.record(end, stream)
    driver.synchronize(end)
    return driver.elapsed_ms(start, end) / 1e3


def probe(pages: int, trials: int) -> dict:
    lib = load_library()
    if lib is None:
        raise SystemExit("no CUDA driver: this probe needs an NVIDIA GPU")
    total = LAYERS * 2 * pages * PIECE
    pool = jnp.zeros((total,), jnp.uint8, device=jax.devices()[0])
    pool.block_until_ready()
    driver = CudaDriver(lib)
    host = HostMemory(total, driver)
    host.array[:] = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    stream = driver.stream()
    device = pool.unsafe_buffer_pointer()
    out: dict = {"pages": pages, "bytes": total, "device": str(jax.devices()[0].device_kind)}
    for name, plan in _plans(pages, host.address, device).items():
        for direction, to_device in (("h2d", True), ("d2h", False)):
            _time(driver, stream, plan, to_device)  # first use: not timed
            seconds = [_time(driver, stream, plan, to_device) for _ in range(trials)]
            out[f"{name}_{direction}_s"] = seconds
            out[f"{name}_{direction}_best_gbps"] = total / min(seconds) / 1e9
            print(f"{name:11s} {direction}: best {min(seconds) * 1e3:.2f} ms "
                  f"({total / min(seconds) / 1e9:.1f} GB/s), trials "
                  + " ".join(f"{s * 1e3:.2f}" for s in seconds), flush=True)
    # the page-first plan moved every byte where layer-first's did: check one round trip
    _time(driver, stream, _plans(pages, host.address, device)["page_first"], True)
    back = np.asarray(jax.device_get(pool))
    shuffled = host.array.reshape(pages, LAYERS, 2, PIECE).transpose(1, 2, 0, 3).reshape(-1)
    out["page_first_bytes_equal"] = bool(np.array_equal(back, shuffled))
    print(f"page-first load lands in layer-first order: {out['page_first_bytes_equal']}")
    host.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = probe(args.pages, args.trials)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
