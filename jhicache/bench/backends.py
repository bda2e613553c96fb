"""Backend: where the multi-turn bench clients send a turn and how its answer streams back; the
in-process one (AsyncEngine) is here, the HTTP one in remote (it needs aiohttp)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from jhicache.async_engine import AsyncEngine
from jhicache.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of a streamed answer, as the client receives it."""

    new_token_ids: tuple[int, ...]  # the tokens this piece adds
    token_ids: tuple[int, ...]  # every token so far
    finished: bool
    prompt_len: int
    device_hit_tokens: int
    host_hit_tokens: int
    engine_ttft_s: float | None  # the engine's own TTFT, where the backend can see it
    storage_hit_tokens: int = 0
    server_ttft_s: float | None = None  # a server's own TTFT, where it says it


class Backend(Protocol):
    """What the clients need of a serving engine."""

    def together(self) -> contextlib.AbstractContextManager[None]:
        """Requests started inside reach the engine as one batch, where the backend can say so."""
        ...

    def stream(self, prompt: Sequence[int], params: SamplingParams,
               request_id: str) -> AsyncIterator[Chunk]:
        """The answer to one prompt, piece by piece; the last piece has `finished`."""
        ...


class EngineBackend:
    """The turns go to an AsyncEngine in this process, as a server would hand them over."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def together(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.together()

    async def stream(self, prompt: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        tokens: tuple[int, ...] = ()  # the stream's outputs carry each step's new ones alone
        async for out in self.engine.stream(prompt, params, request_id=request_id):
            tokens += tuple(out.new_token_ids)
            yield Chunk(tuple(out.new_token_ids), tokens, out.finished,
                        out.prompt_len, out.device_hit_tokens, out.host_hit_tokens, out.ttft_s,
                        out.storage_hit_tokens)


class ServerError(RuntimeError):
    """A server could not be reached, refused a request, or sent what its API does not."""
