"""The wire: the typed messages between an `AsyncEngine` and its engine loop (`engine_loop`),
msgspec structs tagged by type, passed as they are to a loop in a thread and as msgpack to
one in a child process (`engine_process`)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams
from jhicache.stats import EngineStats, Occupancy, StartupTimes

# ---- to the loop ----------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    """Queue these requests together, all or none (`Engine.add_requests`); with `final_only`,
    the loop sends each one's finished output alone, whole (`AsyncEngine.generate`)."""

    call: int
    ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    final_only: bool


class Abort(msgspec.Struct, tag=True):
    """Abort a request by id; the reply says whether the loop followed it."""

    call: int
    request_id: str


class Cancel(msgspec.Struct, tag=True):
    """The consumer is gone: abort without a reply."""

    request_id: str


QueryName = Literal["stats", "occupancy", "startup", "compiles", "flush_cache", "clear_storage",
                    "check_invariants"]
ANSWERED_WARMING: frozenset[QueryName] = frozenset({"stats", "occupancy", "startup",
                                                    "compiles"})  # while a warm-up runs


class Query(msgspec.Struct, tag=True):
    """An engine call with a reply (its kind: `Answer`'s fields)."""

    call: int
    name: QueryName


class SetStorage(msgspec.Struct, tag=True):
    """`Engine.set_storage(backend, storage_dir, backend_config, timeout_s)`, between steps;
    the reply's `config` is the engine's config as it is then."""

    call: int
    backend: str | None
    storage_dir: str | None = None
    backend_config: str | None = None
    timeout_s: float | None = 30.0


class Warmup(msgspec.Struct, tag=True):
    """`Engine.warmup(progress, freeze_heap)`, before the commands sent after it."""

    call: int
    progress: bool
    freeze_heap: bool


class Hold(msgspec.Struct, tag=True):
    """Take no step while holds are open (+1 opens one, -1 closes it)."""

    delta: int


class Close(msgspec.Struct, tag=True):
    """Abort what runs, end the copies in flight and stop; an engine process then closes its
    engine, whose storage tier gets `timeout_s` (None: no limit) to store the cache."""

    timeout_s: float | None = None


ToLoop = Add | Abort | Cancel | Query | SetStorage | Warmup | Hold | Close


# ---- from the loop --------------------------------------------------------------------------


class Started(msgspec.Struct, tag=True):
    """The engine is built: what a server says of it (the grid and config as JSON objects)."""

    vocab_size: int
    max_position_embeddings: int
    max_context_len: int
    device_pages: int
    page_size: int
    grid: dict[str, Any]  # JSON objects, shown as they are
    config: dict[str, Any]


class Outputs(msgspec.Struct, tag=True):
    """Every output of one step for the requests the parent follows, as `Engine.step` gives
    them (deltas), so a step's message does not grow with the outputs' lengths."""

    items: list[RequestOutput]


class Done(msgspec.Struct, tag=True):
    """A command's outcome: `error`, a ValueError's message, when it was refused."""

    call: int
    error: str | None = None
    flag: bool = False  # Abort: the request was followed; flush/clear_storage: it acted
    config: dict[str, Any] | None = None  # SetStorage: the engine's config now (JSON object)


class Answer(msgspec.Struct, tag=True):
    """A query's answer: the field its name names is set (check_invariants: `problem`)."""

    call: int
    stats: EngineStats | None = None
    occupancy: Occupancy | None = None
    startup: StartupTimes | None = None
    compiles: dict[str, int] | None = None
    problem: str | None = None  # check_invariants: what is wrong, if anything
    flag: bool = False  # flush_cache, clear_storage: it acted


ToParent = Outputs | Done | Answer
