"""Engine statistics: the step counters the engine keeps, and EngineStats, the typed snapshot
that `Engine.stats()` returns (engine, scheduler and cache counters in one record)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jhicache.batch import Batch
from jhicache.cache import PrefixCache
from jhicache.compiles import CompilePhase, CompileWatch
from jhicache.request import Request
from jhicache.scheduler import Scheduler
from jhicache.warmup import WarmupReport


@dataclasses.dataclass
class StepCounters:
    """Counters the engine adds to after every step. `*_forward_s` run from a step's dispatch
    to its tokens being read on the host; with overlap scheduling consecutive steps overlap."""

    computed_prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    load_gated_steps: int = 0
    finished_requests: int = 0
    prefill_forward_s: float = 0.0
    decode_forward_s: float = 0.0
    load_gated_forward_s: float = 0.0

    def record_forward(self, batch: Batch, seconds: float, gated: bool) -> None:
        if batch.is_decode:
            self.decode_forward_s += seconds
            self.decode_steps += 1
            self.decode_tokens += batch.num_tokens
            return
        self.prefill_forward_s += seconds
        self.prefill_steps += 1
        self.computed_prompt_tokens += batch.num_tokens
        if gated:
            self.load_gated_steps += 1
            self.load_gated_forward_s += seconds

    def record_finished(self, finished: list[Request]) -> None:
        self.finished_requests += len(finished)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Every counter of an engine, cumulative since it was built, at one moment. Built from the
    step counters, the scheduler's and the cache's by keyword, so a name two of them used would
    raise rather than one silently hiding the other."""

    # work done: tokens and steps, host seconds per kind of step (see StepCounters)
    computed_prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    # steps dispatched while load-backs they read were landing: their layers waited on the device
    load_gated_steps: int = 0
    finished_requests: int = 0
    prefill_forward_s: float = 0.0
    decode_forward_s: float = 0.0
    load_gated_forward_s: float = 0.0
    # scheduler: prompt tokens served by each tier, requests retracted under page pressure
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # loaded back from host, less what was read from storage first
    storage_hit_tokens: int = 0  # read from storage into host pages, then loaded back
    retracted_requests: int = 0
    # transfers between the tiers: bytes of the pages copied; seconds from each launch's first
    # copy starting to its last finishing, summed (device-side events on a GPU; a write-back
    # is queued in pieces over several steps, so its span includes the gaps)
    write_back_ops: int = 0
    write_back_bytes: int = 0
    write_back_s: float = 0.0
    load_back_ops: int = 0
    load_back_bytes: int = 0
    load_back_s: float = 0.0
    # evictions and what they cost
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    dropped_nodes: int = 0
    dropped_tokens: int = 0
    # refusals
    write_through_failures: int = 0
    load_back_skipped: int = 0
    load_back_over_quota: int = 0
    load_back_failures: int = 0
    load_back_stale: int = 0
    alloc_failures: int = 0
    storage_backup_skipped: int = 0  # backups not planned: no host room for an ancestor's copy
    # the storage tier: pages backed up (written, or found there already) and failed batches;
    # fetches by outcome (revoked: fewer found, or fitting the host tier, than the threshold,
    # or the prefix they go under left the cache while storage answered; no_host: no host
    # room) and the pages they read; the backend's bytes and seconds each way, its misses by reason
    # (a damaged page is never served), its evictions, and its size now
    storage_backup_pages: int = 0
    storage_backup_failures: int = 0
    storage_fetches: int = 0
    storage_fetch_revoked: int = 0
    storage_fetch_full: int = 0
    storage_fetch_partial: int = 0
    storage_fetch_no_host: int = 0
    storage_fetched_pages: int = 0
    storage_fetch_read_s: float = 0.0  # ended fetches whose reads stopped: first start to last end
    storage_written_bytes: int = 0
    storage_write_s: float = 0.0
    storage_read_bytes: int = 0
    storage_read_s: float = 0.0
    storage_missing_pages: int = 0
    storage_truncated_pages: int = 0
    storage_corrupt_pages: int = 0
    storage_evicted_pages: int = 0
    # pages the backend could not write, by reason (`storage.WRITE_FAILURE_REASONS`)
    storage_write_failures_no_space: int = 0
    storage_write_failures_permission: int = 0
    storage_write_failures_io: int = 0
    storage_pages: int = 0
    storage_bytes: int = 0
    storage_capacity_bytes: int = 0
    storage_reachable: int = 1  # 1: the backend answers now, as its client sees (or no tier)
    # occupancy now
    device_free_pages: int = 0
    evictable_tokens: int = 0
    protected_tokens: int = 0
    host_free_pages: int = 0
    loads_in_flight: int = 0
    # programs JAX compiled (or read back from its persistent cache): inside `warmup()`, and
    # in any other engine call (a step, an abort, a flush): 0 there once the grid is warm
    compiles_warmup: int = 0
    compiles_serving: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, counters: StepCounters, scheduler: Scheduler, cache: PrefixCache,
           compiles: CompileWatch) -> EngineStats:
        return cls(**counters.as_dict(), **scheduler.counters, **cache.stats(),
                   compiles_warmup=compiles.counts[CompilePhase.WARMUP],
                   compiles_serving=compiles.counts[CompilePhase.SERVING])


@dataclasses.dataclass(frozen=True)
class StartupTimes:
    """Where an engine's start went, in wall seconds: reading or drawing the weights (None for
    an engine built over a model in hand), building the engine around them (`pools_s`: mostly
    the pools, the host pool's pinning above all; also the cache and the runner), and the
    warm-up (None until `warmup()` has run)."""

    pools_s: float
    weights_s: float | None = None
    warmup: WarmupReport | None = None


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """What an engine holds at one moment: requests by queue, and each tier's pool in pages
    (capacity excludes the reserved padding page; a tier that is not built has 0 pages)."""

    waiting_requests: int  # queued, or retracted and waiting to be readmitted
    running_requests: int  # admitted: prefilling or decoding
    device_pages: int
    device_free_pages: int
    host_pages: int
    host_free_pages: int

    @classmethod
    def of(cls, scheduler: Scheduler, cache: PrefixCache) -> Occupancy:
        pages = cache.pages
        return cls(waiting_requests=len(scheduler.waiting),
                   running_requests=len(scheduler.running),
                   device_pages=pages.device, device_free_pages=pages.device_free,
                   host_pages=pages.host, host_free_pages=pages.host_free)
