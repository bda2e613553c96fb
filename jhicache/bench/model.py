"""The model throughput bench (`model`): prefill and decode tokens/s with the cache off."""

from __future__ import annotations

import argparse

import jax
import numpy as np

from jhicache.bench.engines import make_engine
from jhicache.bench.workload import random_prompts
from jhicache.sampling import SamplingParams


def bench_model(args: argparse.Namespace) -> dict:
    """Prefill and decode tokens/s of the model alone (cache off), after a warm-up run."""
    prompt_len, batch = (512, 8) if jax.default_backend() == "gpu" else (64, 4)
    new_tokens = 32 if jax.default_backend() == "gpu" else 8
    engine = make_engine(args, cache_mode="off",
                         device_kv_tokens=4 * batch * (prompt_len + new_tokens + args.page_size))
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    engine.generate(random_prompts(rng, vocab, batch, prompt_len),
                    SamplingParams(max_new_tokens=new_tokens))
    before = engine.stats().as_dict()
    engine.generate(random_prompts(rng, vocab, batch, prompt_len),
                    SamplingParams(max_new_tokens=new_tokens))
    after = engine.stats().as_dict()
    delta = {k: after[k] - before[k] for k in ("computed_prompt_tokens", "prefill_forward_s",
                                               "decode_tokens", "decode_forward_s")}
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "prefill_tokens_per_s": delta["computed_prompt_tokens"] / delta["prefill_forward_s"],
        "decode_tokens_per_s": delta["decode_tokens"] / delta["decode_forward_s"],
    }
