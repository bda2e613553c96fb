"""Hypothesis state machine: random match / prefill / hold / finish / lock / evict / load-back /
write-back sequences on real tiny pools, checked against a reference model and by reading data."""

from __future__ import annotations

import os
from typing import NamedTuple

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jhicache.cache import Node, PrefixCache
from jhicache.config import WritePolicy
from tests.cache._helpers import DeferredCopier, assert_device_kv, expected_kv, make_cache, write_kv

BASES = [[b * 100 + i for i in range(12)] for b in range(3)]


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    """Prompts that share prefixes: a base prefix plus a short private tail."""
    base = draw(st.sampled_from(BASES))
    keep = draw(st.integers(0, 12))
    tail = draw(st.lists(st.integers(900, 902), max_size=4))
    return base[:keep] + tail


class Held(NamedTuple):
    """A running request: its locked node, its tokens and the pages it uses."""

    node: Node
    tokens: list[int]
    pages: list[int]
    own_from: int  # pages[own_from:] belong to the request, the rest to the tree


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache
        # model: every page-aligned prefix ever inserted
        self.inserted: set[tuple[int, ...]] = set()
        self.held: list[Held] = []
        self.locks: list[Node] = []
        self.prefills = 0

    @initialize(page=st.sampled_from([1, 4]), policy=st.sampled_from(list(WritePolicy)),
                host=st.sampled_from([None, 6, 12]), deferred=st.booleans())
    def setup(self, page: int, policy: WritePolicy, host: int | None, deferred: bool) -> None:
        self.page = page
        self.cache = make_cache(page, device_pages=16 // page, host_pages=host and host * 4 // page,
                                policy=policy, load_back_threshold=2 * page,
                                copier=DeferredCopier() if deferred else None)

    def _aligned(self, tokens: list[int]) -> list[int]:
        return tokens[:len(tokens) - len(tokens) % self.page]

    def _check_match(self, tokens: list[int]) -> None:
        m = self.cache.match(tokens)
        hit = tuple(tokens[:m.device_len + m.host_len])
        assert not hit or hit in self.inserted, "matched tokens that were never inserted"
        assert_device_kv(self.cache, tokens[:m.device_len], m.device_pages)

    @rule(tokens=prompts(), load=st.booleans())
    def hold(self, tokens: list[int], load: bool) -> None:
        """Admit a request: match, lock, maybe load back, allocate the rest, 'run the forward'."""
        tokens = self._aligned(tokens)
        m = self.cache.match(tokens)
        self.cache.lock(m.last_device_node)
        pages, node = list(m.device_pages), m.last_device_node
        ticket = self.cache.load_back(m) if load else None
        if ticket is not None:
            self.cache.unlock(node)
            node = m.last_node
            self.cache.lock(node)
            with self.cache.step() as transfers:
                transfers.start_loads([ticket])
            ticket.wait_all()  # as the forward does, layer by layer
            pages += ticket.device_pages
        new = self.cache.alloc_device(len(tokens) // self.page - len(pages))
        if new is None:
            self.cache.unlock(node)
        else:
            write_kv(self.cache, tokens, pages + new, len(pages) * self.page)
            self.held.append(Held(node, tokens, pages + new, len(pages)))

    @rule(tokens=prompts())
    def prefill(self, tokens: list[int]) -> None:
        """A whole request at once (load-back if possible), so the pools fill up quickly."""
        self._check_match(self._aligned(tokens))
        self.prefills += 1
        self.hold(tokens, True)
        if self.held and self.held[-1].tokens == self._aligned(tokens):
            self._finish(self.held.pop())

    # The same rule under more names: rules are drawn uniformly, and the pools must fill up
    # (evictions, write-backs, load-backs) within a short run.
    prefill_again = rule(tokens=prompts())(lambda self, tokens: self.prefill(tokens))
    prefill_more = rule(tokens=prompts())(lambda self, tokens: self.prefill(tokens))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10), commit=st.booleans())
    def finish(self, i: int, commit: bool) -> None:
        """Commit (insert) or abort a running request."""
        h = self.held.pop(i % len(self.held))
        if commit:
            self._finish(h)
        else:
            self.cache.free_device(h.pages[h.own_from:])
            self.cache.unlock(h.node)

    def _finish(self, h: Held) -> None:
        prefix = self.cache.insert(h.tokens, h.pages)
        dup_end = max(prefix // self.page, h.own_from)
        self.cache.free_device(h.pages[h.own_from:dup_end])
        self.cache.unlock(h.node)
        self.inserted.update(tuple(h.tokens[:n])
                             for n in range(self.page, len(h.tokens) + 1, self.page))

    @rule(tokens=prompts(), unlock=st.booleans())
    def lock_or_unlock(self, tokens: list[int], unlock: bool) -> None:
        if unlock and self.locks:
            self.cache.unlock(self.locks.pop())
        elif not unlock:
            self.locks.append(self.cache.match(self._aligned(tokens)).last_device_node)
            self.cache.lock(self.locks[-1])

    @rule(n=st.integers(0, 30), host=st.booleans())
    def evict(self, n: int, host: bool) -> None:
        if host:
            if self.cache.host is not None:
                self.cache._evict_host(n)
            return
        before = self.cache.device.pages.num_free
        freed = self.cache.evict_device(n)
        assert self.cache.device.pages.num_free == before + freed

    @rule()
    def step(self) -> None:  # what an engine step does with the cache's copies
        with self.cache.step():
            pass

    @rule()
    def flush_and_verify_all(self) -> None:
        """Every node's device and host pages hold its tokens' KV."""
        self.cache.flush()
        for node in self.cache.tree.nodes():
            path, n = [], node
            while n.parent is not None:
                path[:0] = n.key
                n = n.parent
            start = (len(path) - len(node.key)) // self.page
            for layer in range(2):
                ek, _ = expected_kv(path, layer, self.page)
                for pool, pages in ((self.cache.device_pool, node.device_pages),
                                    (self.cache.host_pool, node.host_pages)):
                    if pages is not None and pool is not None:
                        np.testing.assert_array_equal(pool.read_pages(layer, pages)[0], ek[start:])

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "cache"):
            held = [p for h in self.held for p in h.pages[h.own_from:]]
            self.cache.check_invariants(extra_owned_device_pages=held)

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            for h in self.held:
                self.cache.free_device(h.pages[h.own_from:])
                self.cache.unlock(h.node)
            for node in self.locks:
                self.cache.unlock(node)
            self.cache.flush()
            self.cache.check_invariants()
            assert self.cache.tree.protected_pages == 0
            stats = self.cache.stats()
            event(f"prefills: {min(self.prefills, 10)}")
            for key in ("load_back_ops", "write_back_ops", "dropped_nodes", "evicted_host_tokens"):
                event(f"{key} > 0: {stats.get(key, 0) > 0}")


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CACHE_FUZZ_EXAMPLES", "60")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestCacheMachine = CacheMachine.TestCase
