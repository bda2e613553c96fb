"""What the host does with a scored prompt's log probabilities once the device has computed
them, step by step, on this machine's CPU: the engine's fill of the request's columns, the
engine process's wire (the child's encode and the parent's decode of the output), the
/v1/completions `logprobs` object (echo, every prompt token's text and alternatives, its
columns written as JSON as they are built) and the body around it. Each is the fastest of
several runs, in milliseconds.

    PYTHONPATH=. python3 benchmarks/logprobs_host_probe.py [--tokens 8192] --out FILE.json

The token texts come from a word-per-id tokenizer of the preset's vocabulary, decoded at start
as a server's is (the scoring bench's, `benchmarks.scoring.word_tokenizer`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import msgspec
import numpy as np
from jhicache.models.presets import PRESETS

from benchmarks.scoring import word_tokenizer
from jhicache.bench.command import save_json
from jhicache.engine_process import Outputs, child_encoder, parent_decoder
from jhicache.logprobs import MAX_LOGPROBS, MAX_TOKEN_IDS, PromptLogprobs, TokenLogprob
from jhicache.request import RequestOutput
from jhicache.serve.logprobs import completion_logprobs, token_texts
from jhicache.serve.protocol import json_bytes
from jhicache.serve.tokenizer import Tokenizer

RUNS = 15


def fastest_ms(work: Callable[[], object], runs: int = RUNS) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def timings(tokenizer: Tokenizer, tokens: int, alternatives: int, seed: int,
            runs: int = RUNS) -> dict[str, float]:
    """One scored prompt of `tokens` random tokens with `alternatives` per position: each
    step's fastest time, and the body's size."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    prompt = PromptLogprobs.empty(rng.integers(0, vocab, tokens).tolist(), alternatives)
    rows = tokens - 1  # position 0 has no entry
    chosen = rng.normal(size=rows).astype(np.float32)
    values = rng.normal(size=(rows, MAX_LOGPROBS)).astype(np.float32)
    ids = rng.integers(0, vocab, (rows, MAX_LOGPROBS)).astype(np.int32)
    asked = np.zeros((rows, MAX_TOKEN_IDS), np.float32)  # none named
    out: dict[str, float] = {"fill_ms": fastest_ms(
        lambda: prompt.fill(1, chosen, values, ids, asked), runs)}
    output = RequestOutput("probe", [1], True, tokens, 0, 0, None, "length", token_ids=[1],
                           prompt_logprobs=prompt)
    encoder, decoder = child_encoder(), parent_decoder()
    wire = encoder.encode(Outputs([output]))
    out["wire_encode_ms"] = fastest_ms(lambda: encoder.encode(Outputs([output])), runs)
    out["wire_decode_ms"] = fastest_ms(lambda: decoder.decode(wire), runs)
    texts = token_texts(tokenizer)
    generated = [TokenLogprob(1, -1.0, [(1, -1.0)] * alternatives)]
    logprobs = completion_logprobs(prompt, generated, texts).value()
    scores = msgspec.json.decode(logprobs["token_logprobs"])
    if len(scores) != tokens + 1 or scores[0] is not None or None in scores[1:]:
        raise RuntimeError(f"{len(scores)} log probabilities formatted for {tokens} + 1 tokens")
    out["format_ms"] = fastest_ms(
        lambda: completion_logprobs(prompt, generated, texts).value(), runs)
    body = {"choices": [{"index": 0, "text": "", "logprobs": logprobs}]}
    out["json_ms"] = fastest_ms(lambda: json_bytes(body), runs)
    out["total_ms"] = sum(out.values())
    out["body_bytes"] = len(json_bytes(body))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-7b", choices=tuple(PRESETS))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tokenizer = word_tokenizer(PRESETS[args.preset].vocab_size)
    tokenizer.decode_vocabulary()
    res: dict = {"preset": args.preset, "tokens": args.tokens, "by_alternatives": {}}
    for alternatives in (1, 5):
        row = timings(tokenizer, args.tokens, alternatives, seed=alternatives)
        res["by_alternatives"][str(alternatives)] = row
        print(f"{alternatives} alternative(s): " + ", ".join(
            f"{k} {v:.2f}" if k.endswith("_ms") else f"{k} {v}" for k, v in row.items()),
            flush=True)
    save_json(res, args.out)


if __name__ == "__main__":
    main()
