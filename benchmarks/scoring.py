"""The scoring bench: the TTFT of a prompt scored (the log probabilities of its tokens, what
`echo` with `logprobs` asks for) against the same length's plain prefill, nothing cached, in
process and through the server's /v1/completions as an evaluation harness sends it, from a
client process of its own (the engine in an engine process, as the server's command runs it, or
in a thread of the server's)."""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import sys
import time
import urllib.request
from typing import Any

import numpy as np

from benchmarks import cli, tables
from benchmarks.cli import sized
from benchmarks.rows import Rule, Target
from jhicache.async_engine import AsyncEngine
from jhicache.bench.clients import median_index
from jhicache.bench.compile_counter import CompileCounter
from jhicache.bench.engines import as_served, engine_spec, make_engine, warm_up_served
from jhicache.bench.remote import serving_compiles
from jhicache.bench.workload import random_prompts
from jhicache.engine import Engine
from jhicache.sampling import SamplingParams
from jhicache.serve.context import ServerContext
from jhicache.serve.thread import ServerThread
from jhicache.serve.tokenizer import Tokenizer

HTTP_TIMEOUT_S = 600.0


def _ttft(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
    """One request's (TTFT, end to end): the engine's TTFT, submission to its first token on the
    host (its prompt's log probabilities come in the same read), and the `generate` call's
    whole time, which adds what is done before the output is handed back (for a scored
    prompt, its last chunk's entries filled)."""
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    e2e = time.perf_counter() - start
    assert out.ttft_s is not None
    if params.prompt_logprobs is not None:
        assert out.prompt_logprobs is not None and out.prompt_logprobs[-1] is not None
    return out.ttft_s, e2e


def word_tokenizer(vocab: int) -> Tokenizer:
    """A tokenizer of `vocab` words, `w0`, `w1`...: each id one word between spaces, so that a
    prompt of random ids has a text that encodes back to those ids (the bench's random weights
    come without a tokenizer, and `echo` needs one)."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, None, {}, ())


def _post(url: str, body: dict) -> tuple[float, dict]:
    """POST /v1/completions: (seconds from the request's send to its whole body read, the
    body parsed)."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        data = response.read()
    return time.perf_counter() - start, json.loads(data)


def http_pairs(engine: AsyncEngine, rng: np.random.Generator, tokens: int, trials: int) -> dict:
    """`trials` pairs after a warm-up pair through a server over `engine` (warmed up; closed at
    the end), as lm-evaluation-harness's completions model asks for a log-likelihood: a text
    prompt with `echo`, `logprobs` 1 and one new token, against the same request without
    `echo` and `logprobs`; each request timed end to end by a client in a process of its own,
    as an evaluation harness is (`_client_pairs`). The server's process has its heap frozen
    once the server is built, as a server's is after its start. The pair with the median
    ratio, and every pair, with the programs the engine compiled in each."""
    vocab = engine.info.vocab_size
    texts = [(_words(plain), _words(scored)) for plain, scored  # the first: the server's first
             in (random_prompts(rng, vocab, 2, tokens) for _ in range(trials + 1))]
    ctx = ServerContext.create(engine, word_tokenizer(vocab), "bench", "bench")
    context = multiprocessing.get_context("spawn")  # no copy of this process's JAX state
    with ServerThread(ctx) as server, as_served(), \
            concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        pairs = pool.submit(_client_pairs, server.url, texts, tokens).result()[1:]
    ratios = [p["scored_over_prefill"] for p in pairs]
    median = median_index(ratios)
    return {**pairs[median], "trials": pairs, "median_trial": median}


def _words(prompt: list[int]) -> str:
    """The text of `prompt` in `word_tokenizer`'s words."""
    return " ".join(f"w{t}" for t in prompt)


def _client_pairs(url: str, texts: list[tuple[str, str]], tokens: int) -> list[dict]:
    """The client's side of `http_pairs`, one pair per (plain, scored) prompt text: each
    request's time, their ratio, and the server's compiles meanwhile (its /metrics); the
    scored body's log probabilities checked (one per token, the first null)."""
    pairs = []
    for plain, scored in texts:
        before = serving_compiles(url)
        if before is None:
            raise RuntimeError(f"the server at {url} does not report its compiles")
        plain_s, _ = _post(url, {"prompt": plain, "max_tokens": 1})
        scored_s, body = _post(url, {"prompt": scored, "max_tokens": 1, "echo": True,
                                     "logprobs": 1})
        after = serving_compiles(url)
        scores = body["choices"][0]["logprobs"]["token_logprobs"]
        if len(scores) != tokens + 1 or scores[0] is not None or None in scores[1:]:
            raise RuntimeError(f"the scored prompt came back with {len(scores)} log "
                               f"probabilities for {tokens} + 1 tokens")
        if after is None:
            raise RuntimeError(f"the server at {url} stopped reporting its compiles")
        pairs.append({"prefill_e2e_s": plain_s, "scored_e2e_s": scored_s,
                      "scored_over_prefill": scored_s / plain_s,
                      "compiles": int(after - before)})
    return pairs


def bench_scoring(args: argparse.Namespace) -> dict:
    """On an engine warmed up as a server's is, `--scoring-trials` pairs after a warm-up pair,
    each on fresh random prompts (nothing cached): a plain prefill, then the same length scored
    with one alternative per token, in process; then as many through the server
    (`http_pairs`), its engine in an engine process (`--scoring-server process`: this
    process's engine closed first) or this one in a thread. The pair with the median ratio,
    and every pair."""
    tokens = args.scoring_prompt
    overrides = {"cache_mode": "device", "device_kv_tokens": 2 * (tokens + 64)}
    rng = np.random.default_rng(args.seed + 3)
    engine = make_engine(args, **overrides)
    with as_served(engine):
        result = _pairs(engine, tokens, rng, args.scoring_trials)
    if args.scoring_server == "thread":  # warmed up; `http_pairs` freezes its server's heap
        return {**result, "http": http_pairs(AsyncEngine(engine), rng, tokens,
                                             args.scoring_trials), "server": "thread"}
    engine.close()
    del engine
    gc.collect()  # its device arrays freed before the engine process takes its own
    served = AsyncEngine(engine_spec(args, **overrides))
    try:
        warm_up_served(served)
        http = http_pairs(served, rng, tokens, args.scoring_trials)
    finally:
        served.close()
    return {**result, "http": http, "server": "process"}


def _pairs(engine: Engine, tokens: int, rng: np.random.Generator, count: int) -> dict:
    vocab = engine.model_config.vocab_size
    plain = SamplingParams(max_new_tokens=1)
    scored = SamplingParams(max_new_tokens=1, prompt_logprobs=1)
    trials = []
    for trial in range(count + 1):  # the first: the engine's first requests
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
    median = median_index(ratios)
    return {**trials[median], "prompt_tokens": tokens, "trials": trials, "median_trial": median}


def add_options(p: argparse.ArgumentParser, count: dict[str, Any]) -> None:
    """This bench's own options, beside `jhicache.bench`'s shared ones."""
    p.add_argument("--scoring-prompt", **sized(count, 8192, 256),
                   help="the prompt tokens scored, and prefilled for comparison")
    p.add_argument("--scoring-trials", **sized(count, 7, 1),
                   help="measured pairs (after a warm-up pair); the figures printed are the "
                        "median pair's by ratio")
    p.add_argument("--scoring-server", default="process", choices=("process", "thread"),
                   help="the server leg's engine in an engine process (as `python -m "
                        "jhicache.serve` runs it; this process's engine is closed first) or "
                        "this process's engine in a thread of the server's")


def page_row(args: argparse.Namespace, result: dict) -> tuple[str, Target]:
    return "scoring", Target("<= 1.1x each way", (
        Rule("ratio", "TTFT", at_most=1.1), Rule("e2e_ratio", "end to end", at_most=1.1),
        Rule("http_ratio", "server", at_most=1.1)))


def main(argv: list[str] | None = None) -> int:
    return cli.main("scoring", "scoring", __doc__ or "", argv, add_options,
                    lambda args, save: bench_scoring(args), tables.scoring_table, page_row,
                    own_device_memory=False)


if __name__ == "__main__":
    sys.exit(main())
