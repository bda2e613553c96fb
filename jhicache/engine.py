"""Engine: the public entry point; builds pools, cache, scheduler and runner, and steps them."""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import json
import logging
import numbers
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.batch import Batch, Chunk, model_inputs, patch_tokens
from jhicache.cache import (
    RESERVED_PAGES,
    DevicePool,
    HostPool,
    PoolLayout,
    PrefixCache,
    TransferStep,
    make_copier,
)
from jhicache.cache.file_storage import FileStorage
from jhicache.cache.host_memory import available_bytes
from jhicache.cache.storage import StorageNamespace
from jhicache.compiles import CompileError, CompilePhase, CompileWatch
from jhicache.config import CacheMode, EngineConfig, KVDtype
from jhicache.grid import ShapeGrid, StepShape
from jhicache.logprobs import asked_ids, prompt_reduction, prompt_targets, token_logprobs
from jhicache.logprobs import records as logprob_records
from jhicache.models import (
    Qwen2Config,
    Qwen2ForCausalLM,
    init_random,
    load_pretrained,
    preset_config,
)
from jhicache.models.qwen2_weights import read_config
from jhicache.models.sharding import TensorParallel
from jhicache.request import Request, RequestOutput
from jhicache.runner import ModelRunner
from jhicache.sampling import (
    SEED_LIMIT,
    SamplingParams,
    greedy,
    sample,
    sampling_arrays,
    step_filters,
)
from jhicache.scheduler import Scheduler
from jhicache.stats import EngineStats, Occupancy, StartupTimes, StepCounters
from jhicache.warmup import WarmupReport, warm_up

_CPU_DEFAULT_DEVICE_TOKENS = 16384
logger = logging.getLogger("jhicache.engine")


def _jnp_dtype(dtype: KVDtype | str) -> jnp.dtype:
    return jnp.dtype(jnp.bfloat16 if KVDtype(dtype) is KVDtype.BFLOAT16 else jnp.float32)


class Engine:
    """Serves token-id prompts with continuous batching over a two-tier prefix cache."""

    def __init__(self, model: Qwen2ForCausalLM, config: EngineConfig) -> None:
        built = time.perf_counter()
        self.model_config: Qwen2Config = model.config
        self.config = config
        self.tp = _tensor_parallel(model.config, config)  # None: one device, no mesh
        layout = self._device_layout(model.config, config, self.tp)
        self.device_pool = DevicePool(
            layout, sharding=None if self.tp is None else self.tp.kv_pages_sharding)
        host_pool, copier = None, None
        if config.cache_mode is CacheMode.HIERARCHICAL:
            host_tokens = self._host_tokens(layout, config)
            host_layout = dataclasses.replace(layout, num_pages=host_tokens // config.page_size)
            # One host block and one copier per device shard, in the pool's shard order
            devices = self.device_pool.shard_devices
            copier, drivers = make_copier(devices[0].platform, [_ordinal(d) for d in devices])
            host_pool = HostPool(host_layout, drivers, shards=len(devices))  # pinned once, whole
        storage = (_file_storage(model.config, config, host_pool)
                   if host_pool is not None and config.storage_dir is not None else None)
        self.cache = PrefixCache(config.page_size, self.device_pool, host_pool, config.write_policy,
                                 config.load_back_threshold, config.write_through_threshold, copier,
                                 storage, config.storage_io_threads, config.storage_write_policy,
                                 config.transfer_tuning)
        self.scheduler = Scheduler(config, self.cache)
        self.runner = ModelRunner(model, self.device_pool, self.tp)
        # With a host tier every forward takes the load flags (one compiled variant per shape,
        # whether or not its loads are still landing); without one nothing is ever loaded.
        self.load_flags = self.device_pool.load_flags if host_pool is not None else None
        self.grid = ShapeGrid.create(
            chunked_prefill_tokens=config.chunked_prefill_tokens,
            max_running_requests=config.max_running_requests, page_size=config.page_size,
            max_context_len=self._context_len(model.config, config, layout))
        self.compiles = CompileWatch()
        self.startup = StartupTimes(pools_s=time.perf_counter() - built)
        self.counters = StepCounters()
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._in_flight: _Launched | None = None  # overlap: the dispatched step not yet ended
        self._idle_steps = 0
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, not yet given
        # requests whose prompt log probabilities an ended step filled before their first token
        # (a chunk before the last), not yet given an output
        self._filled: list[Request] = []
        self._seeds = np.random.default_rng()  # seeds for unseeded sampled requests
        self._lock = threading.RLock()  # the engine is single-threaded: calls take turns
        self._closed = False

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig = EngineConfig()) -> Engine:
        """An engine over a Hugging Face Qwen2 checkpoint directory (read straight into the
        sharded layout with tensor parallelism)."""
        tp = _tensor_parallel(read_config(path), config)
        start = time.perf_counter()
        model = load_pretrained(path, dtype=_jnp_dtype(config.dtype), tp=tp)
        if config.storage_model_name is None:
            config = dataclasses.replace(config, storage_model_name=f"checkpoint {Path(path).name}")
        return cls(model, config)._weights_took(time.perf_counter() - start)

    @classmethod
    def from_preset(cls, name: str, config: EngineConfig = EngineConfig(), seed: int = 0) -> Engine:
        """An engine over seeded random weights of a preset shape (`tiny`, `qwen2-0.5b`, ...)."""
        model_config = preset_config(name)
        tp = _tensor_parallel(model_config, config)
        start = time.perf_counter()
        model = init_random(model_config, seed=seed, dtype=_jnp_dtype(config.dtype), tp=tp)
        if config.storage_model_name is None:
            config = dataclasses.replace(config, storage_model_name=f"preset {name} seed {seed}")
        return cls(model, config)._weights_took(time.perf_counter() - start)

    def _weights_took(self, seconds: float) -> Engine:
        self.startup = dataclasses.replace(self.startup, weights_s=seconds)
        logger.info("engine built: weights %.1f s, pools %.1f s; %d step shapes to warm up",
                    seconds, self.startup.pools_s, len(self.grid.shapes()))
        return self

    @staticmethod
    def _device_layout(model: Qwen2Config, config: EngineConfig,
                       tp: TensorParallel | None) -> PoolLayout:
        dtype = _jnp_dtype(config.dtype)
        heads = model.num_key_value_heads if tp is None else tp.storage_kv_heads
        shards = 1 if tp is None else tp.size
        # per device: the default size is taken from one device's free memory
        token_bytes = (2 * model.num_hidden_layers * heads // shards * model.head_dim
                       * dtype.itemsize)
        tokens = config.device_kv_tokens or _default_device_tokens(token_bytes,
                                                                   config.device_memory_fraction)
        return PoolLayout(num_layers=model.num_hidden_layers,
                          num_pages=tokens // config.page_size + 1, page_size=config.page_size,
                          num_kv_heads=heads, head_dim=model.head_dim, dtype=dtype)

    @staticmethod
    def _context_len(model: Qwen2Config, config: EngineConfig, layout: PoolLayout) -> int:
        """The longest request (prompt and output): the model's context, capped by the device
        pool (a request's pages must fit in it) and by `max_context_len`."""
        pool = (layout.num_pages - RESERVED_PAGES) * config.page_size
        return min(model.max_position_embeddings, pool, config.max_context_len or pool)

    @staticmethod
    def _host_tokens(layout: PoolLayout, config: EngineConfig) -> int:
        """The host pool's tokens: `host_kv_tokens`, or the ratio's share capped at 80% of the host
        memory available now (the whole pool is pinned at start)."""
        device_tokens = (layout.num_pages - RESERVED_PAGES) * config.page_size
        available = available_bytes()
        if config.host_kv_tokens is None and available is not None:
            cap = int(0.8 * available) // layout.page_bytes * config.page_size
            config = dataclasses.replace(
                config, host_kv_tokens=min(config.host_tokens_for(device_tokens), cap))
        return config.host_tokens_for(device_tokens)

    # ---- public API ----------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int] | np.ndarray,
                    params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queues one prompt (a list or 1-D array of token ids) and returns its id; `step()`
        then advances it. Validated as `generate` does: a bad value raises `ValueError` and
        changes nothing. `request_id` must not name an unfinished request."""
        with self._lock:
            tokens = _token_array("prompt", prompt)
            self._validate("prompt", tokens, params)
            self._check_ids([request_id])
            return self._submit(tokens, params, request_id, time.perf_counter()).request_id

    def add_requests(self, prompts: Sequence[Sequence[int] | np.ndarray],
                     params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                     request_ids: Sequence[str] | None = None) -> list[str]:
        """Queues every prompt, or none: each is validated (as `generate` does) before any is
        queued, and a bad value raises `ValueError` naming its prompt. Returns their ids."""
        with self._lock:
            arrays = prompt_arrays(prompts)
            per_prompt = self._per_prompt_params(arrays, params)
            ids: list[str | None] = [None] * len(arrays)
            if request_ids is not None:
                if len(request_ids) != len(arrays):
                    raise ValueError(f"got {len(request_ids)} request ids for {len(arrays)} "
                                     "prompts")
                ids = list(request_ids)
            for i, (prompt, p) in enumerate(zip(arrays, per_prompt)):
                self._validate(f"prompt {i}", prompt, p)
            self._check_ids(ids)
            now = time.perf_counter()
            return [self._submit(prompt, p, rid, now).request_id
                    for prompt, p, rid in zip(arrays, per_prompt, ids)]

    def _check_ids(self, ids: Sequence[str | None]) -> None:
        named = [rid for rid in ids if rid is not None]
        for rid in named:
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"request_id={rid!r}: expected a non-empty str")
            if rid in self._requests:
                raise ValueError(f"request_id={rid!r} is already queued")
        if len(set(named)) != len(named):
            raise ValueError("request ids repeat")

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every request that gained a token or finished in it,
        and for one whose prompt log probabilities it filled further before its first token
        (a chunk before the prompt's last: no token, the new rows in `prompt_scores`, so that
        a caller can use them while the next chunk computes). Outputs are deltas: the new
        tokens, their log probabilities and the new prompt rows, never a request's whole so
        far, so a step's cost does not grow with the requests' lengths.

        With `overlap_schedule`, a step dispatches the next batch before it reads the tokens of
        the one before, so the outputs a step returns are those of the batch dispatched by the
        previous call."""
        with self._lock, self._serving():
            aborted, self._aborted = self._aborted, []
            gained = self._step()
            return aborted + self._filled_outputs() + _outputs(gained)

    def warmup(self, progress: bool = True, freeze_heap: bool = False) -> WarmupReport:
        """Compiles every program the engine's steps can dispatch (`grid`'s shapes: the forward,
        sampling, the inputs' transfer, the write-back gathers), so that serving compiles
        nothing; with `progress`, a progress bar on stderr. Only while no request is unfinished
        (ValueError otherwise). With JAX's persistent compilation cache on, a later start
        reads the programs back instead of compiling them. Its compiles take no lock, so
        `stats()` and `occupancy()` answer meanwhile; do not step the engine until it returns
        (a step would compile what it meets, as without a warm-up). With `freeze_heap`, what
        is alive then leaves the garbage collector's walks (`warmup.freeze_heap`): for a
        process that serves this engine to its end."""
        with self._lock:
            if self._requests:
                raise ValueError("warmup() needs an idle engine: requests are unfinished")
            self._drain()
        report = warm_up(self, self._lock, progress, freeze_heap)  # the lock for its steps only
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

    def close(self) -> None:
        """Lets go of what the engine holds beside its device arrays: waits for the copies and
        storage writes in flight, stops the storage tier's threads and unpins the host tier's
        memory. Only with no request unfinished (ValueError otherwise); idempotent. The engine
        serves nothing afterwards."""
        with self._lock:
            if self._closed:
                return
            if self._requests:
                raise ValueError("close() needs an idle engine: requests are unfinished")
            self._drain()
            self.cache.wait_for_backups()
            if self.cache.storage is not None:
                self.cache.storage.close()
            if self.cache.host_pool is not None:
                self.cache.host_pool.close()
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
            arrays = prompt_arrays(prompts)
            per_prompt = self._per_prompt_params(arrays, params)
            for i, (prompt, p) in enumerate(zip(arrays, per_prompt)):
                self._validate(f"prompt {i}", prompt, p)
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
            compiles = self.compiles
            return EngineStats(**self.counters.as_dict(), **self.scheduler.counters,
                               **self.cache.stats(),
                               compiles_warmup=compiles.counts[CompilePhase.WARMUP],
                               compiles_serving=compiles.counts[CompilePhase.SERVING])

    def occupancy(self) -> Occupancy:
        """Queue lengths and the pool sizes and free pages of both tiers, now."""
        with self._lock:
            cache = self.cache
            return Occupancy(waiting_requests=len(self.scheduler.waiting),
                             running_requests=len(self.scheduler.running),
                             device_pages=cache.device.capacity,
                             device_free_pages=cache.device.num_free,
                             host_pages=cache.host.capacity if cache.host else 0,
                             host_free_pages=cache.host.num_free if cache.host else 0)

    def flush_cache(self) -> bool:
        """Empties the prefix cache of both tiers, as SGLang's /flush_cache does: only while no
        request is unfinished (False, nothing done, otherwise). The step and copies in flight
        end first."""
        return self._when_idle(self.cache.clear)

    def clear_storage(self) -> bool:
        """Deletes every page of the storage tier's namespace (the device and host tiers keep
        theirs), as SGLang's /clear_hicache_storage_backend: only while no request is
        unfinished (False, nothing done, otherwise); backups planned before it end first.
        True without a storage tier (nothing to delete)."""
        return self._when_idle(self.cache.clear_storage)

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
        """Raises `InvariantError` on any page-accounting error in either tier (one tree and one
        page id space serve every device shard), when a layer's device pages are not split over
        the devices as the pool's sharding says, when any shard of a layer left the buffer
        the host tier's copies target, or when an attention kernel stopped waiting for loaded
        pages before they landed (a device read: it waits for the compute queued so far)."""
        with self._lock, self._serving():
            self.cache.check_invariants(
                extra_owned_device_pages=self.scheduler.owned_device_pages())

    # ---- one step ------------------------------------------------------------------------

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
        """Under `fail_on_compile`, raises `CompileError` for the serving compiles since the
        last check, naming each program and `where` it happened."""
        compiled = self.compiles.take_serving()
        if compiled and self.config.fail_on_compile:
            names = ", ".join(f"{c.name} ({c.seconds:.2f} s)" for c in compiled)
            raise CompileError(f"compiled while serving{where}: {names}; every program should "
                               f"be compiled by warmup() (grid: {self.grid.describe()})")

    def _step(self) -> list[Request]:
        """One step, in the order its transfers need: retire finished copies, schedule, start
        the batch's loads, dispatch its forward (the loads' later layers queued between the
        forward's two programs), prefetch the next step's loads; on leaving `cache.step()`,
        the queued write-backs and loads start; then end the step before (overlap) or this
        one, and commit. Returns the requests that gained a token."""
        self._filled.clear()  # a caller of `_step` alone (`generate`) takes no outputs
        with self.cache.step() as transfers:
            batch, gained, ended_early = self._schedule(transfers)
            launched = None if batch is None else self._launch(batch, transfers)
            self.scheduler.prefetch()  # loads for the next step, started on leaving the block
        if self.config.overlap_schedule:
            ending, self._in_flight = self._take_in_flight(), launched
        else:
            ending = launched
        if ending is not None:
            gained += self._end(ending)
        self._note_progress(launched is not None or ending is not None or ended_early)
        # Checked once the step is recorded, so that the engine stays consistent if it raises.
        self._check_compiles("" if launched is None else f" in a {launched.shape} step")
        return gained

    def _schedule(self, transfers: TransferStep) -> tuple[Batch | None, list[Request], bool]:
        """The step's batch; where there is none while a step is in flight, that step is ended
        first (it may finish requests and free their pages) and the schedule tried again.
        Returns (batch, the requests the ended step gave a token, whether it was ended here)."""
        in_flight = self._in_flight is not None
        batch = self.scheduler.schedule(may_retract=not in_flight)
        if batch is not None or not in_flight:
            return batch, [], False
        ending = self._take_in_flight()
        assert ending is not None  # `in_flight` said so
        gained = self._end(ending)
        transfers.poll()
        return self.scheduler.schedule(may_retract=True), gained, True

    def _launch(self, batch: Batch, transfers: TransferStep) -> _Launched:
        """Starts the batch's loads and dispatches its forward and sampling. The loads start
        before the rest of the step's host work: a host hit waits for its last layer, so every
        host phase ahead of the copies adds to its TTFT when the load is the longer part. Only
        the first program's layers are queued before it is dispatched, the rest right after,
        so the GPU starts before the host has queued every copy. Waits for the device only
        where `start_loads` must issue a load something held back."""
        gate = transfers.start_loads(batch.tickets, self.runner.first_layers)
        gated = any(not t.done() for t in batch.tickets)  # its loads had not all landed
        inputs = model_inputs(batch, self.grid, self.load_flags, gate)
        tokens = inputs.tokens
        if inputs.patches is not None:  # decode tokens sampled by the step still in flight
            assert self._in_flight is not None
            tokens = patch_tokens(tokens, *inputs.patches, self._in_flight.sampled)
        start = time.perf_counter()
        hidden = self.runner.start(tokens, inputs.meta)
        transfers.finish_loads()
        logits, rows = self.runner.finish(hidden, inputs.meta, inputs.last_index)
        sampled = self._sample(logits, batch.chunks)
        wanted = any(c.samples_token and c.request.logprobs is not None for c in batch.chunks)
        logprobs = None
        if wanted:  # the asked ids as a host array: a transfer, no program
            asked = asked_ids([c.request.params.token_ids_logprob for c in batch.chunks],
                              logits.shape[0])
            logprobs = token_logprobs(logits, sampled, asked)
        spans = _prompt_spans(batch)
        prompt = None
        if spans:
            targets = _span_targets(spans, inputs.shape.tokens)
            on_device = jax.device_put(targets, rows.sharding)  # (replicated over a mesh)
            most = max(span.request.params.prompt_logprobs or 0 for span in spans)
            prompt = self.runner.programs.head_rows(rows, on_device, prompt_reduction(most))
        for row, chunk in enumerate(batch.chunks):
            if chunk.samples_token:
                chunk.request.pending_row = row
        return _Launched(batch, sampled, start, gated, inputs.shape, logprobs,
                         tuple(spans), prompt)

    def _end(self, step: _Launched) -> list[Request]:
        """Reads a step's sampled tokens, and their log probabilities where asked for (waiting
        for that step alone, in one read), and commits them; returns the requests that gained
        one (its last token)."""
        if step.logprobs is None and step.prompt is None:  # the usual step: one array to read
            ids, logprobs, prompt = np.asarray(step.sampled), None, None
        else:
            ids, logprobs, prompt = jax.device_get((step.sampled, step.logprobs, step.prompt))
        now = time.perf_counter()
        if prompt is not None:
            self._add_prompt_logprobs(step.prompt_spans, *prompt)
            self._filled += [span.request for span in step.prompt_spans]
        self.counters.record_forward(step.batch, now - step.dispatched_s, step.gated)
        gained = self.scheduler.commit(step.batch, ids, now)
        if logprobs is not None:
            self._add_logprobs(step.batch, set(gained), *logprobs)
        finished = [r for r in gained if r.finished]
        self.counters.record_finished(finished)
        for req in finished:
            self._requests.pop(req.request_id, None)
        if self.config.check_invariants_every_step:
            self.check_invariants()
        return gained

    @staticmethod
    def _add_logprobs(batch: Batch, gained: set[Request], chosen: np.ndarray,
                      top_values: np.ndarray, top_ids: np.ndarray, asked: np.ndarray) -> None:
        """Each request that gained a token and asked for log probabilities keeps its row's."""
        rows = [(row, chunk.request) for row, chunk in enumerate(batch.chunks)
                if chunk.samples_token and chunk.request in gained
                and chunk.request.logprobs is not None]
        if not rows:
            return
        index = [row for row, _ in rows]
        made = logprob_records([req.tokens[-1] for _, req in rows], chosen[index],
                               top_values[index], top_ids[index], asked[index],
                               [req.params.logprobs or 0 for _, req in rows],
                               [req.params.token_ids_logprob for _, req in rows])
        for (_, req), record in zip(rows, made):
            assert req.logprobs is not None
            req.logprobs.append(record)

    @staticmethod
    def _add_prompt_logprobs(spans: tuple[_PromptSpan, ...], chosen: np.ndarray,
                             top_values: np.ndarray, top_ids: np.ndarray,
                             asked: np.ndarray) -> None:
        """Each span's rows fill its request's prompt entries, with the alternatives it asked
        for (the step's reduction took as many as the most any span asked for; `fill` keeps
        the first columns)."""
        for span in spans:
            req, rows = span.request, slice(span.row, span.row + span.length)
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.fill(span.position - req.params.prompt_logprobs_start,
                                     chosen[rows], top_values[rows], top_ids[rows], asked[rows])

    def _take_in_flight(self) -> _Launched | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _note_progress(self, progressed: bool) -> None:
        if progressed:
            self._idle_steps = 0
            return
        if self.scheduler.fetching():  # waiting on storage: not idle, but nothing to do yet
            self.cache.wait_for_storage(_STORAGE_WAIT_S)
            return
        # Loaded pages stay locked until their copy retires: wait for the transfers rather
        # than count a step that only had to wait for the copy engine.
        self.cache.flush()
        self._idle_steps += 1
        if self._idle_steps > 2 * len(self.scheduler.running) + 8:
            raise RuntimeError("scheduler made no progress: device pool too small for the "
                               "running requests")

    def evict(self, pages: int | None = None, wait: bool = True) -> int:
        """Evicts least recently used unlocked device pages, at least `pages` where there are
        that many (every one, with None), as the engine does when it needs room: their write-
        backs to the host tier start under the write policy. With `wait`, returns once every
        copy has landed. Returns the pages freed."""
        with self._lock, self._serving():
            count = self.cache.device.evictable_pages if pages is None else pages
            freed = self.cache.evict_device(count)
            if wait:
                self.cache.flush()
            return freed

    def drain(self) -> list[RequestOutput]:
        """Ends the step in flight and waits for every transfer; returns that step's outputs
        (as `step()` does). Unfinished requests stay queued for later steps; with
        none, the engine is idle afterwards (no step, copy or write-back in flight), as a
        caller that stops stepping needs it to be: `AsyncEngine` calls it once its requests
        have all finished."""
        with self._lock, self._serving():
            return self._drain()

    def _drain(self) -> list[RequestOutput]:
        step = self._take_in_flight()
        outputs, self._aborted = self._aborted, []
        if step is not None:
            gained = self._end(step)
            outputs += self._filled_outputs() + _outputs(gained)
        self.cache.flush()
        return outputs

    def _filled_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests whose prompt log probabilities the steps just ended filled
        and which are still before their first token (one that has it now gets its token's
        output, which carries the new rows too)."""
        filled, self._filled = self._filled, []
        return [r.take_output([]) for r in dict.fromkeys(filled)
                if r.num_output == 0 and r.request_id in self._requests]

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _per_prompt_params(prompts: list[np.ndarray], params) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError("params must be SamplingParams or a list of them, "
                             f"got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return params

    def _validate(self, where: str, tokens: np.ndarray, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params for {where} must be SamplingParams, "
                             f"got {type(params).__name__}")
        if len(tokens) == 0:
            raise ValueError(f"{where} is empty")
        vocab = self.model_config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"{where}: token id out of range [0, {vocab}): "
                             f"min {tokens.min()}, max {tokens.max()}")
        for field in ("stop_token_ids", "token_ids_logprob"):
            bad = [t for t in getattr(params, field) if t >= vocab]
            if bad:
                raise ValueError(f"SamplingParams.{field} for {where}: {bad} not in the "
                                 f"vocabulary [0, {vocab})")
        if params.prompt_logprobs is not None and params.prompt_logprobs_start >= len(tokens):
            raise ValueError(f"SamplingParams.prompt_logprobs_start for {where}: "
                             f"{params.prompt_logprobs_start} is past the prompt's "
                             f"{len(tokens)} tokens")
        total = len(tokens) + params.max_new_tokens
        if total > self.grid.max_context_len:
            raise ValueError(f"{where}: prompt + max_new_tokens = {total} exceeds the context "
                             f"limit ({self.grid.max_context_len} tokens: the least of the "
                             f"model's context, the device pool and max_context_len)")

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
        step = self._take_in_flight()
        if step is not None:
            try:
                self._end(step)
            except Exception:  # noqa: BLE001 (the step failed too: its requests cannot go on)
                requests = [*requests, *(c.request for c in step.batch.chunks)]
        for req in requests:
            if self._requests.pop(req.request_id, None) is not None:
                self.scheduler.abort(req, keep_computed=False)
        self.cache.flush()

    def _sample(self, logits: jax.Array, rows: list[Chunk]) -> jax.Array:
        """Dispatches the sampling of one token per row: [grid.max_requests] int32 (rows past
        the batch's are padding)."""
        out_rows = self.grid.max_requests
        params = [c.request.params for c in rows]
        if all(p.is_greedy for p in params):
            return greedy(logits, rows=out_rows)
        steps = [c.sample_index or 0 for c in rows]
        # host arrays, passed as they are: a transfer, no program
        temperature, top_k, top_p, seeds = sampling_arrays(params, steps, logits.shape[0])
        return sample(logits, temperature, top_k, top_p, seeds, rows=out_rows,
                      filters=step_filters(params))


class _Launched(NamedTuple):
    """A dispatched step whose sampled tokens the host has not read yet."""

    batch: Batch
    sampled: jax.Array  # [B] int32, on the device
    dispatched_s: float
    gated: bool  # dispatched while load-backs it reads were landing (it waited on the device)
    shape: StepShape  # the grid shape it was padded to
    logprobs: tuple[jax.Array, ...] | None = None  # `token_logprobs` of it, where asked for
    prompt_spans: tuple[_PromptSpan, ...] = ()  # see `_prompt_spans`
    prompt: tuple[jax.Array, ...] | None = None  # `prompt_reduction`'s of every row, if asked


def _outputs(gained: list[Request]) -> list[RequestOutput]:
    """The outputs of requests that gained one token (their last) in a step."""
    return [r.take_output([r.tokens[-1]]) for r in gained]


class _PromptSpan(NamedTuple):
    """Rows of a step whose logits give the log probabilities of prompt tokens a request asked
    for: rows `row` to `row + length`, each for the prompt token after its own, from `position`."""

    row: int
    request: Request
    position: int
    length: int


def _prompt_spans(batch: Batch) -> list[_PromptSpan]:
    """A span per chunk whose rows give prompt log probabilities its request asked for."""
    spans, offset = [], 0
    for chunk in batch.chunks:
        req = chunk.request
        if req.prompt_logprobs is not None:
            first = max(req.params.prompt_logprobs_start, 1) - 1  # the row before it
            lo, hi = max(chunk.start, first), min(chunk.start + chunk.length, req.prompt_len - 1)
            if hi > lo:
                spans.append(_PromptSpan(offset + lo - chunk.start, req, lo + 1, hi - lo))
        offset += chunk.length
    return spans


def _span_targets(spans: list[_PromptSpan], tokens: int) -> np.ndarray:
    """`prompt_targets` of a step of `tokens` rows, filled: a span's rows hold the prompt
    tokens that follow them, then the ids their request names."""
    targets = prompt_targets(tokens)
    for span in spans:
        rows = slice(span.row, span.row + span.length)
        targets[rows, 0] = span.request.tokens[span.position:span.position + span.length]
        named = span.request.params.token_ids_logprob
        targets[rows, 1:1 + len(named)] = named
    return targets


_STORAGE_WAIT_S = 0.01  # an idle step waits this long at most for a storage read to move on:
# short, as a request that arrives meanwhile is added only after it


def _file_storage(model: Qwen2Config, config: EngineConfig, host_pool: HostPool) -> FileStorage:
    """The storage tier's backend: a directory whose namespace names the model (its given or
    derived name and its config's hash), the dtype, the page size and the host layout."""
    assert config.storage_dir is not None
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    layout = host_pool.layout
    namespace = StorageNamespace(
        model=f"{config.storage_model_name or 'model'} config {digest}",
        dtype=jnp.dtype(layout.dtype).name, page_size=layout.page_size,
        layout=(f"layer_first layers={layout.num_layers} kv_heads={layout.num_kv_heads} "
                f"head_dim={layout.head_dim} shards={host_pool.shards}"),
        page_bytes=layout.page_bytes, tensor_parallel_size=host_pool.shards)
    return FileStorage(config.storage_dir, namespace, host_pool.page_views,
                       config.storage_capacity_bytes)


def _tensor_parallel(model: Qwen2Config, config: EngineConfig) -> TensorParallel | None:
    """The model's layout over `config.tensor_parallel_size` devices; None for one device, whose
    programs then run without a mesh or shard_map."""
    if config.tensor_parallel_size == 1:
        return None
    return TensorParallel.create(config.tensor_parallel_size, model,
                                 field="EngineConfig.tensor_parallel_size")


def _ordinal(device: jax.Device) -> int:
    """The device's index among the process's visible devices (its CUDA ordinal on a GPU)."""
    hardware = getattr(device, "local_hardware_id", None)
    return device.id if hardware is None else hardware


def _default_device_tokens(token_bytes: int, fraction: float) -> int:
    stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    if not stats:
        return _CPU_DEFAULT_DEVICE_TOKENS
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return max(int(free * fraction) // token_bytes, 1024)


def prompt_arrays(prompts: object) -> list[np.ndarray]:
    """`prompts` as a list of 1-D int64 token arrays; a clear error for anything else, above
    all a single flat prompt where a list of prompts is expected."""
    flat_hint = "; for one prompt, pass [prompt]"
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1 and prompts.dtype != object:
            raise ValueError(f"prompts must be a list of prompts, got one 1-D array{flat_hint}")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        raise ValueError("prompts must be a list of token-id lists, "
                         f"got a flat list of ints{flat_hint}")
    return [_token_array(f"prompt {i}", p) for i, p in enumerate(prompts)]


def _token_array(where: str, prompt: object) -> np.ndarray:
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{where} is a string: prompts are token ids (tokenize first)")
    bad = ValueError(f"{where} must be a flat list of integer token ids, "
                     f"got {type(prompt).__name__}")
    if isinstance(prompt, (list, tuple)):
        # array("q") converts Python ints at C speed and refuses anything that is not an integer
        # (float, str, nested list); np.asarray would first infer a dtype, several times slower,
        # and a long prompt's conversion comes before its loads start. Bools are not token ids.
        if prompt and isinstance(prompt[0], (bool, np.bool_)):
            raise bad
        try:
            return np.frombuffer(array.array("q", prompt), dtype=np.int64)
        except (TypeError, OverflowError):
            raise bad from None
    try:
        tokens = np.asarray(prompt) if isinstance(prompt, (Sequence, np.ndarray)) else None
    except ValueError:  # ragged nesting
        tokens = None
    if tokens is None or tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise bad
    return tokens.astype(np.int64)
