"""Reference logits processors in numpy, one row at a time, written from the documented
semantics of Hugging Face transformers' processors and warpers (torch and transformers are not
installed here) and OpenAI's penalty formula: what the engine's penalties and sampler are
checked against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jhicache import SamplingParams


def repetition(scores: np.ndarray, input_ids: Sequence[int], penalty: float) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: each token of `input_ids` (prompt and generated) has
    its score multiplied by `penalty` where negative, divided by it otherwise."""
    out = scores.copy()
    ids = np.unique(np.asarray(input_ids, np.int64))
    score = scores[ids]
    out[ids] = np.where(score < 0, score * penalty, score / penalty)
    return out


def openai_penalties(scores: np.ndarray, generated: Sequence[int], presence: float,
                     frequency: float) -> np.ndarray:
    """OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c the counts of the tokens
    generated so far."""
    counts = np.bincount(np.asarray(generated, np.int64), minlength=scores.shape[0])
    return scores - frequency * counts - presence * (counts > 0)


def min_new_tokens(scores: np.ndarray, new_tokens: int, minimum: int,
                   eos_ids: Sequence[int]) -> np.ndarray:
    """MinNewTokensLengthLogitsProcessor: the EOS ids get -inf while fewer than `minimum` new
    tokens precede."""
    out = scores.copy()
    if new_tokens < minimum and len(eos_ids):
        out[np.asarray(eos_ids, np.int64)] = -np.inf
    return out


def _softmax(scores: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - np.max(scores))
    return e / e.sum()


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """TopKLogitsWarper: scores below the k-th largest become -inf."""
    k = min(max(k, 1), scores.shape[0])
    kth = np.sort(scores)[::-1][k - 1]
    return np.where(scores < kth, -np.inf, scores)


def top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """TopPLogitsWarper: sorted ascending, the tokens whose cumulative probability is at most
    1 - p are removed (the likeliest always kept)."""
    order = np.argsort(scores, kind="stable")
    cumulative = np.cumsum(_softmax(scores[order]))
    remove = cumulative <= 1 - p
    remove[-1] = False
    out = scores.copy()
    out[order[remove]] = -np.inf
    return out


def min_p(scores: np.ndarray, p: float) -> np.ndarray:
    """MinPLogitsWarper: tokens whose probability is below p times the largest are removed
    (the likeliest always kept)."""
    probs = _softmax(scores)
    remove = probs < p * probs.max()
    remove[np.argmax(scores)] = False
    return np.where(remove, -np.inf, scores)


def processed(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
              generated: Sequence[int]) -> np.ndarray:
    """A row's logits after the processors, in the engine's order: repetition penalty (Hugging
    Face's, over prompt and output), OpenAI's frequency and presence penalties, min_tokens's
    hold on the stop ids (HF's min_new_tokens), then for a sampled row temperature, top-k,
    top-p and min-p (HF's warpers, in generate's order)."""
    scores = logits.astype(np.float64)
    if params.repetition_penalty != 1:
        scores = repetition(scores, [*prompt, *generated], params.repetition_penalty)
    scores = openai_penalties(scores, generated, params.presence_penalty,
                              params.frequency_penalty)
    scores = min_new_tokens(scores, len(generated), params.min_tokens, params.stop_token_ids)
    if params.is_greedy:
        return scores
    scores = scores / params.temperature
    if params.top_k is not None:
        scores = top_k(scores, params.top_k)
    if params.top_p is not None:
        scores = top_p(scores, params.top_p)
    if params.min_p:
        scores = min_p(scores, params.min_p)
    return scores


def probabilities(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
                  generated: Sequence[int]) -> np.ndarray:
    """The distribution a sampled row draws its next token from."""
    return _softmax(processed(logits, params, prompt, generated))


def greedy_next(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
                generated: Sequence[int]) -> int:
    return int(np.argmax(processed(logits, params, prompt, generated)))
