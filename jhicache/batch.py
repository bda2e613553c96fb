"""Batch: the host-side plan of one forward step, and its inputs padded to a grid shape."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jhicache.cache import LoadTicket
from jhicache.grid import ShapeGrid, StepShape
from jhicache.models import AttentionMetadata, metadata_arrays, pack_token_array, put_int32
from jhicache.request import Request


@dataclasses.dataclass(frozen=True)
class Chunk:
    """`length` tokens of `request.tokens` starting at `start` are computed this step."""

    request: Request
    start: int
    length: int
    sample_index: int | None = None  # the output token its last logits sample; None: no sample

    @property
    def samples_token(self) -> bool:
        """True when the chunk reaches the end of the sequence (a prompt's last prefill chunk, or
        a decode step), so its last logits sample the request's next token."""
        return self.sample_index is not None


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step: the chunks to compute, whether it is decode-only, and a load-back to wait on."""

    chunks: list[Chunk]
    is_decode: bool
    tickets: tuple[LoadTicket, ...] = ()  # load-backs whose pages this step reads

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class StepInputs(NamedTuple):
    tokens: jax.Array  # [T] int32, pending tokens not yet patched in (see `patches`)
    meta: AttentionMetadata
    last_index: jax.Array  # [B] int32: the token row whose logits each request samples
    patches: tuple[jax.Array, jax.Array] | None  # (token rows, rows of the previous step's
    # sampled tokens) for tokens the host has not read yet; None when there are none
    shape: StepShape  # the grid shape the step is padded to


def model_inputs(batch: Batch, grid: ShapeGrid, load_flags: jax.Array | None = None,
                 gate: int = 0) -> StepInputs:
    """Token ids, attention metadata and sampled rows of one step, padded to its grid shape.

    A decode row whose input token is still pending (sampled by the step in flight, see
    `Request.pending`) reads it on the device: `patches` pairs the row with the request's row in
    that step's sampled tokens. With `load_flags` (the device pool's, when there is a host
    tier) the forward waits on the device for the batch's load-backs: the metadata carries the
    flags and `gate`, the sequence number they must reach (`TransferStep.start_loads`). No
    transfer work happens here."""
    chunks = batch.chunks
    shape = grid.shape_for(batch.num_tokens, len(chunks), batch.is_decode)
    lengths = [c.length for c in chunks]
    arrays = metadata_arrays(
        [c.start for c in chunks], lengths, [c.request.device_pages for c in chunks],
        page_size=grid.page_size, num_tokens=shape.tokens, num_reqs=shape.requests,
        max_pages=grid.page_width, decode_only=batch.is_decode,
    )
    tokens = pack_token_array([c.request.token_slice(c.start, c.start + c.length) for c in chunks],
                              shape.tokens)
    last_index = np.zeros(shape.requests, np.int32)
    last_index[: len(chunks)] = np.cumsum(lengths) - 1
    return _put(arrays, tokens, last_index, _patch_arrays(chunks, last_index, shape.tokens),
                load_flags, gate, shape)


def padding_inputs(shape: StepShape, grid: ShapeGrid, load_flags: jax.Array | None,
                   patched: bool) -> StepInputs:
    """The inputs of a step of `shape` with no request in it (every row padding; with
    `patched`, patch rows that all fall outside it): what a warm-up dispatches, through the
    same transfer and programs as a real step of that shape."""
    arrays = metadata_arrays([], [], [], page_size=grid.page_size, num_tokens=shape.tokens,
                             num_reqs=shape.requests, max_pages=grid.page_width,
                             decode_only=shape.decode)
    last_index = np.zeros(shape.requests, np.int32)
    patches = ({"patch_rows": np.full(shape.requests, shape.tokens, np.int32),
                "patch_from": np.zeros(shape.requests, np.int32)} if patched else {})
    return _put(arrays, np.zeros(shape.tokens, np.int32), last_index, patches, load_flags, 0,
                shape)


def _put(arrays: dict[str, np.ndarray], tokens: np.ndarray, last_index: np.ndarray,
         patches: dict[str, np.ndarray], load_flags: jax.Array | None, seq: int,
         shape: StepShape) -> StepInputs:
    host = {**arrays, "tokens": tokens, "last_index": last_index, **patches}
    if load_flags is not None:
        host["load_seq"] = np.array([seq], np.int32)
    # The step's host arrays in one transfer (see put_int32): each separate transfer costs
    # a dispatch of its own, host time that every step pays.
    put = put_int32(host)
    on_device, rows = put.pop("tokens"), put.pop("last_index")
    patch = (put.pop("patch_rows"), put.pop("patch_from")) if "patch_rows" in put else None
    meta = AttentionMetadata(**put, load_flags=load_flags, decode_only=shape.decode)
    return StepInputs(on_device, meta, rows, patch, shape)


def _patch_arrays(chunks: list[Chunk], last_index: np.ndarray,
                  num_tokens: int) -> dict[str, np.ndarray]:
    """Rows whose input token is pending: only a chunk's last token can be (a decode token)."""
    rows = [(i, c.request.pending_row) for i, c in enumerate(chunks)
            if c.start + c.length > c.request.known_len]
    if not rows:
        return {}
    assert all(chunks[i].start + chunks[i].length == chunks[i].request.known_len + 1
               for i, _ in rows)
    patch_rows = np.full(len(last_index), num_tokens, np.int32)  # out of range: dropped
    patch_from = np.zeros(len(last_index), np.int32)
    for k, (i, row) in enumerate(rows):
        patch_rows[k], patch_from[k] = last_index[i], row
    return {"patch_rows": patch_rows, "patch_from": patch_from}


@jax.jit
def patch_tokens(tokens: jax.Array, rows: jax.Array, source_rows: jax.Array,
                 sampled: jax.Array) -> jax.Array:
    """tokens[rows] = sampled[source_rows]: pending tokens fed from the previous step's samples
    without a round trip through the host (out-of-range rows are padding)."""
    return tokens.at[rows].set(sampled[source_rows], mode="drop")
