"""The scoring bench: the TTFT of a prompt scored (the log probabilities of its tokens, what
`echo` with `logprobs` asks for) against the same length's plain prefill, nothing cached."""

from __future__ import annotations

import argparse
import time

import numpy as np

from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import make_engine
from jhicache.bench.workload import random_prompts
from jhicache.engine import Engine
from jhicache.sampling import SamplingParams


def _ttft(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
    """One request's (TTFT, end to end): the engine's TTFT, submission to its first token on the
    host (its prompt's log probabilities come in the same read), and the `generate` call's
    whole time, which adds what is done before the output is handed back (for a scored
    prompt, a record per token)."""
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    e2e = time.perf_counter() - start
    assert out.ttft_s is not None
    if params.prompt_logprobs is not None:
        assert out.prompt_logprobs is not None and out.prompt_logprobs[-1] is not None
    return out.ttft_s, e2e


def bench_scoring(args: argparse.Namespace) -> dict:
    """`--scoring-trials` pairs after a warm-up pair, each on fresh random prompts (nothing
    cached): a plain prefill, then the same length scored with one alternative per token. The
    pair with the median ratio, and every pair."""
    tokens = args.scoring_prompt
    engine = make_engine(args, cache_mode="device", device_kv_tokens=2 * (tokens + 64))
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed + 3)
    plain = SamplingParams(max_new_tokens=1)
    scored = SamplingParams(max_new_tokens=1, prompt_logprobs=1)
    trials = []
    for trial in range(args.scoring_trials + 1):  # the first compiles the shapes it meets
        first, second = random_prompts(rng, vocab, 2, tokens)
        with CompileCounter() as compiles:
            prefill_s, prefill_e2e_s = _ttft(engine, first, plain)
            scored_s, scored_e2e_s = _ttft(engine, second, scored)
        if trial:
            trials.append({"prefill_ttft_s": prefill_s, "scored_ttft_s": scored_s,
                           "scored_over_prefill": scored_s / prefill_s,
                           "prefill_e2e_s": prefill_e2e_s, "scored_e2e_s": scored_e2e_s,
                           "scored_over_prefill_e2e": scored_e2e_s / prefill_e2e_s,
                           "compiles": compiles.count})
    ratios = [t["scored_over_prefill"] for t in trials]
    median = sorted(range(len(trials)), key=ratios.__getitem__)[(len(trials) - 1) // 2]
    return {**trials[median], "prompt_tokens": tokens, "trials": trials, "median_trial": median}
