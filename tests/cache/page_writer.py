"""A storage tier's writer in a process of its own, for tests that kill it mid-write: it stores
page after page, each under `key(i)` with the bytes `page_bytes(i)`, and prints i once page i
is stored, until it is killed.

    python -m tests.cache.page_writer file DIR
    python -m tests.cache.page_writer mooncake CONFIG_JSON
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jhicache.cache import HostPool, PoolLayout
from jhicache.cache.storage import Storage, StorageNamespace

# 2 MB pages: a put takes long enough that a kill lands inside one
LAYOUT = PoolLayout(4, 2, 16, 64, 64, jnp.float32)
NAMESPACE = StorageNamespace(model="killed-writer", dtype="float32", page_size=16,
                             layout="test", page_bytes=LAYOUT.page_bytes)


def key(i: int) -> bytes:
    return hashlib.sha256(f"page {i}".encode()).digest()


@functools.cache
def _random_page() -> np.ndarray:
    page = np.random.default_rng(0).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    page.flags.writeable = False  # made once, shared by every call
    return page


def page_bytes(i: int) -> np.ndarray:
    """Page i's bytes: one random page, each byte XOR-ed with i's own value (cheap to make, and
    no two of the first 256 pages alike)."""
    return _random_page() ^ np.uint8(i % 256)


def fill(pool: HostPool, page: int, data: np.ndarray) -> None:
    start = 0
    for view in pool.page_views(page):  # strided uint8 views of the pool
        view[...] = data[start:start + view.size].reshape(view.shape)
        start += view.size


def read(pool: HostPool, page: int) -> np.ndarray:
    return np.concatenate([v.ravel() for v in pool.page_views(page)])


def open_storage(backend: str, where: str, pool: HostPool) -> Storage:
    if backend == "file":
        from jhicache.cache.file_storage import FileStorage

        return FileStorage(Path(where), NAMESPACE, pool.page_views)
    from jhicache.cache.mooncake_storage import MooncakeStorage

    return MooncakeStorage(NAMESPACE, pool.page_views, json.loads(where))


def main(backend: str, where: str) -> None:
    pool = HostPool(LAYOUT)
    storage = open_storage(backend, where, pool)
    for i in itertools.count():
        fill(pool, i % 2, page_bytes(i))
        if storage.set([key(i)], [i % 2]) != 1:
            raise SystemExit(f"page {i} was not stored")
        print(i, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
