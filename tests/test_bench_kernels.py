"""`python -m jhicache.bench kernels`: the write-back gather comparison, at a tiny CPU size."""

from __future__ import annotations

from jhicache import bench_kernels


def test_gathers_compare_the_same_staging_three_ways() -> None:
    res: dict = {}
    bench_kernels.gathers(res, "tiny", layers=2, kv_heads=2, dim=8, pages=6, pool_pages=32)
    row = res["write_back_gather"]["tiny"]
    assert row["same_staging"] is True
    assert row["bytes_read_and_written"] == 2 * 2 * 2 * 6 * bench_kernels.PAGE * 2 * 8 * 2
    for way in ("xla_gather", "pallas_per_layer", "pallas_one_launch"):
        assert row[f"{way}_ms"] > 0 and row[f"{way}_gbps"] > 0
