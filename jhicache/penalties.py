"""TokenHistory: the tokens before each penalised request's next one, kept on the device (a row
per running request that needs one), and the programs that penalise its logits with them
(repetition, frequency and presence penalties, min_tokens) and count each sampled token in.

Where the counts live: a persistent [slots, vocab] int32 table on the device, `slots` being
`max_running_requests`, each running request that sets a penalty or `min_tokens` holding one
row while it runs. A row packs, per token id: whether the token is in the prompt (the
repetition penalty's set), whether it is a stop token (held back before `min_tokens`), and how
many times it was generated. A request's row is written whole from the host once, when its
first token is sampled (or again after a retraction gave its row up: the host then knows every
token), and each step adds its sampled tokens to the rows on the device (a scatter of one entry
per row), right after the sampler. So a step planned while the step before is still on the
device (overlap scheduling) penalises with that step's token already counted, with no round
trip, and a step's cost is one gather and elementwise pass over its [rows, vocab] logits. A step
none of whose requests penalises runs none of these programs. Rebuilding the counts each step
from the tokens instead would move every request's whole history to the device every step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.batch import Chunk
from jhicache.request import Request, RequestStatus

# A table entry's bits, per (row, token id)
PROMPT_BIT = 1  # the token is in the prompt
STOP_BIT = 2  # the token is one of the request's stop tokens
COUNT_UNIT = 4  # each time the token was generated adds this (the count is entry >> 2)
_COUNT_SHIFT = 2


class PenaltyRows(NamedTuple):
    """One step's penalty inputs: the table rows to write first, then per row of the logits its
    table row and penalties (a row with none: `slots` past the table, neutral penalties)."""

    writes: tuple[tuple[np.ndarray, np.ndarray], ...]  # (row index, [vocab] int32 entries)
    slots: np.ndarray  # [rows] int32: each logits row's table row (padded to the step's rows)
    repetition: np.ndarray  # [B] float32 (1: none)
    presence: np.ndarray  # [B] float32 (0: none)
    frequency: np.ndarray  # [B] float32 (0: none)
    hold_stops: np.ndarray  # [B] bool: fewer than min_tokens generated, stop tokens held back

    def packed(self) -> np.ndarray:
        """The arrays as one int32 array, what `penalize` and `count_sampled` take (one
        transfer: each separate one costs a dispatch of its own): `slots`, then the three
        penalties' float32 bits, then `hold_stops`."""
        floats = np.stack([self.repetition, self.presence, self.frequency]).view(np.int32)
        return np.concatenate([self.slots, floats.reshape(-1),
                               self.hold_stops.astype(np.int32)])


class TokenHistory:
    """The device table of the running penalised requests' tokens (see the module docstring)
    and which request holds which row. `table` is replaced by each program that writes it (they
    take it donated): the caller stores each new version back."""

    def __init__(self, slots: int, vocab: int, placement: jax.sharding.Sharding) -> None:
        # committed to `placement` (the logits'), as the programs' outputs that replace it are
        self.table = jax.device_put(np.zeros((slots, vocab), np.int32), placement)
        self.slots, self.vocab = slots, vocab
        self._held: dict[Request, int] = {}
        self._free = list(range(slots - 1, -1, -1))

    def step_rows(self, chunks: Sequence[Chunk], logits_rows: int,
                  rows: int) -> PenaltyRows | None:
        """The penalty inputs of a step of `chunks` (logits row i: chunk i's last token), its
        logits `logits_rows` rows and its sampled tokens `rows`; None when no chunk samples
        for a penalised request (the step then runs none of the penalty programs)."""
        if self._held:  # at once, so that an ended request is not kept alive here
            self._release_ended()
        if not any(c.samples_token and c.request.params.penalized for c in chunks):
            return None
        writes = []
        out = self.padding(logits_rows, rows)
        for i, chunk in enumerate(chunks):
            req, p = chunk.request, chunk.request.params
            if chunk.sample_index is None or not p.penalized:
                continue
            slot = self._held.get(req)
            if slot is None:
                slot = self._take(req)
                writes.append((np.asarray(slot, np.int32), self._entries(req)))
            out.slots[i] = slot
            out.repetition[i], out.presence[i] = p.repetition_penalty, p.presence_penalty
            out.frequency[i] = p.frequency_penalty
            out.hold_stops[i] = chunk.sample_index < p.min_tokens
        return out._replace(writes=tuple(writes))

    def padding(self, logits_rows: int, rows: int, write: bool = False) -> PenaltyRows:
        """Inputs that change nothing (every slot past the table), for `logits_rows` logits
        rows; with `write`, a row write that is dropped too (the warm-up's, to compile it)."""
        writes = ((np.asarray(self.slots, np.int32), np.zeros(self.vocab, np.int32)),)
        return PenaltyRows(writes if write else (), np.full(rows, self.slots, np.int32),
                           np.ones(logits_rows, np.float32), np.zeros(logits_rows, np.float32),
                           np.zeros(logits_rows, np.float32), np.zeros(logits_rows, np.bool_))

    def held(self) -> int:
        """Rows held by requests (those that ended included, until the next step)."""
        return len(self._held)

    def _release_ended(self) -> None:
        """Frees the rows of requests that finished or went back to the queue (retracted: a
        row written again when it runs again counts what it generated meanwhile)."""
        for req in [r for r in self._held if r.status in _ENDED]:
            self._free.append(self._held.pop(req))

    def _take(self, req: Request) -> int:
        if not self._free:
            raise RuntimeError(f"every one of the {self.slots} token-history rows is held by a "
                               f"running request: more running requests than "
                               f"max_running_requests")
        self._held[req] = slot = self._free.pop()
        return slot

    def _entries(self, req: Request) -> np.ndarray:
        """`req`'s row as the host knows it: its prompt, its generated tokens read so far (all
        but the one its step samples now: a row is written only when its request's tokens are
        all known), its stop tokens."""
        assert req.pending <= 1, "a row is written when its request's tokens are known"
        p, entries = req.params, np.zeros(self.vocab, np.int32)
        if p.repetition_penalty != 1:
            entries[np.asarray(req.tokens[:req.prompt_len], np.int64)] = PROMPT_BIT
        output = req.tokens[req.prompt_len:]
        if output:
            entries += COUNT_UNIT * np.bincount(output, minlength=self.vocab).astype(np.int32)
        if p.min_tokens and p.stop_token_ids:
            entries[np.asarray(p.stop_token_ids, np.int64)] |= STOP_BIT
        return entries


_ENDED = (RequestStatus.FINISHED, RequestStatus.WAITING)


@functools.partial(jax.jit, donate_argnums=0)
def write_row(table: jax.Array, slot: jax.Array, entries: jax.Array) -> jax.Array:
    """table[slot] = entries (a slot past the table: nothing)."""
    return table.at[slot].set(entries, mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def count_sampled(table: jax.Array, packed: jax.Array, sampled: jax.Array) -> jax.Array:
    """Counts each row's sampled token (`sampled` [rows]) in its table row (`PenaltyRows.packed`
    starts with the rows' `slots`; those past the table: nothing)."""
    return table.at[packed[:sampled.shape[0]], sampled].add(COUNT_UNIT, mode="drop")


@jax.jit
def penalize(
    logits: jax.Array,  # [B, vocab] float32, the model's
    table: jax.Array,  # [slots, vocab] int32
    packed: jax.Array,  # [rows + 4B] int32: `PenaltyRows.packed`
) -> jax.Array:  # [B, vocab] float32
    """The penalised logits, in the order vLLM applies them: a token of the prompt or the
    output has a positive logit divided by the repetition penalty and a negative one
    multiplied by it (Hugging Face's `RepetitionPenaltyLogitsProcessor`); a token generated c
    times loses frequency * c + presence * (c > 0) (OpenAI's definition); a stop token of a
    row that holds them back gets -inf. Elementwise over the rows' table entries."""
    rows = logits.shape[0]
    slots, rest = packed[:-4 * rows], packed[-4 * rows:].reshape(4, rows)
    repetition, presence, frequency = jax.lax.bitcast_convert_type(rest[:3], jnp.float32)
    hold_stops = rest[3] != 0
    history = jnp.take(table, slots[:rows], axis=0, mode="fill", fill_value=0)
    count = history >> _COUNT_SHIFT
    seen = ((history & PROMPT_BIT) != 0) | (count > 0)
    factor = repetition[:, None]
    out = jnp.where(seen, jnp.where(logits < 0, logits * factor, logits / factor), logits)
    out = (out - frequency[:, None] * count.astype(jnp.float32)
           - presence[:, None] * (count > 0).astype(jnp.float32))
    return jnp.where(hold_stops[:, None] & ((history & STOP_BIT) != 0), -jnp.inf, out)
