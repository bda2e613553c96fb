"""The Hugging Face reference checkpoints (tests/models/hf_reference/, written by
make_hf_references.py): their recorded transformers outputs, and the replay of their multi-turn
conversations through an Engine."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jhicache.models import CausalLM, load_pretrained

from jhicache import Engine, EngineConfig, SamplingParams

ROOT = Path(__file__).resolve().parent / "hf_reference"
# Each family's checkpoint; llama3: scaled RoPE, untied; llama3-tied: default RoPE, tied
FAMILY_CASES = ("qwen3", "llama3", "llama3-tied")
CASES = FAMILY_CASES + ("qwen2",)
# 3 conversations of 3 turns of 40 tokens (+4 output): 396 tokens over a 192-token device pool,
# so earlier turns are evicted to host and loaded back
ENGINE = dict(page_size=16, device_kv_tokens=192, dtype="float32",
              check_invariants_every_step=True, max_running_requests=8)
HOST = dict(cache_mode="hierarchical", host_kv_tokens=640, load_back_threshold=1)


@functools.cache
def reference(name: str) -> dict[str, Any]:
    """transformers' recorded outputs for checkpoint `name` (see make_hf_references.py)."""
    data: dict[str, Any] = json.loads((ROOT / name / "reference.json").read_text())
    return data


@functools.cache
def model(name: str) -> CausalLM:
    """The checkpoint through our loader, float32 (one load per test process)."""
    return load_pretrained(ROOT / name, dtype=jnp.float32)


def engine(name: str, **overrides: Any) -> Engine:
    return Engine(model(name), EngineConfig(**{**ENGINE, **overrides}))


def replay(eng: Engine, name: str) -> list[list[list[int]]]:
    """The reference's conversations through `eng`, all clients' turns of a round batched:
    each client's greedy replies per round (to compare with `reference(name)["replies"]`)."""
    ref = reference(name)
    turns, output = ref["turns"], len(ref["replies"][0][0])
    histories: list[list[int]] = [[] for _ in turns]
    replies: list[list[list[int]]] = [[] for _ in turns]
    for r in range(len(turns[0])):
        for client, history in enumerate(histories):
            history += turns[client][r]
        outputs = eng.generate([list(h) for h in histories],
                               SamplingParams(max_new_tokens=output))
        for client, out in enumerate(outputs):
            replies[client].append(list(out.token_ids))
            histories[client] += out.token_ids
    return replies
