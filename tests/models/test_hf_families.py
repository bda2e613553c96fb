"""Every family against Hugging Face transformers: the checkpoints under hf_reference/ (made
with transformers' own classes) load through our loader, and give its logits and its greedy
tokens through the engine, in every cache mode, with host hits, chunked prefill, overlap on
and off, and through the server with the family's chat template. Tensor parallelism:
tests/tensor_parallel_checks.py's hf_families check."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from jhicache.models import (
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    build_metadata,
    family_of_config,
    forward_apply,
    init_kv_pages,
    pack_tokens,
)

from tests.models.hf_references import (
    CASES,
    HOST,
    ROOT,
    engine,
    model,
    reference,
    replay,
)

CONFIGS = {"qwen3": Qwen3Config, "llama3": LlamaConfig, "llama3-tied": LlamaConfig,
           "qwen2": Qwen2Config}
PAGE_SIZE = 8


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(name: str) -> None:
    m, ref = model(name), reference(name)
    assert type(m.config) is CONFIGS[name]
    assert family_of_config(m.config).architecture == ref["architecture"]
    prompt = ref["prompt"]
    pages = -(-len(prompt) // PAGE_SIZE)
    meta = build_metadata([0], [len(prompt)], [list(range(1, pages + 1))], page_size=PAGE_SIZE,
                          num_tokens=len(prompt), num_reqs=1, max_pages=pages)
    graphdef, state = nnx.split(m)
    logits, _ = forward_apply(graphdef, state, pack_tokens([prompt], meta.num_tokens),
                              init_kv_pages(m.config, pages + 1, PAGE_SIZE), meta)
    want = np.load(ROOT / name / "logits.npy")
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    assert (np.asarray(logits).argmax(-1) == want.argmax(-1)).all()


# One engine a configuration, few of them: cache off with prompts in 32-token chunks and no
# overlap; the device cache; host and device tiers with load-backs, overlapped (Qwen3's: the
# warm-up test's). The tied Llama differs from the untied one only in its head: the
# hierarchical run alone.
ENGINE_RUNS = [("qwen3", "off-chunked-serial"), ("qwen3", "device"),
               ("llama3", "off-chunked-serial"), ("llama3", "device"), ("llama3", "hierarchical"),
               ("llama3-tied", "hierarchical")]


@pytest.mark.parametrize("name, mode", ENGINE_RUNS)
def test_engine_greedy_tokens_match_transformers(name: str, mode: str) -> None:
    overrides = {"off-chunked-serial": dict(cache_mode="off", chunked_prefill_tokens=32,
                                            overlap_schedule=False),
                 "device": dict(cache_mode="device"), "hierarchical": HOST}[mode]
    eng = engine(name, **overrides)
    assert replay(eng, name) == reference(name)["replies"]
    if mode == "hierarchical":
        stats = eng.stats()
        assert stats.load_back_ops > 0 and stats.host_hit_tokens > 0
    eng.close()


def test_after_warmup_a_family_serves_with_host_hits_without_compiling() -> None:
    """Qwen3's layers (q/k norms, head_dim 32 over hidden 64) warm up like Qwen2's: a small
    grid's programs all compiled by warmup(), then its conversations, with host hits, give
    transformers' tokens and compile nothing."""
    eng = engine("qwen3", **HOST, chunked_prefill_tokens=64, max_running_requests=3,
                 fail_on_compile=True)
    report = eng.warmup(progress=False)
    assert report.compiles > 0
    assert replay(eng, "qwen3") == reference("qwen3")["replies"]
    stats = eng.stats()
    assert stats.compiles_serving == 0  # fail_on_compile would have raised already
    assert stats.load_back_ops > 0 and stats.host_hit_tokens > 0
    eng.close()


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_server_chat_with_the_family_template_matches_transformers(name: str) -> None:
    """The checkpoint's tokenizer and chat template (ChatML for Qwen, Llama 3's header tokens),
    as transformers rendered and tokenized them, and its greedy reply."""
    httpx = pytest.importorskip("httpx")  # the serve extra's
    from tests.serve_support import TIMEOUT_S, start_server

    ref = reference(name)
    server = start_server(ROOT / name)
    try:
        body = {"messages": ref["chat"], "max_tokens": len(ref["chat_reply"]), "temperature": 0}
        got = httpx.post(server.url + "/v1/chat/completions", json=body,
                         timeout=TIMEOUT_S).json()
    finally:
        server.stop()
    assert got["usage"]["prompt_tokens"] == len(ref["chat_prompt"])
    assert got["usage"]["completion_tokens"] == len(ref["chat_reply"])
    assert got["choices"][0]["message"]["content"] == ref["chat_text"]
