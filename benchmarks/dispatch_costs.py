"""Host time to dispatch the calls a layered load makes: one `device_put` per array vs one per list.

    PYTHONPATH=. python3 benchmarks/dispatch_costs.py

Prints median microseconds of host time per call (the copies themselves run asynchronously).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def host_us(fn, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return statistics.median(times) * 1e6


def main() -> None:
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    arrays = [jax.device_put(jnp.ones((2, 128, 64, 2, 64), jnp.bfloat16) * i, host)
              for i in range(8)]
    one = host_us(lambda: jax.device_put(arrays[0], device))
    each = host_us(lambda: [jax.device_put(a, device) for a in arrays])
    listed = host_us(lambda: jax.device_put(arrays, device))
    add = jax.jit(lambda x, y: x + y)
    x = jnp.ones((64, 896), jnp.bfloat16)
    jit_us = host_us(lambda: add(x, x))
    print(f"device_put one array: {one:.0f} us; 8 arrays one by one: {each:.0f} us; "
          f"8 arrays as one list: {listed:.0f} us; a small jit call: {jit_us:.0f} us")


def layer_loads(variant: str, layers: int = 24, pages: int = 128,
                pool_pages: int = 520) -> tuple[float, float]:
    """(host ms to dispatch, ms until done) of a 24-layer segment load: DMA then on-device
    scatter."""
    import functools

    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    shape = (2, pages, 64, 2, 64)
    staged_host = [jax.device_put(jnp.full(shape, i, jnp.bfloat16), host) for i in range(layers)]
    ks = [jnp.zeros((pool_pages, 64, 2, 64), jnp.bfloat16) for _ in range(layers)]
    vs = [jnp.zeros((pool_pages, 64, 2, 64), jnp.bfloat16) for _ in range(layers)]
    rows, ids = jnp.arange(pages), jnp.arange(pages) + 1
    donate = () if variant == "no-donate" else (0, 1)

    @functools.partial(jax.jit, donate_argnums=donate)
    def scatter(k, v, staged, rows, ids):
        return k.at[ids].set(staged[0, rows]), v.at[ids].set(staged[1, rows])

    def run():
        if variant == "all-first":
            staged = jax.device_put(staged_host, device)
        for l in range(layers):
            if variant == "all-first":
                s = staged[l]
            elif variant == "list":
                s = jax.device_put([staged_host[l]], device)[0]
            else:
                s = jax.device_put(staged_host[l], device)
            ks[l], vs[l] = scatter(ks[l], vs[l], s, rows, ids)
        return ks[-1]

    jax.block_until_ready(run())
    dispatch, done = [], []
    for _ in range(10):
        start = time.perf_counter()
        out = run()
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        done.append(time.perf_counter() - start)
    return statistics.median(dispatch) * 1e3, statistics.median(done) * 1e3


if __name__ == "__main__":
    main()
    for variant in ("single", "list", "no-donate", "all-first"):
        print(variant, "dispatch %.2f ms, done %.2f ms" % layer_loads(variant))
