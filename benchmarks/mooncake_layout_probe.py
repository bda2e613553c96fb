"""Probe: a Mooncake Store's put and get rates for one page of a 7B-shaped host pool (28 layers'
K and V, 16 KB a piece: 917 KB a page) held three ways: one object from the page's 56 pieces
where the layer-first host layout keeps them (what MooncakeStorage does), one object from one
contiguous piece (a page-first layout), and one object a piece (several keys a page).

    PYTHONPATH=. python -m benchmarks.mooncake_layout_probe [--pages 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.mooncake_local import Master, StoreService

ROWS, PIECE = 56, 16384  # a page's pieces and their bytes
BATCH = 8  # pages a call (the storage tier's FETCH_CHUNK_PAGES)


def _rates(store, name: str, keys: list[str], src: list[list[int]], dst: list[list[int]],
           sizes: list[list[int]], total: int) -> dict[str, float]:
    """Puts then gets every key, `BATCH` pages' keys a call (as the storage tier's threads
    move pages: a call of thousands of pieces fails on Mooncake's TCP transport)."""
    step = max(len(keys) * BATCH // (total // (ROWS * PIECE)), 1)
    put_s = get_s = 0.0
    for i in range(0, len(keys), step):
        start = time.perf_counter()
        put = store.batch_put_from_multi_buffers(keys[i:i + step], src[i:i + step],
                                                 sizes[i:i + step])
        put_s += time.perf_counter() - start
        start = time.perf_counter()
        got = store.batch_get_into_multi_buffers(keys[i:i + step], dst[i:i + step],
                                                 sizes[i:i + step])
        get_s += time.perf_counter() - start
        if any(r != 0 for r in put) or any(r <= 0 for r in got):
            raise RuntimeError(f"{name}: put {set(put)}, get {set(got)}")
    return {f"{name}_put_bps": total / put_s, f"{name}_get_bps": total / get_s}


def probe(pages: int, directory: Path) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore

    total = pages * ROWS * PIECE
    master = Master(directory / "master.log", segment_bytes=0)
    master.start()
    service = StoreService(master, 3 * total + (256 << 20), directory)
    service.start()
    store = MooncakeDistributedStore()
    config = master.config
    try:
        if store.setup({"local_hostname": "127.0.0.1", "metadata_server": config["metadata_server"],
                        "global_segment_size": 0, "local_buffer_size": 16 << 20,
                        "protocol": "tcp", "master_server_addr": config["master_server_address"]}):
            raise RuntimeError("the probe's client did not start")
        src = np.random.default_rng(0).integers(0, 256, total, np.uint8)
        dst = np.zeros_like(src)
        for a in (src, dst):
            store.register_buffer(a.ctypes.data, a.nbytes)
        s, d = src.ctypes.data, dst.ctypes.data

        def layer_first(base: int, p: int) -> list[int]:  # row r of page p: (r * pages + p)
            return [base + (r * pages + p) * PIECE for r in range(ROWS)]

        result = _rates(store, "strided", [f"a/{p}" for p in range(pages)],
                        [layer_first(s, p) for p in range(pages)],
                        [layer_first(d, p) for p in range(pages)], [[PIECE] * ROWS] * pages,
                        total)
        result |= _rates(store, "contiguous", [f"b/{p}" for p in range(pages)],
                         [[s + p * ROWS * PIECE] for p in range(pages)],
                         [[d + p * ROWS * PIECE] for p in range(pages)],
                         [[ROWS * PIECE]] * pages, total)
        result |= _rates(store, "key_a_piece",
                         [f"c/{p}/{r}" for p in range(pages) for r in range(ROWS)],
                         [[a] for p in range(pages) for a in layer_first(s, p)],
                         [[a] for p in range(pages) for a in layer_first(d, p)],
                         [[PIECE]] * (pages * ROWS), total)
        if not np.array_equal(src, dst):
            raise RuntimeError("a layout read back other bytes than it wrote")
        return {"pages": pages, "page_bytes": ROWS * PIECE, **result}
    finally:
        store.close()
        service.stop()
        master.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        result = probe(args.pages, Path(directory))
    for key, value in result.items():
        print(f"{key}: {value / 1e9:.2f} GB/s" if key.endswith("_bps") else f"{key}: {value}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
