"""The prefix cache's surface stays narrow: at most 15 public methods, and no module outside
`jhicache/cache/` (nor a benchmark, nor an example of the cache in another loop) reaches into
its parts: its tiers, pools, transfers, storage or tree."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from jhicache.cache import PrefixCache

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tree", "device", "host", "device_pool", "host_pool", "transfers", "storage")
REACH = re.compile(rf"\bcache\.(?:{'|'.join(PARTS)}|_\w+)\b")


def _public_methods() -> list[str]:
    return [name for name, member in inspect.getmembers(PrefixCache)
            if not name.startswith("_") and inspect.isfunction(member)]


def test_the_prefix_cache_has_at_most_fifteen_public_methods() -> None:
    methods = _public_methods()
    assert "fetch_progress" not in methods and "clear_storage" not in methods
    assert len(methods) <= 15, methods


def test_nothing_outside_the_cache_package_reaches_into_its_parts() -> None:
    outside = [p for folder in ("jhicache", "benchmarks", "examples")
               for p in (ROOT / folder).rglob("*.py")
               if "cache" not in p.relative_to(ROOT).parts[1:-1]]
    reaches = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in outside
               for n, line in enumerate(p.read_text().splitlines(), 1)
               if REACH.search(line) and "import" not in line and "`" not in line]
    assert not reaches, reaches


def test_the_reach_pattern_finds_a_reach() -> None:
    assert REACH.search("writes = cache.transfers.writes")
    assert REACH.search("self.cache._alloc_host(3)")
    assert not REACH.search("self.cache.fetches.gate(rid)")
