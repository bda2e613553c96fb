"""StepExecutor: the programs one engine step dispatches, written once (`_dispatch`) and used
three ways: run for a scheduled batch (`launch`), run for a step of padding (`pad`, the
warm-up's second pass) and lowered and compiled ahead of time for a grid shape (`lower`, its
first pass), so that a warm-up compiles exactly what a step can call."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from jhicache import scoring
from jhicache.batch import Batch, StepInputs, model_inputs, padding_inputs, patch_tokens
from jhicache.cache import TransferStep
from jhicache.cache.write_back import WriteBacks
from jhicache.grid import ShapeGrid, StepShape
from jhicache.logprobs import PROMPT_REDUCTIONS, asked_ids, prompt_targets, token_logprobs
from jhicache.models import AttentionMetadata
from jhicache.models.functional import output_type
from jhicache.penalties import PenaltyRows, TokenHistory, count_sampled, penalize, write_row
from jhicache.runner import ModelRunner
from jhicache.sampling import Filters, greedy, sample, sampling_arrays, step_filters

# A sampler program and its arguments after the logits: (program, host arrays, static options)
Sampler = tuple[Callable[..., Any], tuple[np.ndarray, ...], dict[str, Any]]


class Launched(NamedTuple):
    """A dispatched step whose sampled tokens the host has not read yet."""

    batch: Batch
    sampled: jax.Array  # [B] int32, on the device
    dispatched_s: float
    gated: bool  # dispatched while load-backs it reads were landing (it waited on the device)
    shape: StepShape  # the grid shape it was padded to
    logprobs: tuple[jax.Array, ...] | None = None  # `token_logprobs` of it, where asked for
    prompt_spans: tuple[scoring.PromptSpan, ...] = ()  # see `scoring.prompt_spans`
    prompt: tuple[jax.Array, ...] | None = None  # the prompt reduction of every row, if asked

    def read(self) -> tuple[np.ndarray, Any, Any]:
        """(sampled ids, token log probabilities or None, prompt rows or None) on the host,
        waiting for this step alone, in one read."""
        if self.logprobs is None and self.prompt is None:  # the usual step: one array to read
            return np.asarray(self.sampled), None, None
        ids, logprobs, prompt = jax.device_get((self.sampled, self.logprobs, self.prompt))
        return ids, logprobs, prompt


class _Programs(Protocol):
    """How `_dispatch` issues each program: called, or lowered and compiled for its types."""

    def call(self, program: Callable[..., Any], *args: Any, **options: Any) -> Any: ...

    def first(self, tokens: Any, meta: AttentionMetadata) -> Any: ...

    def rest(self, hidden: Any, meta: AttentionMetadata, last_index: Any) -> tuple[Any, Any]: ...

    def head_rows(self, rows: Any, targets: Any, reduction: scoring.Reduction) -> Any: ...


class _Dispatched(NamedTuple):
    sampled: Any  # the first sampler's output
    logprobs: Any
    spans: tuple[scoring.PromptSpan, ...]
    prompt: Any  # the first prompt reduction's output
    history: Any = None  # the token history's table after the step; None: not touched


class StepExecutor:
    """Owns the runner, the step grid, the pool's load flags and the penalised requests' token
    history, and dispatches a step's programs over them: the inputs' patch of pending tokens,
    the forward's programs, the penalties where a request asks for them, a sampler, and
    the log-probability programs a step's requests ask for."""

    def __init__(self, runner: ModelRunner, grid: ShapeGrid, load_flags: jax.Array | None,
                 writes: WriteBacks | None, history: TokenHistory) -> None:
        self.runner, self.grid, self.load_flags = runner, grid, load_flags
        self.writes = writes  # the write-back gathers, compiled ahead too (None: no host tier)
        self.history = history

    def launch(self, batch: Batch, transfers: TransferStep,
               previous: jax.Array | None) -> Launched:
        """Starts the batch's loads and dispatches its forward and sampling. The loads start
        before the rest of the step's host work: a host hit waits for its last layer, so every
        host phase ahead of the copies adds to its TTFT when the load is the longer part. Only
        the first program's layers are queued before it is dispatched, the rest right after,
        so the GPU starts before the host has queued every copy. Waits for the device only
        where `start_loads` must issue a load something held back. `previous`: the sampled
        tokens of the step in flight, which feed this one's pending decode tokens."""
        gate = transfers.start_loads(batch.tickets, self.runner.first_layers)
        gated = any(not t.done() for t in batch.tickets)  # its loads had not all landed
        inputs = model_inputs(batch, self.grid, self.load_flags, gate)
        run = _Run(self.runner)
        out = self._dispatch(
            run, inputs, previous, lambda rows: [_sampler(batch, rows)],
            lambda rows: scoring.on_launch(batch, rows, inputs.shape.tokens),
            lambda rows: self.history.step_rows(batch.chunks, rows, self.grid.max_requests),
            between=transfers.finish_loads)
        self._keep(out)
        for row, chunk in enumerate(batch.chunks):
            if chunk.samples_token:
                chunk.request.pending_row = row
        return Launched(batch, out.sampled, run.started, gated, inputs.shape, out.logprobs,
                        out.spans, out.prompt)

    def pad(self, shape: StepShape) -> None:
        """Runs a step of `shape` whose every row is padding (it writes only the reserved
        padding page), with every sampler and log-probability program such a step or the next
        one can dispatch; a decode runs twice, without and with the patch of pending tokens."""
        sampled = self._every_variant(_Run(self.runner), shape, keep=True)
        jax.block_until_ready((sampled, self.history.table))

    def lower(self, shape: StepShape, lock: contextlib.AbstractContextManager,
              sampled_logprobs: bool = True, prompt_logprobs: bool = True) -> None:
        """Compiles every program `pad` runs for `shape`, typed as its real arguments are (the
        inputs' transfer runs: it is small), each compile under `lock`; without the flags,
        not the log-probability programs that another shape of the same request count
        (sampled tokens') or token count (a prefill's prompt rows) compiles."""
        (k, v) = self.runner.pool.layer_types()
        self._every_variant(_Lower(self.runner, k, v, lock), shape, sampled_logprobs,
                            prompt_logprobs)

    def gather_sizes(self) -> list[int]:
        """The write-back gathers' page counts (none without a host tier)."""
        return [] if self.writes is None else self.writes.gather_sizes()

    def lower_gather(self, size: int, lock: contextlib.AbstractContextManager) -> None:
        assert self.writes is not None
        _compiled(self.writes.lower_gather(size), lock)

    def _every_variant(self, programs: _Programs, shape: StepShape, sampled_logprobs: bool = True,
                       prompt_logprobs: bool = True, keep: bool = False) -> Any:
        """Every program of a step of `shape` through `programs`: the penalties' (with row
        writes and counts that change nothing), each sampler over the model's and the
        penalised logits, the log probabilities, and for a decode both inputs, unpatched then
        patched by the first's samples; with `keep` (programs called, not lowered), the token
        history's table each step returns is kept. Returns the last sampled tokens."""
        def samplers(rows: int) -> list[Sampler]:
            arrays = sampling_arrays([], [], rows)
            return [(greedy, (), {}), *((sample, arrays, {"filters": f}) for f in Filters)]

        def ask(rows: int) -> scoring.Asked:
            prompt = prompt_logprobs and not shape.decode
            return scoring.Asked(asked_ids([], rows) if sampled_logprobs else None, (),
                                 prompt_targets(shape.tokens) if prompt else None,
                                 PROMPT_REDUCTIONS if prompt else ())

        def penalties(rows: int) -> PenaltyRows:
            return self.history.padding(rows, self.grid.max_requests, write=True)

        sampled = None
        for patched in ((False, True) if shape.decode else (False,)):
            inputs = padding_inputs(shape, self.grid, self.load_flags, patched)
            out = self._dispatch(programs, inputs, sampled, samplers, ask, penalties,
                                 sample_raw=True)
            if keep:
                self._keep(out)
            sampled = out.sampled
        return sampled

    def _keep(self, out: _Dispatched) -> None:
        """Keeps the token history's table a step wrote (its programs take it donated)."""
        if out.history is not None:
            self.history.table = out.history

    def _dispatch(self, programs: _Programs, inputs: StepInputs, previous: Any,
                  samplers: Callable[[int], list[Sampler]],
                  ask: Callable[[int], scoring.Asked],
                  penalties: Callable[[int], PenaltyRows | None],
                  between: Callable[[], object] = lambda: None,
                  sample_raw: bool = False) -> _Dispatched:
        """The programs of one step, in order: the patch of pending tokens (fed by `previous`,
        the step before's samples), the forward's first program, `between` (the later layers'
        loads), the programs after it, where `penalties` gives rows the token history's row
        writes and the penalties (else none of their programs), the `samplers` (host arrays
        made for the logits' rows) over the penalised logits (with `sample_raw`, the warm-up's,
        over the model's too), the sampled tokens counted in the history, then the
        log-probability programs `ask` names (of the model's logits). The host arrays are made
        just before the program that takes them, so that the forward is dispatched first."""
        tokens = inputs.tokens
        if inputs.patches is not None:  # decode tokens sampled by the step still in flight
            tokens = programs.call(patch_tokens, tokens, *inputs.patches, previous)
        hidden = programs.first(tokens, inputs.meta)
        between()
        logits, rows = programs.rest(hidden, inputs.meta, inputs.last_index)
        penalty, history, sources = penalties(logits.shape[0]), None, [logits]
        if penalty is not None:
            history = self.history.table
            for slot, entries in penalty.writes:
                history = programs.call(write_row, history, slot, entries)
            packed = penalty.packed()  # a host array, as the samplers' (a transfer, no program)
            penalized = programs.call(penalize, logits, history, packed)
            sources = [logits, penalized] if sample_raw else [penalized]
        for source in sources:  # one, but for the warm-up's
            sampled = [programs.call(program, source, *arrays, rows=self.grid.max_requests,
                                     **options)
                       for program, arrays, options in samplers(logits.shape[0])][0]
        if penalty is not None:
            history = programs.call(count_sampled, history, packed, sampled)
        asked = ask(logits.shape[0])
        logprobs = None  # the asked ids as a host array: a transfer, no program
        if asked.token_ids is not None:
            logprobs = programs.call(token_logprobs, logits, sampled, asked.token_ids)
        prompt = None
        if asked.targets is not None:
            targets = jax.device_put(asked.targets, rows.sharding)  # (replicated over a mesh)
            prompt = [programs.head_rows(rows, targets, reduction)
                      for reduction in asked.reductions][0]
        return _Dispatched(sampled, logprobs, asked.spans, prompt, history)


def _sampler(batch: Batch, rows: int) -> Sampler:
    """The one sampler of a step: greedy where every request is, else the sampler with the
    cuts its sampled requests ask for (host arrays, passed as they are: a transfer, no
    program)."""
    params = [c.request.params for c in batch.chunks]
    if all(p.is_greedy for p in params):
        return greedy, (), {}
    steps = [c.sample_index or 0 for c in batch.chunks]
    return sample, sampling_arrays(params, steps, rows), {"filters": step_filters(params)}


class _Run:
    """Calls the programs: the forward through the runner, which keeps the pool's pages."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.started = 0.0  # when the forward's first program was dispatched

    def call(self, program: Callable[..., Any], *args: Any, **options: Any) -> Any:
        return program(*args, **options)

    def first(self, tokens: jax.Array, meta: AttentionMetadata) -> jax.Array:
        self.started = time.perf_counter()
        return self.runner.start(tokens, meta)

    def rest(self, hidden: jax.Array, meta: AttentionMetadata,
             last_index: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.runner.finish(hidden, meta, last_index)

    def head_rows(self, rows: jax.Array, targets: jax.Array,
                  reduction: scoring.Reduction) -> Any:
        return self.runner.programs.head_rows(rows, targets, reduction)


class _Lower:
    """Lowers and compiles the programs for their arguments' types (arrays, or the output
    types of programs compiled before), each once; returns output types. Touches no state."""

    def __init__(self, runner: ModelRunner, k: tuple[Any, ...], v: tuple[Any, ...],
                 lock: contextlib.AbstractContextManager) -> None:
        self.programs, self.k, self.v, self.lock = runner.programs, k, v, lock
        self._done: dict[object, Any] = {}  # outputs by program and argument types

    def call(self, program: Callable[..., Any], *args: Any, **options: Any) -> Any:
        return self._once((program, *sorted(options.items())), args, lambda: _compiled(
            program.lower(*args, **options), self.lock))  # type: ignore[attr-defined]

    def first(self, tokens: Any, meta: AttentionMetadata) -> Any:
        return self._once("first", (tokens, meta), lambda: _compiled(
            self.programs.lower_first(self.k, self.v, tokens, meta), self.lock))

    def rest(self, hidden: Any, meta: AttentionMetadata, last_index: Any) -> tuple[Any, Any]:
        def compile_rest() -> tuple[Any, Any]:
            *middles, lowered = self.programs.lower_rest(self.k, self.v, hidden, meta,
                                                         last_index)
            with self.lock:
                for middle in middles:
                    middle.compile()
                compiled = lowered.compile()
            # the logits, and the hidden state of every row (for `head_rows`)
            return output_type(lowered, compiled), output_type(lowered, compiled, 3)
        return self._once("rest", (hidden, meta, last_index), compile_rest)

    def head_rows(self, rows: Any, targets: Any, reduction: scoring.Reduction) -> Any:
        return self._once(("head_rows", reduction), (rows, targets), lambda: _compiled(
            self.programs.lower_head_rows(rows, targets, reduction), self.lock))

    def _once(self, program: object, args: tuple[Any, ...], compile: Callable[[], Any]) -> Any:
        leaves, tree = jax.tree.flatten(args)
        key = (program, tree, tuple(map(_type_key, leaves)))
        if key not in self._done:
            self._done[key] = compile()
        return self._done[key]


def _type_key(leaf: Any) -> object:
    """What a program is compiled for, of one argument: its type, with its sharding, and its
    kind: an array made on the host and put uncommitted (the inputs) is typed apart from a
    program's output type, as a call's committed output (pending tokens patched in by
    `patch_tokens`, say) is keyed apart from it in JAX's caches."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
        return (type(leaf), leaf.shape, str(leaf.dtype), getattr(leaf, "sharding", None),
                getattr(leaf, "weak_type", False))
    return leaf


def _compiled(lowered: jax.stages.Lowered,
              lock: contextlib.AbstractContextManager) -> jax.ShapeDtypeStruct:
    """Compiles `lowered` under `lock` (held by the shapes that compile one at a time); returns
    its output's type."""
    with lock:
        return output_type(lowered, lowered.compile())
