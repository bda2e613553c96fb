"""Inputs: the checks a submitted prompt, its SamplingParams and its request id pass before an
engine queues anything (a bad value raises `ValueError` naming its prompt)."""

from __future__ import annotations

import array
import numbers
from collections.abc import Container, Sequence
from typing import NamedTuple

import numpy as np

from jhicache.sampling import SamplingParams


class Limits(NamedTuple):
    """What an engine admits: token ids below `vocab_size`, and requests (prompt and
    max_new_tokens) of `max_context_len` tokens at most."""

    vocab_size: int
    max_context_len: int


def checked_prompts(prompts: object, params: SamplingParams | Sequence[SamplingParams],
                    limits: Limits) -> tuple[list[np.ndarray], list[SamplingParams]]:
    """Every prompt as a 1-D int64 token array, with its SamplingParams, each checked."""
    arrays = prompt_arrays(prompts)
    per_prompt = per_prompt_params(arrays, params)
    for i, (prompt, p) in enumerate(zip(arrays, per_prompt)):
        validate(f"prompt {i}", prompt, p, limits)
    return arrays, per_prompt


def checked_prompt(prompt: object, params: SamplingParams, limits: Limits) -> np.ndarray:
    """One prompt as a 1-D int64 token array, checked with its SamplingParams."""
    tokens = token_array("prompt", prompt)
    validate("prompt", tokens, params, limits)
    return tokens


def per_prompt_params(prompts: Sequence[object], params: object) -> list[SamplingParams]:
    """`params` for each prompt: one SamplingParams for all, or a list with one per prompt."""
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ValueError("params must be SamplingParams or a list of them, "
                         f"got {type(params).__name__}")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    return params


def request_ids(given: Sequence[str] | None, count: int,
                unfinished: Container[str]) -> list[str | None]:
    """The ids of `count` prompts: those `given` (checked as `check_ids` does), or None each
    (the engine names them)."""
    if given is None:
        return [None] * count
    if len(given) != count:
        raise ValueError(f"got {len(given)} request ids for {count} prompts")
    ids: list[str | None] = list(given)
    check_ids(ids, unfinished)
    return ids


def check_ids(ids: Sequence[str | None], unfinished: Container[str]) -> None:
    """Named request ids must be non-empty strs, none `unfinished`, none repeated."""
    named = [rid for rid in ids if rid is not None]
    for rid in named:
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={rid!r}: expected a non-empty str")
        if rid in unfinished:
            raise ValueError(f"request_id={rid!r} is already queued")
    if len(set(named)) != len(named):
        raise ValueError("request ids repeat")


def validate(where: str, tokens: np.ndarray, params: SamplingParams, limits: Limits) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params for {where} must be SamplingParams, "
                         f"got {type(params).__name__}")
    if len(tokens) == 0:
        raise ValueError(f"{where} is empty")
    vocab = limits.vocab_size
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
    if total > limits.max_context_len:
        raise ValueError(f"{where}: prompt + max_new_tokens = {total} exceeds the context "
                         f"limit ({limits.max_context_len} tokens: the least of the "
                         f"model's context, the device pool and max_context_len)")


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
    return [token_array(f"prompt {i}", p) for i, p in enumerate(prompts)]


def token_array(where: str, prompt: object) -> np.ndarray:
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
