"""benchmarks/logprobs_host_probe.py runs each of its steps on a small scored prompt."""

from __future__ import annotations

from benchmarks.scoring import word_tokenizer
from tests.scripts import load_script


def test_the_probe_times_every_step_of_a_scored_prompt() -> None:
    probe = load_script("benchmarks/logprobs_host_probe.py")
    tokenizer = word_tokenizer(300)
    tokenizer.decode_vocabulary()
    row = probe.timings(tokenizer, tokens=64, alternatives=3, seed=0, runs=1)
    steps = ("fill_ms", "wire_encode_ms", "wire_decode_ms", "format_ms", "json_ms")
    assert set(row) == {*steps, "total_ms", "body_bytes"}
    assert row["total_ms"] == sum(row[s] for s in steps) and row["body_bytes"] > 64
