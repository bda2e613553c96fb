"""Hypothesis state machine over three tiers: the two-tier machine's rules plus storage fetches
(completed or aborted) and flushes of the device and host tiers, on a real file storage. Pages
read back from storage must hold their prefix's KV (the data check reads every node's pages),
and the page accounting of all three tiers holds after every rule. At the end the cache is
closed: every page of the tree is then stored, with its prefix's KV, whatever the policies."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import initialize, precondition, rule

from jhicache.cache import DevicePool, HostPool, PoolLayout, PrefixCache, Transfers
from jhicache.cache.file_storage import FileStorage
from jhicache.cache.storage import StorageNamespace
from jhicache.config import StorageWritePolicy, TransferTuning, WritePolicy
from tests.cache._helpers import HEAD_DIM, HEADS, LAYERS, DeferredCopier, expected_kv
from tests.cache.test_stateful import CacheMachine, prompts


class StorageMachine(CacheMachine):
    @initialize(page=st.sampled_from([1, 4]), policy=st.sampled_from(list(WritePolicy)),
                host=st.sampled_from([6, 12]), deferred=st.booleans(),
                storage_policy=st.sampled_from(list(StorageWritePolicy)))
    def setup(self, page: int, policy: WritePolicy, host: int, deferred: bool,
              storage_policy: StorageWritePolicy) -> None:
        self._setup(page, policy, host, deferred, storage_policy)

    def _setup(self, page: int, policy: WritePolicy, host: int, deferred: bool,
               storage_policy: StorageWritePolicy) -> None:
        self.page, self.root = page, tempfile.mkdtemp(prefix="jhicache-storage-")
        device = PoolLayout(LAYERS, 16 // page + 1, page, HEADS, HEAD_DIM, jnp.float32)
        host_pool = HostPool(dataclasses.replace(device, num_pages=host * 4 // page))
        namespace = StorageNamespace(model="stateful", dtype="float32", page_size=page,
                                     layout="test", page_bytes=device.page_bytes)
        storage = FileStorage(self.root, namespace, host_pool.page_views)
        pool = DevicePool(device)
        transfers = (Transfers(pool, host_pool, DeferredCopier(), TransferTuning())
                     if deferred else None)
        self.cache = PrefixCache(page, pool, host_pool, policy, load_back_threshold=2 * page,
                                 transfers=transfers, storage=storage,
                                 storage_policy=storage_policy)
        event(f"storage policy: {storage_policy.value}")
        self.fetched = 0
        self.damaged = False  # a page file was damaged: a read may stop short of the end

    @rule(tokens=prompts(), abort=st.booleans(), clear_first=st.booleans(),
          tail=st.none() | st.integers(0, 2))
    def fetch(self, tokens: list[int], abort: bool, clear_first: bool,
              tail: int | None = None) -> None:
        """A waiting request reads its pages past its cached prefix from storage, to the end
        (then they are host pages of the tree), or is aborted midway; maybe after a flush.
        With `tail`, it reads from the last page, and takes the pages from `tail` pages past
        the first on (a prefix not cached then: the tree takes none of them)."""
        if clear_first and not self.held and not self.locks:
            self.clear()
        tokens = self._aligned(tokens) + [999]  # the last token is left to compute
        match = self.cache.match(tokens, leave_last=True)
        fetch = self.cache.fetches.start(tokens, match, self.page, from_tail=tail is not None)
        if fetch is None:
            return
        got = None
        while got is None:
            if abort:
                self.cache.fetches.end(fetch, None)
                break
            self.cache.fetches.wait(1.0)
            self.cache.flush()  # copies into its pages end (an idle engine's step flushes)
            got = self.cache.fetches.advance(fetch, tokens, self.page, stop=False)
            if got is None and tail is not None and fetch.finished:
                got = self.cache.fetches.end(fetch, tokens, fetch.first_page + tail)
                assert tail or self.damaged or got == len(fetch.host_pages) * self.page
        if got:
            self.fetched += got
            self._check_match(tokens[:-1])
            self.flush_and_verify_all()  # the pages read hold their prefix's KV

    # more names for the same rule, so that runs fetch often (rules are drawn uniformly)
    fetch_again = rule(tokens=prompts(), abort=st.booleans(), clear_first=st.booleans(),
                       tail=st.none() | st.integers(0, 2))(
        lambda self, tokens, abort, clear_first, tail: self.fetch(tokens, abort, clear_first,
                                                                  tail))
    fetch_more = rule(tokens=prompts(), abort=st.booleans(), clear_first=st.booleans())(
        lambda self, tokens, abort, clear_first: self.fetch(tokens, abort, clear_first))

    @precondition(lambda self: not self.held and not self.locks)
    @rule()
    def clear(self) -> None:
        """A flush of the device and host tiers; storage keeps its pages."""
        self.cache.clear()
        assert not list(self.cache.tree.nodes())

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            super().teardown()
            stats = self.cache.stats()
            event(f"storage pages fetched > 0: {stats['storage_fetched_pages'] > 0}")
            event(f"storage backups > 0: {stats['storage_backup_pages'] > 0}")
            assert self.cache.storage is not None
            self._waiting(self.cache.close)  # every page of the tree is written to storage
            self._check_stored()
            shutil.rmtree(self.root, ignore_errors=True)

    def _waiting(self, call: Callable[[], object]) -> object:
        """Runs `call`, which may wait on storage (the storage tier's threads run its tasks)."""
        return call()

    def _check_stored(self) -> None:
        """Every node's pages are stored where the host pool exceeds the device pool's (as
        an engine's must: a page only on device goes to storage through a host page), and
        each page stored (read back from a new FileStorage on the directory, as a restart
        would) holds its prefix's KV, unless a page file was damaged."""
        backend = self.cache.storage.storage  # type: ignore[union-attr]
        assert isinstance(backend, FileStorage) and self.cache.host is not None
        tree = self.cache.tree
        nodes = list(tree.nodes())
        if self.cache.host.capacity > self.cache.device.capacity:
            assert all(backend.contains(k) for n in nodes for k in tree.page_keys(n))
        if self.damaged or not nodes:
            return
        layout = self.cache.host_pool.layout  # type: ignore[union-attr]
        pool = HostPool(dataclasses.replace(layout, num_pages=1))
        again = FileStorage(self.root, backend.namespace, pool.page_views)
        for node in nodes:
            path, n = [], node
            while n.parent is not None:
                path[:0] = n.key
                n = n.parent
            start = (len(path) - len(node.key)) // self.page
            for i, key in enumerate(tree.page_keys(node)):
                if not backend.contains(key):
                    continue
                assert again.get([key], [0]) == 1
                for layer in range(LAYERS):
                    ek, ev = expected_kv(path, layer, self.page)
                    k, v = pool.read_pages(layer, [0])
                    np.testing.assert_array_equal(k[0], ek[start + i])
                    np.testing.assert_array_equal(v[0], ev[start + i])
        again.close()
        pool.close()


StorageMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CACHE_FUZZ_EXAMPLES", "30")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestStorageMachine = StorageMachine.TestCase
