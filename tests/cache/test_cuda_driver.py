"""CudaDriver's ctypes plumbing on the CPU, over a stand-in for libcuda (tests.cache.fake_cuda)."""

from __future__ import annotations

import numpy as np
import pytest

from jhicache.cache.copier import CopyRows, CudaCopier, Direction
from jhicache.cache.cuda_driver import CudaDriver
from tests.cache.fake_cuda import FakeCudaLib


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one_call_per_copy"])
def test_copies_run_in_stream_order_once_an_event_after_them_is_waited_for(batch: bool) -> None:
    lib = FakeCudaLib(batch=batch)
    driver = CudaDriver(lib)
    assert driver.has_batch_copy is batch
    stream, event = driver.stream(), driver.event()
    src = np.random.default_rng(0).integers(0, 1 << 30, 64, dtype=np.int64)
    dst = np.zeros_like(src)
    addr = lambda a, i: a.ctypes.data + 8 * i  # noqa: E731
    # two runs of src into dst, then the first run again from a zeroed source: order matters
    blank = np.zeros(8, np.int64)
    dsts = np.array([addr(dst, 0), addr(dst, 40), addr(dst, 0)], np.uint64)
    srcs = np.array([addr(src, 0), addr(src, 40), blank.ctypes.data], np.uint64)
    sizes = np.array([8 * 16, 8 * 24, 8 * 8], np.uint64)
    driver.copy(dsts, srcs, sizes, stream, to_device=True)
    flag = np.zeros(2, np.int32)
    driver.write_value32(stream, flag.ctypes.data + 4, 7)
    assert not dst.any() and flag.tolist() == [0, 0]  # nothing ran: no wait yet
    driver.record(event, stream)
    driver.synchronize(event)
    expected = np.zeros_like(src)
    expected[8:16], expected[40:64] = src[8:16], src[40:64]
    np.testing.assert_array_equal(dst, expected)
    assert flag.tolist() == [0, 7]
    assert lib.copy_calls == (1 if batch else 3)


def test_a_stream_waits_for_another_streams_event() -> None:
    lib = FakeCudaLib()
    driver = CudaDriver(lib)
    first, second, event = driver.stream(), driver.stream(), driver.event()
    a = np.arange(4, dtype=np.int64)
    b, c = np.zeros_like(a), np.zeros_like(a)
    one = lambda x: np.array([x.ctypes.data], np.uint64)  # noqa: E731
    driver.copy(one(b), one(a), np.array([32], np.uint64), first, to_device=True)
    driver.record(event, first)
    driver.stream_wait(second, event)
    driver.copy(one(c), one(b), np.array([32], np.uint64), second, to_device=False)
    done = driver.event()
    driver.record(done, second)
    assert driver.query(done)
    np.testing.assert_array_equal(c, a)  # b was filled before c was copied from it


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one_call_per_copy"])
def test_copy_rows_queue_one_shards_row_from_addresses_prepared_once(batch: bool) -> None:
    """CopyRows (a load's layers): row r of shard s copies its own entries, and nothing else."""
    driver = CudaDriver(FakeCudaLib(batch=batch))
    copier = CudaCopier(driver)
    src = np.random.default_rng(1).integers(1, 1 << 30, 48, dtype=np.int64)
    dst = np.zeros_like(src)
    at = lambda a, i: a.ctypes.data + 8 * i  # noqa: E731
    # [2 shards, 3 rows, 2 copies of 2 int64s]; entry (s, r, c) moves elements 2 (6s + 2r + c)
    # and the one after: shard 1's row 1 is elements 16 to 19
    index = np.arange(12).reshape(2, 3, 2) * 2
    dsts = np.vectorize(lambda i: at(dst, int(i)))(index).astype(np.uint64)
    srcs = np.vectorize(lambda i: at(src, int(i)))(index).astype(np.uint64)
    rows = CopyRows(dsts, srcs, np.array([16, 16], np.uint64))
    copier.copy_row(Direction.TO_DEVICE, rows, 1, shard=1)
    copier.wait(copier.mark(Direction.TO_DEVICE))
    expected = np.zeros_like(src)
    expected[16:20] = src[16:20]
    np.testing.assert_array_equal(dst, expected)
    with pytest.raises(ValueError, match="rows, n"):
        CopyRows(dsts[0], srcs[0], rows.sizes)
