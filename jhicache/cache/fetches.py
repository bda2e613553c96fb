"""Fetches: the storage reads the prefix cache runs for requests, keyed by request id: started
when a request arrives, moved on by the cache's step as the fetch rule says, asked at admission
how far the request may compute; and the hits by tier a request is admitted with."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from jhicache.cache.page_keys import ROOT_KEY, chain_keys
from jhicache.cache.radix_tree import MatchResult, Node, RadixTree
from jhicache.cache.storage_tier import FetchState, StorageFetch, StorageTier
from jhicache.cache.tiers import HostTier
from jhicache.config import FetchPolicy


@dataclasses.dataclass(frozen=True)
class FetchRule:
    """The fetch settings: the policy, and fewer tokens than `threshold` past a request's cached
    prefix are not asked of storage; the timeout policy waits `timeout_s` plus
    `timeout_per_ki_token_s` per 1024 tokens asked for."""

    policy: FetchPolicy = FetchPolicy.TIMEOUT
    threshold: int = 256
    timeout_s: float = 0.0
    timeout_per_ki_token_s: float = 0.0
    # A step waits this long at most past a query's start for its answer, so that a request
    # that arrived since the last step is scheduled in this one, not a whole step later: a
    # query is one batch call, far shorter than a step.
    query_wait_s: float = 0.002

    @property
    def split(self) -> bool:
        """The request computes its prefix's head while the tail is read (from the last page)."""
        return self.policy is FetchPolicy.SPLIT


def should_end(fetch: StorageFetch, rule: FetchRule, page_size: int, now: float) -> bool:
    """Whether a waiting request's read ends now, with the pages read so far (not `split`: that
    read ends where the request's compute meets it)."""
    if rule.policy is FetchPolicy.BEST_EFFORT:
        return True
    if rule.policy is FetchPolicy.TIMEOUT:
        tokens = len(fetch.keys) * page_size
        return now - fetch.started_s > rule.timeout_s + rule.timeout_per_ki_token_s * tokens / 1024
    return False


@dataclasses.dataclass(frozen=True)
class Hits:
    """A request's cached prefix at admission, in tokens by the tier it was found on; `resumed`:
    admitted again after a split fetch (these add to its first admission's)."""

    device: int
    host: int
    storage: int
    resumed: bool = False


class Gate(NamedTuple):
    """The admission answer for a request: `wait` (its read is in flight and the policy holds
    it back), or `stop`, a page boundary its compute may not pass while its prefix's tail is
    read (split); neither: it computes freely."""

    wait: bool = False
    stop: int | None = None


@dataclasses.dataclass
class _Record:
    fetch: StorageFetch | None  # the read in flight
    tokens: Sequence[int]  # the request's tokens (the pages read go into the tree under them)
    fetched: int = 0  # tokens its ended reads put in the tree, not yet counted as hits
    computed: int = 0  # prompt tokens it computed before taking the pages read after them
    computing: bool = False  # admitted: a split read waits for its compute to meet it


class Fetches:
    """Per request id asked of storage: its read in flight (if any) and what its reads gave.
    The prefix cache owns it (it is the cache's face for storage reads: `PrefixCache.fetches`)
    and gives it the tree, the host tier and `alloc_host`, its host allocation (which may evict
    host pages); `filling` maps host pages to the host copies still writing them."""

    def __init__(self, storage: StorageTier | None, tree: RadixTree, host: HostTier | None,
                 rule: FetchRule, alloc_host: Callable[[int], list[int] | None],
                 filling: Mapping[int, int]) -> None:
        self.storage, self.tree, self.host, self.rule = storage, tree, host, rule
        self.page_size = tree.page_size
        self._alloc_host, self._filling = alloc_host, filling
        self._records: dict[str, _Record] = {}

    # -- by request: what the scheduler calls --------------------------------------------
    def arrive(self, rid: str, match_tokens: Sequence[int], tokens: Sequence[int]) -> None:
        """A request arrived: asks storage (on a thread) for the pages of `match_tokens` past
        its cached prefix, if the rule says they are worth asking for; the pages read go into
        the tree under `tokens` as host pages."""
        if self.storage is None or rid in self._records:
            return
        n = len(match_tokens) - 1
        match = self.tree.match(match_tokens[:n - n % self.page_size])
        fetch = self.start(match_tokens, match, self.rule.threshold, self.rule.split)
        self._records[rid] = _Record(fetch, tokens)

    def gate(self, rid: str) -> Gate:
        """How far `rid` may compute now (see `Gate`); asks nothing of storage."""
        record = self._records.get(rid)
        fetch = None if record is None else record.fetch
        if fetch is None:
            return Gate()
        if not self.rule.split:
            return Gate(wait=True)
        read_from = fetch.read_from
        last = fetch.first_page + len(fetch.keys) if read_from is None else read_from
        return Gate(stop=last * self.page_size)

    def meet(self, rid: str, cached_len: int, computed: bool = False) -> None:
        """Under the split policy, where `rid`'s compute has met its read: `cached_len` of its
        prompt's tokens are cached (with `computed`, by `rid` itself, which settled them: they
        are no hits); if that reaches the gate's stop, the read ends and the pages read from
        there on go into the tree (else, `computed` or not, nothing happens)."""
        record, stop = self._records.get(rid), self.gate(rid).stop
        if record is None or record.fetch is None or stop is None:
            return
        if computed or cached_len >= stop:
            got = self.end(record.fetch, record.tokens, cached_len // self.page_size)
            self._ended(record, got, cached_len if computed else 0)

    def admit(self, rid: str, device: int, host: int) -> Hits:
        """`rid` is admitted with a (device, host) hit: returns it by tier (host pages its reads
        brought count as storage hits, and prompt tokens it computed itself before taking them,
        split, as none; each once). A split read of its in flight now ends only where its
        compute meets it (`meet`), no longer on its own once every page is read."""
        record = self._records.get(rid)
        if record is None:
            return Hits(device, host, 0)
        record.computing = True
        stored = min(record.fetched, host)
        computed, record.fetched, record.computed = record.computed, 0, 0
        return Hits(max(device - computed, 0), host - stored, stored, resumed=computed > 0)

    def forget(self, rid: str) -> None:
        """`rid` is done (finished or aborted): a read still in flight ends, its pages freed."""
        record = self._records.pop(rid, None)
        if record is not None and record.fetch is not None:
            self.end(record.fetch, None)

    def end_all(self) -> None:
        """Ends every read in flight, the pages read so far going into the tree (the storage
        tier is detached)."""
        for record in self._records.values():
            if record.fetch is not None:
                self._ended(record, self.end(record.fetch, record.tokens))

    def in_flight(self, rid: str) -> StorageFetch | None:
        """`rid`'s read in flight, if any."""
        record = self._records.get(rid)
        return None if record is None else record.fetch

    def reading(self) -> bool:
        """Whether any request's read is in flight."""
        return any(r.fetch is not None for r in self._records.values())

    def wait(self, timeout_s: float) -> None:
        """Blocks until a storage query or read ends, or `timeout_s` passes (the engine has
        nothing else to do)."""
        if self.storage is not None:
            self.storage.wait_for_progress(timeout_s)

    # -- each step: the cache's ----------------------------------------------------------
    def await_queries(self) -> None:
        """Blocks until every storage query in flight is answered, or the rule's `query_wait_s`
        has passed since the latest one started (a query older than that costs no wait)."""
        if self.storage is None:
            return
        while True:
            asked = [f.started_s for f in self._querying()]
            remaining = max(asked, default=0.0) + self.rule.query_wait_s - time.perf_counter()
            if not asked or remaining <= 0:
                return
            self.storage.wait_for_progress(remaining)

    def _querying(self) -> Iterator[StorageFetch]:
        for record in self._records.values():
            fetch = record.fetch
            if fetch is not None and fetch.state is FetchState.QUERYING and not fetch.queried:
                yield fetch

    def advance_all(self, now: float) -> None:
        """Moves every read in flight on: reads start once storage answers; a read ends as the
        policy says (split: once every page has been read, from the first, while its request
        waits; where its compute meets it once admitted, `meet`)."""
        for record in self._records.values():
            fetch = record.fetch
            if fetch is None:
                continue
            if self.rule.split:
                got = self.advance(fetch, record.tokens, self.rule.threshold, False)
                if got is None and fetch.finished and not record.computing:
                    got = self.end(fetch, record.tokens)
            else:
                stop = should_end(fetch, self.rule, self.page_size, now)
                got = self.advance(fetch, record.tokens, self.rule.threshold, stop)
            if got is not None:
                self._ended(record, got)

    @staticmethod
    def _ended(record: _Record, fetched: int, computed: int = 0) -> None:
        record.fetch, record.fetched = None, fetched
        if computed:
            record.computed = computed

    # -- one read ------------------------------------------------------------------------
    def start(self, tokens: Sequence[int], match: MatchResult, threshold: int,
              from_tail: bool = False) -> StorageFetch | None:
        """Asks storage (on a thread) for the pages of `tokens` past `match` (whole pages,
        the last token left to compute), to be read from the first or, with `from_tail`, from
        the last; None when there is no storage tier or fewer than `threshold` tokens to ask
        for. The matched prefix is held from the start of the reads to the fetch's end, not
        while storage answers: most queries find nothing, and a prefix locked through every
        query would shrink what the other requests' loads may evict."""
        if self.storage is None or self.host is None:
            return None
        hit = (match.device_len + match.host_len) // self.page_size
        pages = (len(tokens) - 1) // self.page_size
        if (pages - hit) * self.page_size < max(threshold, self.page_size):
            return None
        # chained from the matched prefix's last key, which the tree keeps: only the pages
        # asked for are hashed
        previous = self.tree.page_keys(match.last_node)[-1] if hit else ROOT_KEY
        keys = chain_keys(tokens[hit * self.page_size:pages * self.page_size], self.page_size,
                          previous)
        return self.storage.start_fetch(keys, hit, None, from_tail)

    def advance(self, fetch: StorageFetch, tokens: Sequence[int], threshold: int,
                stop: bool) -> int | None:
        """Moves `fetch` on: once its query is answered, holds the prefix the found pages go
        under, gives them host pages and starts their reads (or ends it: too few found, the
        prefix left the cache meanwhile, or no host room); with `stop`, ends it. An ended
        fetch's pages read so far enter the tree as host pages; returns how many tokens they
        hold, or None while it goes on."""
        assert self.storage is not None and self.host is not None
        if fetch.state is FetchState.QUERYING and fetch.queried:
            assert fetch.found is not None
            # The prefix is held first: its host pages are then no room for the read, and the
            # allocation below (which may evict host pages) cannot take them.
            if fetch.found * self.page_size < threshold or not self._hold_prefix(fetch, tokens):
                self.storage.counters["fetch_revoked"] += 1
                return self.end(fetch, tokens)
            room = min(fetch.found, self.host.num_free + self.host.evictable_pages)
            host = self._alloc_host(room) if room * self.page_size >= threshold else None
            if host is None:
                key = "fetch_revoked" if room * self.page_size < threshold else "fetch_no_host"
                self.storage.counters[key] += 1
                return self.end(fetch, tokens)
            self.storage.read(fetch, host, {self._filling[p] for p in host if p in self._filling})
            return None
        # a fetch from the tail ends where the request's compute meets it (`meet`)
        if fetch.state is FetchState.FETCHING and (stop or fetch.finished and not fetch.from_tail):
            return self.end(fetch, tokens)
        if stop and fetch.state is FetchState.QUERYING:
            return self.end(fetch, tokens)
        return None

    def end(self, fetch: StorageFetch, tokens: Sequence[int] | None,
            from_page: int | None = None) -> int:
        """Ends `fetch`: the pages read from the first go into the tree under its anchor (none
        with `tokens` None: an aborted request); with `from_page` (a fetch from the tail), its
        pages from that page of the prompt on, if they were all read, and the prefix before them
        must be cached by then. Returns the tokens they hold."""
        assert self.storage is not None and self.host is not None
        if fetch.state is FetchState.ENDED:
            return 0
        first = None if from_page is None else from_page - fetch.first_page
        lo, hi = self.storage.end_fetch(fetch, first)
        if fetch.anchor is not None:  # (held once its reads were to start)
            self._pin(fetch.anchor, False)  # type: ignore[arg-type]
        pages = fetch.host_pages[lo:hi]
        if tokens is None or not pages:
            self.host.free(pages)
            return 0
        end = (fetch.first_page + hi) * self.page_size
        unused = self.tree.insert_host(tokens[:end], pages, fetch.first_page + lo)
        self.host.free(unused)
        return (len(pages) - len(unused)) * self.page_size

    def _hold_prefix(self, fetch: StorageFetch, tokens: Sequence[int]) -> bool:
        """Holds the cached prefix before `fetch`'s first page, its anchor, until the fetch
        ends; False (nothing held) when that prefix is no longer all cached."""
        match = self.tree.match(tokens[:fetch.first_page * self.page_size])
        if match.device_len + match.host_len < fetch.first_page * self.page_size:
            return False
        fetch.anchor = (match.last_node, match.last_node.device_pages is not None)
        self._pin(fetch.anchor, True)  # type: ignore[arg-type]
        return True

    def _pin(self, anchor: tuple[Node, bool], pin: bool) -> None:
        """Keeps the anchor node (and so its prefix) in the tree: locked on device when it was
        there at the start, else pinned on host."""
        assert self.host is not None
        node, on_device = anchor
        if on_device:
            (self.tree.lock if pin else self.tree.unlock)(node)
        else:
            (self.host.pin if pin else self.host.unpin)([node])
