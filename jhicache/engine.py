"""Engine: the public entry point: takes requests, steps them over the parts `EngineParts`
builds (`Stepper` holds a step's order), and answers for its state and lifecycle."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jhicache import inputs
from jhicache.compiles import CompilePhase, CompileWatch
from jhicache.config import EngineConfig, StorageBackend
from jhicache.models import CausalLM, DecoderConfig
from jhicache.parts import EngineParts, preset_model, pretrained_model
from jhicache.request import Request, RequestOutput
from jhicache.sampling import SEED_LIMIT, SamplingParams
from jhicache.stats import EngineStats, Occupancy, StartupTimes, StepCounters
from jhicache.stepper import Stepper
from jhicache.warmup import WarmupReport, warm_up

logger = logging.getLogger("jhicache.engine")


class Engine:
    """Serves token-id prompts with continuous batching over a two-tier prefix cache."""

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        built = time.perf_counter()
        self.model_config: DecoderConfig = model.config
        self.config = config
        parts = EngineParts.create(model, config)
        self.tp, self.device_pool, self.cache = parts.tp, parts.device_pool, parts.cache
        self.scheduler, self.runner, self.grid = parts.scheduler, parts.runner, parts.grid
        self.executor, self._limits = parts.executor, parts.limits
        self._storage_for = parts.storage_for
        self.load_flags = parts.executor.load_flags
        self.compiles = CompileWatch()
        self.startup = StartupTimes(pools_s=time.perf_counter() - built)
        self.counters = StepCounters()
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self.stepper = Stepper(self.scheduler, self.cache, self.executor, self.counters,
                               config.overlap_schedule, self._ended)
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, not yet given
        # requests whose prompt log probabilities an ended step filled before their first token
        # (a chunk before the last), not yet given an output
        self._filled: list[Request] = []
        self._seeds = np.random.default_rng()  # seeds for unseeded sampled requests
        self._lock = threading.RLock()  # the engine is single-threaded: calls take turns
        self._closed = False

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig = EngineConfig()) -> Engine:
        """An engine over a Hugging Face checkpoint directory of any `jhicache.models.FAMILIES`
        (read straight into the sharded layout with tensor parallelism)."""
        return cls._built(lambda: pretrained_model(path, config))

    @classmethod
    def from_preset(cls, name: str, config: EngineConfig = EngineConfig(), seed: int = 0) -> Engine:
        """An engine over seeded random weights of a preset shape (`tiny`, `qwen2-0.5b`, ...)."""
        return cls._built(lambda: preset_model(name, config, seed))

    @classmethod
    def _built(cls, load: Callable[[], tuple[CausalLM, EngineConfig]]) -> Engine:
        """An engine over the model `load` reads or draws, the seconds that took logged."""
        start = time.perf_counter()
        model, config = load()
        seconds = time.perf_counter() - start
        engine = cls(model, config)
        engine.startup = dataclasses.replace(engine.startup, weights_s=seconds)
        logger.info("engine built: weights %.1f s, pools %.1f s; %d step shapes to warm up",
                    seconds, engine.startup.pools_s, len(engine.grid.shapes()))
        return engine

    def add_request(self, prompt: Sequence[int] | np.ndarray,
                    params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queues one prompt (a list or 1-D array of token ids) and returns its id; `step()`
        then advances it. Validated as `generate` does: a bad value raises `ValueError` and
        changes nothing. `request_id` must not name an unfinished request."""
        with self._lock:
            tokens = inputs.checked_prompt(prompt, params, self._limits)
            inputs.check_ids([request_id], self._requests)
            return self._submit(tokens, params, request_id, time.perf_counter()).request_id

    def add_requests(self, prompts: Sequence[Sequence[int] | np.ndarray],
                     params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                     request_ids: Sequence[str] | None = None) -> list[str]:
        """Queues every prompt, or none: each is validated (as `generate` does) before any is
        queued, and a bad value raises `ValueError` naming its prompt. Returns their ids."""
        with self._lock:
            arrays, per_prompt = inputs.checked_prompts(prompts, params, self._limits)
            ids = inputs.request_ids(request_ids, len(arrays), self._requests)
            now = time.perf_counter()
            return [self._submit(prompt, p, rid, now).request_id
                    for prompt, p, rid in zip(arrays, per_prompt, ids)]

    def step(self) -> list[RequestOutput]:
        """One engine step; an output (a delta: new tokens, their log probabilities, new prompt
        rows) for every request that gained a token or finished in it, and for one whose
        prompt log probabilities a chunk before the prompt's last filled further. With
        `overlap_schedule` the outputs are those of the batch the previous call dispatched."""
        with self._lock, self._serving():
            aborted, self._aborted = self._aborted, []
            gained = self._step()
            return aborted + self._outputs(gained)

    def warmup(self, progress: bool = True, freeze_heap: bool = False,
               stop: threading.Event | None = None) -> WarmupReport:
        """Compiles every program a step can dispatch (`grid`'s shapes): serving compiles
        nothing; `progress`: a bar on stderr. Only while idle (ValueError otherwise); `stats()`
        answers meanwhile. `freeze_heap`: `warmup.freeze_heap` after, for a process that serves
        this engine to its end. Setting `stop` ends it at its next program (`WarmupStopped`)."""
        with self._lock:
            if self._requests:
                raise ValueError("warmup() needs an idle engine: requests are unfinished")
            self._drain()
        # the lock for its steps only
        report = warm_up(self.executor, self.compiles, self._lock, self.check_invariants,
                         progress, freeze_heap, stop)
        self.startup = dataclasses.replace(self.startup, warmup=report)
        return report

    @property
    def warmed_up(self) -> bool:
        """True once `warmup()` has run."""
        return self.startup.warmup is not None

    def abort(self, request_id: str) -> bool:
        """Drops a request at any stage: its computed full pages go to the cache, the rest back
        to the pool; copies in flight complete. The next `step()` (or `drain()`) returns its
        final output, finish reason "abort". False (nothing done) for an unknown or finished
        id."""
        with self._lock, self._serving():
            req = self._requests.pop(request_id, None)
            if req is None or not self.scheduler.abort(req):
                return False
            self._aborted.append(req.take_output([]))
            return True

    def close(self, timeout_s: float | None = None) -> None:
        """Lets go of what the engine holds beside its device arrays: with a storage tier,
        writes there every cached page it lacks, whatever the write policies, for up to
        `timeout_s` (None: all), so that a restart finds the whole cache (`PrefixCache.close`).
        Only while idle (ValueError otherwise); idempotent; it serves nothing afterwards."""
        with self._lock:
            if self._closed:
                return
            if self._requests:
                raise ValueError("close() needs an idle engine: requests are unfinished")
            self._drain()
            self.cache.close(timeout_s)
            self._closed = True

    def has_unfinished(self) -> bool:
        """True while a submitted request has not finished or been aborted."""
        return bool(self._requests)

    def is_unfinished(self, request_id: str) -> bool:
        """True while the request `request_id` has not finished or been aborted."""
        return request_id in self._requests

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 ) -> list[RequestOutput]:
        """Runs `prompts` (a list of token-id lists) to completion with continuous batching;
        returns their outputs in order (`new_token_ids` then holds every generated token).

        Everything is validated before the engine changes; a bad value raises `ValueError` and
        queues nothing. If the call fails or is interrupted part-way, its requests are dropped
        (their pages freed, nothing left queued) and the cache stays intact. Calls from several
        threads are serialised: one runs at a time."""
        with self._lock, self._serving():
            arrays, per_prompt = inputs.checked_prompts(prompts, params, self._limits)
            now = time.perf_counter()
            requests = [self._submit(prompt, p, None, now)
                        for prompt, p in zip(arrays, per_prompt)]
            try:
                while not all(r.finished for r in requests):
                    self._step()
                if not self._requests:
                    self._drain()
            except BaseException:
                self._abandon(requests)
                raise
            return [req.result() for req in requests]

    def stats(self) -> EngineStats:
        """Cumulative counters (cache hits, transfers, evictions, load time) and occupancy."""
        with self._lock:
            return EngineStats.of(self.counters, self.scheduler, self.cache, self.compiles)

    def occupancy(self) -> Occupancy:
        """Queue lengths and the pool sizes and free pages of both tiers, now."""
        with self._lock:
            return Occupancy.of(self.scheduler, self.cache)

    def flush_cache(self) -> bool:
        """Empties the prefix cache of both tiers, as SGLang's /flush_cache does: only while no
        request is unfinished (False, nothing done, otherwise). The step and copies in flight
        end first."""
        return self._when_idle(self.cache.clear)

    def clear_storage(self) -> bool:
        """Deletes the storage tier's pages (SGLang's /clear_hicache_storage_backend; the other
        tiers keep theirs) once planned backups end: only while no request is unfinished and
        its backend answers (`stats().storage_reachable`), else False (no tier: True)."""
        return (bool(self.stats().storage_reachable)
                and self._when_idle(lambda: self.cache.clear(storage=True)))

    def set_storage(self, backend: StorageBackend | str | None, storage_dir: str | None = None,
                    backend_config: str | None = None, timeout_s: float | None = 30.0,
                    ) -> EngineConfig:
        """Attaches a storage tier ("file" in `storage_dir`, or "mooncake" with its JSON
        `backend_config`) in place of any, or detaches it (None), while requests are served
        (`PrefixCache.set_storage`). Returns the config now; ValueError changes nothing."""
        config = self.config.with_storage(backend, storage_dir, backend_config)
        with self._lock, self._serving():
            try:
                storage = None if backend is None else self._storage_for(config)
            except (OSError, RuntimeError) as e:  # a directory, or a store, that cannot be used
                raise ValueError(f"storage backend {backend}: {e}") from e
            self.cache.set_storage(storage, timeout_s)
            self.config = config
            return config

    def _when_idle(self, action: Callable[[], object]) -> bool:
        """Runs `action` once the step and copies in flight have ended, if no request is
        unfinished; False (nothing done) otherwise."""
        with self._lock, self._serving():
            if self._requests:
                return False
            self._drain()
            action()
            return True

    def check_invariants(self) -> None:
        """Raises `InvariantError` on any page-accounting error in any tier, a device pool laid
        out off its sharding, or a kernel that read loaded pages before they landed
        (`PrefixCache.check_invariants`; a device read: it waits for the compute queued)."""
        with self._lock, self._serving():
            self.cache.check_invariants(
                extra_owned_device_pages=self.scheduler.owned_device_pages())

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """Counts the compiles of the block as serving ones; under `fail_on_compile`, raises
        `CompileError` naming them once it ends (inside a warm-up they count as warm-up)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        with self.compiles.watch(CompilePhase.SERVING):
            yield
        self._check_compiles("")

    def _check_compiles(self, where: str) -> None:
        self.compiles.check_serving(self.config.fail_on_compile, where, self.grid.describe)

    def _step(self) -> list[Request]:
        """One step (`Stepper.step`); returns the requests that gained a token."""
        self._filled.clear()  # a caller of `_step` alone (`generate`) takes no outputs
        gained, launched = self.stepper.step()
        # Checked once the step is recorded, so that the engine stays consistent if it raises.
        self._check_compiles("" if launched is None else f" in a {launched.shape} step")
        return gained

    def _ended(self, gained: list[Request], filled: list[Request]) -> None:
        """An ended step's bookkeeping: its finished requests leave, the requests it filled
        prompt log probabilities of wait for their outputs."""
        self._filled += filled
        for req in gained:
            if req.finished:
                self._requests.pop(req.request_id, None)
        if self.config.check_invariants_every_step:
            self.check_invariants()

    def evict(self, pages: int | None = None, wait: bool = True) -> int:
        """Evicts least recently used unlocked device pages, at least `pages` (None: all), as
        the engine does when it needs room (their write-backs start); with `wait`, returns once
        every copy has landed. Returns the pages freed."""
        with self._lock, self._serving():
            freed = self.cache.evict_device(pages)
            if wait:
                self.cache.flush()
            return freed

    def load_back(self, prompt: Sequence[int]) -> bool:
        """Loads the host-tier run of `prompt`'s cached prefix alone, returning once it landed
        (a bench times it); False (nothing done) with none to load or while requests run."""
        with self._lock, self._serving():
            if self._requests:
                return False
            self._drain()
            return self.stepper.load_alone(list(prompt))

    def drain(self) -> list[RequestOutput]:
        """Ends the step in flight and waits for every transfer; returns that step's outputs.
        With no request unfinished the engine is idle afterwards (`AsyncEngine` calls it once
        its requests have all finished)."""
        with self._lock, self._serving():
            return self._drain()

    def _drain(self) -> list[RequestOutput]:
        step = self.stepper.take_in_flight()
        outputs, self._aborted = self._aborted, []
        if step is not None:
            gained = self.stepper.end(step)
            outputs += self._outputs(gained)
        self.cache.flush()
        return outputs

    def _outputs(self, gained: list[Request]) -> list[RequestOutput]:
        """The outputs of the steps just ended: of the requests whose prompt log probabilities
        they filled and which are still before their first token (one that has it now gets its
        token's output, which carries the new rows too), then of those that gained a token."""
        filled, self._filled = self._filled, []
        return ([r.take_output([]) for r in dict.fromkeys(filled)
                 if r.num_output == 0 and r.request_id in self._requests]
                + [r.take_output([r.tokens[-1]]) for r in gained])

    def _submit(self, prompt: np.ndarray, params: SamplingParams, request_id: str | None,
                now: float) -> Request:
        if not params.is_greedy and params.seed is None:
            # A fresh seed per submission (as vLLM does): unseeded output is random, yet the
            # request then samples the same way however it is batched or cached.
            params = dataclasses.replace(params, seed=int(self._seeds.integers(SEED_LIMIT)))
        req = Request(request_id=request_id or uuid.uuid4().hex, tokens=prompt.tolist(),
                      params=params, arrival_s=now)
        self._requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def _abandon(self, requests: list[Request]) -> None:
        """Drops the unfinished `requests` of a call that failed: pages freed (nothing of theirs
        goes to the cache), nothing queued, the step and copies in flight completed."""
        step = self.stepper.take_in_flight()
        if step is not None:
            try:
                self.stepper.end(step)
            except Exception:  # noqa: BLE001 (the step failed too: its requests cannot go on)
                requests = [*requests, *(c.request for c in step.batch.chunks)]
        for req in requests:
            if self._requests.pop(req.request_id, None) is not None:
                self.scheduler.abort(req, keep_computed=False)
        self.cache.flush()

