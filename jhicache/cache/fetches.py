"""Fetches: the storage reads the prefix cache runs for requests, keyed by request id, the fetch
policy that says when a read ends, and the hits by tier a request is admitted with."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jhicache.cache.storage_tier import StorageFetch
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


@dataclasses.dataclass
class _Record:
    fetch: StorageFetch | None  # the read in flight
    tokens: Sequence[int]  # the request's tokens (the pages read go into the tree under them)
    rule: FetchRule
    fetched: int = 0  # tokens its ended reads put in the tree, not yet counted as hits
    computed: int = 0  # prompt tokens it computed before taking the pages read after them


class Fetches:
    """Per request id asked of storage: its read in flight (if any) and what its reads gave."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def asked(self, rid: str) -> bool:
        return rid in self._records

    def add(self, rid: str, fetch: StorageFetch | None, tokens: Sequence[int],
            rule: FetchRule) -> None:
        self._records[rid] = _Record(fetch, tokens, rule)

    def get(self, rid: str) -> _Record | None:
        return self._records.get(rid)

    def in_flight(self, rid: str) -> StorageFetch | None:
        record = self._records.get(rid)
        return None if record is None else record.fetch

    def ended(self, rid: str, fetched: int, computed: int = 0) -> None:
        """`rid`'s read has ended: its pages read hold `fetched` tokens, now in the tree."""
        record = self._records[rid]
        record.fetch, record.fetched = None, fetched
        if computed:
            record.computed = computed

    def hits(self, rid: str, device: int, host: int) -> Hits:
        """Splits an admission's (device, host) hit: host pages its reads brought count as
        storage hits, and prompt tokens it computed itself before taking them (split) as none."""
        record = self._records.get(rid)
        if record is None:
            return Hits(device, host, 0)
        stored = min(record.fetched, host)
        computed, record.fetched, record.computed = record.computed, 0, 0
        return Hits(max(device - computed, 0), host - stored, stored, resumed=computed > 0)

    def forget(self, rid: str) -> StorageFetch | None:
        """Drops `rid`; returns its read still in flight (the caller ends it)."""
        record = self._records.pop(rid, None)
        return None if record is None else record.fetch
