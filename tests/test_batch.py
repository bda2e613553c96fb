"""Batch inputs: the vectorised metadata layout and the packed transfer match a per-request
reference."""

from __future__ import annotations

import numpy as np
import pytest
from jhicache.models import metadata_arrays, put_int32

from jhicache.batch import Batch, Chunk, model_inputs
from jhicache.grid import ShapeGrid, StepShape
from jhicache.request import Request
from jhicache.sampling import SamplingParams


def reference_layout(prefix_lens, new_lens, page_ids, num_tokens, num_reqs,
                     max_pages) -> dict[str, np.ndarray]:
    """The layout one request at a time (the loop `_layout` replaced)."""
    out = dict(positions=np.zeros(num_tokens, np.int32),
               token_req=np.full(num_tokens, -1, np.int32),
               page_table=np.zeros((num_reqs, max_pages), np.int32),
               seq_lens=np.zeros(num_reqs, np.int32),
               query_start=np.full(num_reqs, sum(new_lens), np.int32),
               query_lens=np.zeros(num_reqs, np.int32))
    start = 0
    for b, (pre, new, pages) in enumerate(zip(prefix_lens, new_lens, page_ids)):
        out["positions"][start:start + new] = np.arange(pre, pre + new)
        out["token_req"][start:start + new] = b
        out["page_table"][b, :len(pages)] = pages
        out["seq_lens"][b], out["query_lens"][b], out["query_start"][b] = pre + new, new, start
        start += new
    return out


@pytest.mark.parametrize("seed", range(5))
def test_metadata_arrays_match_the_per_request_layout(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_size, count = 4, int(rng.integers(1, 6))
    prefix = [int(x) for x in rng.integers(0, 20, count)]
    new = [int(x) for x in rng.integers(1, 9, count)]
    pages = [[int(p) for p in rng.integers(1, 100, -(-(a + b) // page_size))]
             for a, b in zip(prefix, new)]
    sizes = dict(num_tokens=sum(new) + 3, num_reqs=count + 2, max_pages=max(map(len, pages)) + 1)
    got = metadata_arrays(prefix, new, pages, page_size=page_size, **sizes)
    want = reference_layout(prefix, new, pages, **sizes)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == np.int32, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_put_int32_keeps_names_shapes_and_values() -> None:
    arrays = {"b": np.arange(6, dtype=np.int32).reshape(2, 3), "a": np.array([-1, 7], np.int32),
              "c": np.zeros((0,), np.int32)}
    put = put_int32(arrays)
    assert put.keys() == arrays.keys()
    for name, value in arrays.items():
        assert put[name].shape == value.shape and put[name].dtype == np.int32
        np.testing.assert_array_equal(np.asarray(put[name]), value)


def test_token_slice_equals_slicing_tokens_and_reads_pending_tokens_as_zero() -> None:
    req = Request(request_id="a", tokens=list(range(10)), params=SamplingParams(), arrival_s=0.0)
    for token in (50, 51, 52):
        req.add_output(token)
    assert (req.prompt_len, req.output, req.num_output) == (10, [50, 51, 52], 3)
    req.pending = 2  # two sampled tokens the host has not read yet
    for start in range(req.num_tokens + 1):
        for end in range(start, req.num_tokens + 1):
            want = req.tokens[start:end] + [0] * max(0, end - max(start, len(req.tokens)))
            assert req.token_slice(start, end) == want
    assert req.num_tokens == len(req.tokens) + 2 == 15


def test_model_inputs_of_a_mixed_prefill() -> None:
    a = Request(request_id="a", tokens=[5, 6, 7, 8, 9], params=SamplingParams(), arrival_s=0.0,
                device_pages=[3, 4])
    b = Request(request_id="b", tokens=[1, 2], params=SamplingParams(), arrival_s=0.0,
                device_pages=[9])
    b.add_output(3)
    grid = ShapeGrid.create(chunked_prefill_tokens=64, max_running_requests=8, page_size=4,
                            max_context_len=20)
    tokens, meta, last_index, patches, shape = model_inputs(
        Batch([Chunk(a, 1, 4), Chunk(b, 2, 1)], is_decode=False), grid)
    assert patches is None and shape == StepShape(64, 4, False)
    np.testing.assert_array_equal(np.asarray(tokens), [6, 7, 8, 9, 3] + [0] * 59)
    np.testing.assert_array_equal(np.asarray(last_index), [3, 4, 0, 0])
    np.testing.assert_array_equal(np.asarray(meta.positions)[:5], [1, 2, 3, 4, 2])
    np.testing.assert_array_equal(np.asarray(meta.page_table),  # the grid's width: 20 tokens
                                  [[3, 4, 0, 0, 0], [9, 0, 0, 0, 0]] + [[0] * 5] * 2)
    np.testing.assert_array_equal(np.asarray(meta.seq_lens), [5, 3, 0, 0])
    assert not meta.decode_only


def test_put_int32_rejects_what_int32_cannot_hold() -> None:
    with pytest.raises(ValueError, match="int32 range"):
        put_int32({"ids": np.array([2**31 + 5], np.int64)})
    with pytest.raises(ValueError, match="int32 range"):
        put_int32({"ids": np.array([1.5])})
    assert put_int32({}) == {}
