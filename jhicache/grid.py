"""ShapeGrid: the bounded set of step shapes an engine runs, fixed by its config at start.

Every forward the engine dispatches is padded to one of these shapes, so the programs it can
run are known before it serves and `Engine.warmup` compiles them all. A shape is (tokens,
requests, decode or not); every shape's page table has the same width, the pages of the
longest request the grid admits, since the attention kernels walk each request's own pages and
a wider table costs only its bytes. The ladders, as SGLang's and vLLM's captured sizes do,
grow with the size so that padding stays a bounded fraction of a step:
- prefill tokens: 64, 128, 256, then steps of half the power of two below (384, 512, 768,
  1024, 1536, ...) up to `chunked_prefill_tokens`: less than a third of a padded step is
  padding above 256 tokens, where steps cost by their tokens. None is below 64 rows: up to
  there a step's matmuls read the weights once whatever its rows (memory-bound), and padding
  rows skip attention, so a smaller rung would cost a program and save nothing;
- prefill requests: powers of four (1, 4, 16, 64) up to `max_running_requests`: a prefill step
  is dominated by its tokens, and a padded request row costs a row of metadata and of logits;
- decode requests: powers of two from 4 up to `max_running_requests`: a decode step reads the
  weights once whatever its rows, so padding costs little beyond the rows' logits.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

SMALLEST_TOKENS = 64  # the fewest token rows a prefill pads to
SMALLEST_DECODE = 4  # the fewest request rows a decode pads to


class StepShape(NamedTuple):
    """One program shape: token rows, request rows, and whether it is a decode step (one token
    per request: then tokens == requests)."""

    tokens: int
    requests: int
    decode: bool

    def __str__(self) -> str:
        kind = "decode" if self.decode else "prefill"
        return f"{kind}(tokens={self.tokens}, requests={self.requests})"


def token_ladder(limit: int, smallest: int = SMALLEST_TOKENS) -> tuple[int, ...]:
    """Padded token counts up to `limit` (the last is `limit` rounded up to a multiple of 16,
    and at least `smallest`): powers of two up to 256, then each power of two and the half
    step above it."""
    top = max(-(-limit // 16) * 16, smallest)
    sizes, size = [], smallest
    while size < top:
        sizes.append(size)
        if size >= 256 and size + size // 2 < top:
            sizes.append(size + size // 2)
        size *= 2
    return tuple(sizes) + (top,)


def request_ladder(limit: int, smallest: int, factor: int) -> tuple[int, ...]:
    """Padded request counts up to `limit` (always its last rung): `smallest` times powers of
    `factor`."""
    sizes, size = [], min(smallest, limit)
    while size < limit:
        sizes.append(size)
        size *= factor
    return tuple(sizes) + (limit,)


def _up(ladder: tuple[int, ...], n: int, what: str) -> int:
    for size in ladder:
        if size >= n:
            return size
    raise ValueError(f"{n} {what} exceed the grid's largest step ({ladder[-1]})")


@dataclasses.dataclass(frozen=True)
class ShapeGrid:
    """The step shapes of one engine. `page_width`: page-table columns (the pages of
    `max_context_len` tokens), the same in every shape."""

    prefill_tokens: tuple[int, ...]
    prefill_requests: tuple[int, ...]
    decode_requests: tuple[int, ...]
    page_size: int
    max_context_len: int

    @classmethod
    def create(cls, *, chunked_prefill_tokens: int, max_running_requests: int, page_size: int,
               max_context_len: int) -> ShapeGrid:
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be at least 1, got {max_context_len}")
        return cls(prefill_tokens=token_ladder(chunked_prefill_tokens),
                   prefill_requests=request_ladder(max_running_requests, 1, 4),
                   decode_requests=request_ladder(max_running_requests, SMALLEST_DECODE, 2),
                   page_size=page_size, max_context_len=max_context_len)

    @property
    def page_width(self) -> int:
        return -(-self.max_context_len // self.page_size)

    @property
    def max_requests(self) -> int:
        """The most request rows of any shape (sampled tokens are padded to it)."""
        return max(self.prefill_requests[-1], self.decode_requests[-1])

    def shape_for(self, num_tokens: int, num_requests: int, decode: bool) -> StepShape:
        """The smallest shape that holds a step of `num_requests` requests computing
        `num_tokens` tokens in all; ValueError if none does."""
        if decode:
            rows = _up(self.decode_requests, num_requests, "decoding requests")
            return StepShape(rows, rows, True)
        return StepShape(_up(self.prefill_tokens, num_tokens, "prefill tokens"),
                         _up(self.prefill_requests, num_requests, "prefill requests"), False)

    def shapes(self) -> tuple[StepShape, ...]:
        """Every shape a step can take: each prefill pair that some step maps to (no more
        requests than tokens), then the decode sizes."""
        prefill = []
        for tokens in self.prefill_tokens:
            for i, rows in enumerate(self.prefill_requests):
                fewest = self.prefill_requests[i - 1] + 1 if i else 1  # the fewest that pad here
                if fewest <= tokens:
                    prefill.append(StepShape(tokens, rows, False))
        return tuple(prefill) + tuple(StepShape(n, n, True) for n in self.decode_requests)

    def describe(self) -> dict[str, object]:
        """The grid as plain data: for logs, `Engine.grid` readers and /server_info."""
        return {"shapes": len(self.shapes()), "prefill_tokens": list(self.prefill_tokens),
                "prefill_requests": list(self.prefill_requests),
                "decode_requests": list(self.decode_requests), "page_width": self.page_width,
                "max_context_len": self.max_context_len}
