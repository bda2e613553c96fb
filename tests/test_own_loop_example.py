"""examples/own_loop.py: the cache driven by a loop of its own (its model call, greedy sampling
and scheduling) gives our Engine's tokens on the same chats, with host hits, even where copies
land as late as they may, and leaves every page accounted for."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import jhicache.cache.cache_tiers as cache_tiers_module
from jhicache import Engine, EngineConfig, SamplingParams
from tests.cache._helpers import DeferredCopier

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_the_example_s_loop_gives_the_engine_s_tokens_with_host_hits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With copies that run only when waited for (on the CPU the load gate lands a step's
    loads before its forward): a loop whose forward ran before it started its loads, or a
    load that overtook a write-back, would fail here."""
    copier = DeferredCopier()
    monkeypatch.setattr(cache_tiers_module, "make_copier",
                        lambda platform, ordinals=(0,): (copier, []))
    example = _example()
    path = example.random_checkpoint(str(tmp_path))
    loop, histories = example.run(path)  # (it flushes and checks the page accounting)

    stats = loop.cache.stats()
    assert copier.copies > 0
    assert loop.host_hit_tokens > 0  # turns were loaded back from the host tier ...
    assert stats["write_back_ops"] > 0 and stats["load_back_ops"] > 0  # ... by the cache
    page_bytes = loop.tiers.device_pool.layout.page_bytes
    assert stats["load_back_bytes"] == loop.host_hit_tokens // example.PAGE * page_bytes
    pages = loop.cache.pages  # idle: nothing held, nothing locked
    assert pages.device_available == pages.device and stats["protected_tokens"] == 0

    engine = Engine.from_pretrained(path, EngineConfig(
        page_size=example.PAGE, device_kv_tokens=example.DEVICE_TOKENS,
        host_kv_tokens=example.HOST_TOKENS, dtype="float32"))
    params = SamplingParams(max_new_tokens=example.MAX_NEW)
    expected = example.converse(lambda prompt: engine.generate([prompt], params)[0].token_ids,
                                example.user_turns(engine.model_config.vocab_size))
    assert histories == expected
    assert engine.stats().host_hit_tokens > 0  # the same chats hit the Engine's host tier too
    engine.check_invariants()


def test_the_example_runs_as_a_script(tmp_path: Path, capsys) -> None:
    example = _example()
    example.main([example.random_checkpoint(str(tmp_path))])
    out = capsys.readouterr().out
    assert "loaded from host" in out and "host hits: 0 tokens" not in out
