"""How fast this machine's disk gives back files the size of a 7B page, by way of reading:
buffered reads (as `FileStorage` reads today) and O_DIRECT reads, each by 1 to 32 threads, and
buffered reads after one thread has asked the kernel to read every file ahead
(POSIX_FADV_WILLNEED). The page cache is dropped before each way (fsync, then
POSIX_FADV_DONTNEED: no root needed).

    python benchmarks/disk_read_probe.py --dir DIR [--files 512] [--file-bytes N] --out probe.json

Tells whether the storage tier's reads could go past the rate its bench measures as the disk's
ceiling (one file, then 8 at once, buffered).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.storage_hit import drop_page_cache

# A 7B page: 64 tokens x 28 layers x (K, V) x 4 KV heads x 128 x 2 bytes (bf16)
PAGE_BYTES = 64 * 28 * 2 * 4 * 128 * 2
THREADS = (1, 8, 16, 32)
ALIGN = 4096  # O_DIRECT: buffer, offset and length aligned to the logical block (<= 4 KiB)


def write_files(directory: Path, count: int, nbytes: int) -> list[Path]:
    data = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).tobytes()
    paths = [directory / f"page-{i:05d}" for i in range(count)]
    for path in paths:
        path.write_bytes(data)
    return paths


def buffered_reader(nbytes: int) -> Callable[[Path], int]:
    def read(path: Path) -> int:
        buffer = bytearray(nbytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
    return read


def direct_reader(nbytes: int) -> Callable[[Path], int]:
    rounded = -(-nbytes // ALIGN) * ALIGN

    def read(path: Path) -> int:
        buffer = mmap.mmap(-1, rounded)  # page aligned
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
            buffer.close()
    return read


def read_all(paths: list[Path], read: Callable[[Path], int], threads: int) -> float:
    """Bytes per second reading every file, `threads` files at a time."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - start)


def will_need_then_read(paths: list[Path], nbytes: int, threads: int) -> float:
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(buffered_reader(nbytes), paths))
    return total / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, help="a directory on the disk to probe")
    p.add_argument("--files", type=int, default=512)
    p.add_argument("--file-bytes", type=int, default=PAGE_BYTES)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        paths = write_files(Path(directory), args.files, args.file_bytes)
        for threads in THREADS:
            for name, reader in (("buffered", buffered_reader), ("direct", direct_reader)):
                drop_page_cache(Path(directory))
                rates[f"{name}_{threads}_threads"] = read_all(paths, reader(args.file_bytes),
                                                              threads)
            drop_page_cache(Path(directory))
            rates[f"will_need_{threads}_threads"] = will_need_then_read(
                paths, args.file_bytes, threads)
        rates["page_cache_8_threads"] = read_all(paths, buffered_reader(args.file_bytes), 8)
    result = {"files": args.files, "file_bytes": args.file_bytes, "bytes_per_second": rates}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, rate in rates.items():
        print(f"{name:>24}: {rate / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
