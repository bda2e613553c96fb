"""EngineStats is one typed record with no hidden name collisions; EngineConfig needs no JAX."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from jhicache import EngineStats, SamplingParams
from tests.test_engine import make_engine


def test_stats_record_holds_each_source_counter_once() -> None:
    engine = make_engine()
    engine.generate([[1, 2, 3] * 10], SamplingParams(max_new_tokens=3))
    sources = [engine.counters.as_dict(), engine.scheduler.counters, engine.cache.stats()]
    names = [name for source in sources for name in source]
    assert len(names) == len(set(names)), "two sources share a counter name"
    compiles = {"compiles_warmup", "compiles_serving"}  # the engine's CompileWatch's
    assert set(names) | compiles == {f.name for f in dataclasses.fields(EngineStats)}
    stats = engine.stats()
    assert stats.decode_tokens == 2 and stats.as_dict()["computed_prompt_tokens"] == 30


def test_engine_config_and_its_enums_import_no_jax() -> None:
    code = ("import sys\nfrom jhicache.config import EngineConfig, CacheMode, WritePolicy\n"
            "EngineConfig(cache_mode='device', write_policy='write_through')\n"
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
