"""`python -m jhicache.bench kernels`: the write-back gather part, at a tiny CPU size."""

from __future__ import annotations

from jhicache import bench_kernels


def test_gathers_time_the_engines_staging_of_the_pages() -> None:
    res: dict = {}
    bench_kernels.gathers(res, "tiny", layers=2, kv_heads=2, dim=8, pages=6, pool_pages=32)
    row = res["write_back_gather"]["tiny"]
    assert row["staging_is_the_pages"] is True
    assert row["bytes_read_and_written"] == 2 * 2 * 2 * 6 * bench_kernels.PAGE * 2 * 8 * 2
    assert row["xla_gather_ms"] > 0 and row["xla_gather_gbps"] > 0
