"""Scheduler: waiting and running queues; admission with cache match and load-back; retraction.

Each step is either a prefill batch (continuing chunked prompts first, then newly admitted
requests, under a token budget) or a decode batch (one token for every decoding request).
Pages: a request's `device_pages[: shared_len // page_size]` belong to the cache and are protected
by the lock on `cache_handle`; the rest are private until `finish` hands them to the cache.
"""

from __future__ import annotations

import collections

import numpy as np

from jhicache.batch import Batch, Chunk
from jhicache.cache import LoadTicket, MatchResult, Node, PrefixCache
from jhicache.config import CacheMode, EngineConfig
from jhicache.request import FinishReason, Request, RequestStatus

SPLIT_PIECES = 4  # a split fetch's head is computed in pieces of this share of a step's budget


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    """Decides what each step computes and keeps page ownership straight while doing so."""

    def __init__(self, config: EngineConfig, cache: PrefixCache) -> None:
        self.config = config
        self.cache = cache
        self.fetches = cache.fetches  # its reads from storage, by request
        self.page_size = config.page_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.counters = dict.fromkeys(("device_hit_tokens", "host_hit_tokens",
                                       "storage_hit_tokens", "retracted_requests"), 0)

    @property
    def reuse(self) -> bool:
        return self.config.cache_mode is not CacheMode.OFF

    def add(self, request: Request) -> None:
        """Queues `request`; storage is asked at once for the pages past its cached prefix."""
        self.waiting.append(request)
        self.fetches.arrive(request.request_id, request.match_tokens, request.tokens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, may_retract: bool = True) -> Batch | None:
        """The next batch: prefill work first (it unblocks TTFT), otherwise one decode step.

        The batch's effects are recorded at once, before it runs: its requests' `cached_len`
        advances and each sampling chunk adds a pending token, so the next batch can be planned
        while this one is still on the device (overlap scheduling). Without `may_retract` (a
        step in flight will free pages when it ends), a request short of pages waits instead of
        another being retracted."""
        batch = self._prefill_batch() or self._decode_batch(may_retract)
        if batch is None:
            blocked = ([r for r in self.running if not self._last_token_dispatched(r)]
                       if may_retract else [])
            if blocked:
                # Nothing could run (prefills without pages, or decoders that retracted
                # themselves): free the newest running request's pages so the others can move.
                self.retract(blocked[-1])
            return None
        for chunk in batch.chunks:
            req = chunk.request
            req.cached_len = chunk.start + chunk.length
            if chunk.samples_token:
                req.pending += 1
                req.status = RequestStatus.DECODING
        return batch

    @staticmethod
    def _last_token_dispatched(req: Request) -> bool:
        """True when `req`'s last token is being sampled: it finishes once that step ends."""
        return req.num_generated >= req.params.max_new_tokens

    def _chunk(self, req: Request, length: int) -> Chunk:
        start = req.cached_len
        reaches_end = start + length == req.num_tokens
        return Chunk(req, start, length, req.num_generated if reaches_end else None)

    # ---- prefill -------------------------------------------------------------------------

    def _prefill_batch(self) -> Batch | None:
        budget = self.config.chunked_prefill_tokens
        chunks: list[Chunk] = []
        met: list[Request] = []
        for req in self.running:
            if req.status is RequestStatus.PREFILLING and budget > 0:
                stop = self.fetches.gate(req.request_id).stop
                if stop is not None and req.cached_len >= stop:
                    met.append(req)
                    continue
                chunk = self._next_chunk(req, budget, stop)
                if chunk is None:
                    break
                if chunk.length:
                    chunks.append(chunk)
                    budget -= chunk.length
        for req in reversed(met):
            self._take_fetched_tail(req)
        tickets: list[LoadTicket] = []
        for req in list(self.waiting):  # first come, first served; a request reading from
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self.fetches.gate(req.request_id).wait:
                continue  # storage is passed over, not waited for
            if req.pending:  # retracted while its last token was in flight
                break
            admitted = self._admit(req, budget, tickets)
            if admitted is None:
                break
            self.waiting.remove(req)
            if admitted.length:  # (none: a split fetch's head rounds down to no whole page)
                chunks.append(admitted)
                budget -= admitted.length
        return Batch(chunks=chunks, is_decode=False, tickets=tuple(tickets)) if chunks else None

    # ---- split fetches: the head computed while the tail is read -------------------------

    def _take_fetched_tail(self, req: Request) -> None:
        """`req`'s compute has met its tail's pages read from storage: its computed pages go to
        the cache, the pages read after them follow as host pages, and it waits at the front of
        the queue to be admitted again on them (it holds nothing meanwhile)."""
        self.running.remove(req)
        computed = req.cached_len
        self._settle(req, computed)
        self.fetches.meet(req.request_id, computed, computed=True)
        req.status, req.cached_len, req.shared_len = RequestStatus.WAITING, 0, 0
        self.waiting.appendleft(req)

    def _next_chunk(self, req: Request, budget: int, stop: int | None = None) -> Chunk | None:
        """Allocates pages for the next piece of `req`'s pending tokens, up to `stop` (a page
        boundary) if given; None if no pages are free."""
        length = min(req.pending_len, budget)
        if stop is not None:  # small pieces, so that it stops near where the reads have come
            length = min(length, max(self.config.chunked_prefill_tokens // SPLIT_PIECES,
                                     self.page_size))
        if stop is not None and req.cached_len + length > stop:
            length = stop - req.cached_len  # then it stops there for the pages read
        elif stop is not None and req.cached_len + length < req.num_tokens:
            length -= (req.cached_len + length) % self.page_size  # it may stop at a page end
        end = req.cached_len + length
        pages = self.cache.alloc_device(_pages_for(end, self.page_size) - len(req.device_pages))
        if pages is None:
            return None
        req.device_pages.extend(pages)
        return self._chunk(req, length)

    def _admit(self, req: Request, budget: int, tickets: list[LoadTicket]) -> Chunk | None:
        """Matches `req` against the cache, queues its load-back, allocates its first chunk."""
        rid = req.request_id
        if self.fetches.gate(rid).stop is not None:  # split: the pages read past the prefix
            match = self.cache.match(req.match_tokens, leave_last=True)
            self.fetches.meet(rid, match.device_len + match.host_len)
        attached = self._attach_prefix(req, budget, tickets) if self.reuse else (0, 0)
        if attached is None:
            return None
        chunk = self._next_chunk(req, budget, self.fetches.gate(rid).stop)
        if chunk is None:
            self._release(req)
            return None
        # pages read from storage for it, then loaded back, count as storage hits; pages it
        # computed itself before it took those (split fetch) are no hits
        hits = self.fetches.admit(rid, *self._count_prefetched(req, attached))
        self.counters["device_hit_tokens"] += hits.device
        self.counters["host_hit_tokens"] += hits.host
        self.counters["storage_hit_tokens"] += hits.storage
        if hits.resumed:  # admitted again after its split fetch: adds to its first report
            req.device_hit_tokens += hits.device
            req.host_hit_tokens += hits.host
            req.storage_hit_tokens += hits.storage
        elif req.first_token_s is None:  # a re-admission after retraction keeps its first one
            req.device_hit_tokens, req.host_hit_tokens = hits.device, hits.host
            req.storage_hit_tokens = hits.storage
        req.status = RequestStatus.PREFILLING
        self.running.append(req)
        return chunk

    def _attach_prefix(self, req: Request, budget: int,
                       tickets: list[LoadTicket]) -> tuple[int, int] | None:
        """Points `req` at its cached prefix (device hit plus any host run loaded back) and locks
        it; returns the (device, host) hit tokens.

        None (nothing done) when its host run cannot be loaded now but running requests will free
        pages: waiting for them beats recomputing a prefix the host tier holds."""
        match = self.cache.match(req.match_tokens, leave_last=True)
        handle, pages, host_len = match.last_device_node, list(match.device_pages), 0
        self.cache.lock(handle)  # first, so the quota below cannot count this prefix as evictable
        if self.config.cache_mode is CacheMode.HIERARCHICAL and match.host_len:
            quota = self._load_quota(req, match, budget)
            loadable = match.host_len >= self.config.load_back_threshold
            if loadable and match.host_len // self.page_size > quota and self.running:
                self.cache.unlock(handle)
                return None
            ticket = self.cache.load_back(match, quota_pages=quota)
            if ticket is not None:
                tickets.append(ticket)
                self.cache.lock(match.last_node)
                self.cache.unlock(handle)
                handle, pages = match.last_node, pages + list(ticket.device_pages)
                host_len = len(ticket.device_pages) * self.page_size
        # The prefix may still be landing: loaded ahead (prefetch) or for another request.
        tickets += [t for t in match.loading if t not in tickets]
        req.cache_handle = handle
        req.device_pages = pages
        req.shared_len = req.cached_len = len(pages) * self.page_size
        return match.device_len - self._own_prefix(req, match.last_device_node), host_len

    @staticmethod
    def _own_prefix(req: Request, last: Node) -> int:
        """Tokens of the prefix matched up to `last` that `req` cached itself while it ran
        (before a retraction): no hits, as they count once. Where its node left the cache
        since, it counts none (a node cached again by another request is a hit)."""
        walk: Node | None = last
        while walk is not None and walk is not req.counted_node:
            walk = walk.parent
        if walk is None:
            req.counted_len, req.counted_node = 0, None
        return req.counted_len

    @staticmethod
    def _count_prefetched(req: Request, hits: tuple[int, int]) -> tuple[int, int]:
        """Device hits that `prefetch` brought back from host for `req` count as host hits."""
        if req.prefetched is None:
            return hits
        device_before, loaded = req.prefetched
        req.prefetched = None
        moved = min(max(hits[0] - device_before, 0), loaded)
        return hits[0] - moved, hits[1] + moved

    def prefetch(self) -> int:
        """Starts the load-backs of waiting requests that the next step may admit, so that their
        copies are queued before this step's forward and overlap it; that step then finds their
        prefixes on device and needs no layer split. Admits nothing: a request whose prefetched
        pages are evicted again before it is admitted just matches less. Returns the loads
        started."""
        if self.config.cache_mode is not CacheMode.HIERARCHICAL:
            return 0
        budget, started = self.config.chunked_prefill_tokens, 0
        for req in self.waiting:
            if budget <= 0 or req.pending:
                break
            match = self.cache.match(req.match_tokens, leave_last=True)
            budget -= req.num_tokens - match.device_len - match.host_len
            # Once per request: pages evicted again before it is admitted are not reloaded.
            small = match.host_len < max(self.config.load_back_threshold, self.page_size)
            if req.prefetched is not None or small:
                continue
            self.cache.lock(match.last_device_node)  # the quota must not count this prefix
            quota = self._load_quota(req, match, max(budget, 1))
            # A prefetch that does not fit now is not tried (nor counted as refused): the
            # admission that follows decides as before.
            fits = match.host_len // self.page_size <= quota
            ticket = self.cache.load_back(match, quota) if fits else None
            self.cache.unlock(match.last_device_node)
            if ticket is not None:
                req.prefetched = (match.device_len, len(ticket.device_pages) * self.page_size)
                started += 1
        return started

    def _load_quota(self, req: Request, match: MatchResult, budget: int) -> int:
        """Pages a load-back may take: what can be freed, less the pages of the first chunk left
        to compute after it. Loaded pages replace pages the request would otherwise compute into,
        so only that chunk (and a decode page) must stay available."""
        available = self.cache.pages.device_available
        cached = match.device_len + match.host_len
        first_chunk = min(req.num_tokens - cached, budget)
        return (available - (_pages_for(cached + first_chunk, self.page_size)
                             - cached // self.page_size) - 1)

    # ---- decode --------------------------------------------------------------------------

    def _decode_batch(self, may_retract: bool) -> Batch | None:
        decoding = [r for r in self.running
                    if r.status is RequestStatus.DECODING and not self._last_token_dispatched(r)]
        chunks = []
        while decoding:
            req = decoding.pop(0)
            if self._reserve_decode_slot(req, decoding, may_retract):
                chunks.append(self._chunk(req, 1))
        return Batch(chunks=chunks, is_decode=True) if chunks else None

    def _reserve_decode_slot(self, req: Request, others: list[Request], may_retract: bool) -> bool:
        """Gives `req` a page for its next token, retracting the newest decoding requests not yet
        given one this step (`others`), then `req` itself, if the pool has none left (or, without
        `may_retract`, leaving `req` out of this step)."""
        while len(req.device_pages) * self.page_size <= req.cached_len:
            pages = self.cache.alloc_device(1)
            if pages is not None:
                req.device_pages.extend(pages)
                return True
            if not may_retract:
                return False
            victim = others.pop() if others else req
            self.retract(victim)
            if victim is req:
                return False
        return True

    def abort(self, req: Request, keep_computed: bool = True) -> bool:
        """Drops `req` wherever it is (waiting, loading, prefilling, decoding). With
        `keep_computed`, its full pages of known tokens go to the cache (their KV is computed, or
        will be by steps already dispatched, which run before any later reader); the rest are
        freed. False if it was not queued here (finished, or never added)."""
        if req in self.waiting or req in self.running:
            self.fetches.forget(req.request_id)  # a read from storage in flight ends first
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            if keep_computed and self.reuse:
                self._settle(req, min(req.cached_len, req.known_len))
            else:
                self._release(req)
        else:
            return False
        self._end(req, FinishReason.ABORT)
        return True

    def retract(self, req: Request) -> None:
        """Frees `req`'s pages and re-queues it at the front; its output so far is kept."""
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.counters["retracted_requests"] += 1

    def _release(self, req: Request) -> None:
        """Drops everything `req` holds: private pages freed, shared prefix unlocked."""
        self.cache.free_device(req.device_pages[req.shared_len // self.page_size:])
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.device_pages, req.cache_handle = [], None
        req.cached_len = req.shared_len = 0

    # ---- results -------------------------------------------------------------------------

    def commit(self, batch: Batch, sampled: np.ndarray, now: float) -> list[Request]:
        """Appends each sampling chunk's token (`sampled[row]`) to its request and finishes the
        requests that reached a stop token or their length; returns the requests that gained a
        token. A request that finished or was aborted since the batch was planned gains none:
        what was computed for it beyond that point is dropped."""
        gained = []
        for row, chunk in enumerate(batch.chunks):
            req = chunk.request
            if not batch.is_decode and not req.finished and req in self.running:
                self._share(req, chunk.start + chunk.length)
            if not chunk.samples_token or req.finished:
                continue
            assert chunk.sample_index == req.num_output, "steps commit in order"
            req.add_output(int(sampled[row]))
            req.pending -= 1
            if req.first_token_s is None:
                req.first_token_s = now
            gained.append(req)
            if req.tokens[-1] in req.params.stop_token_ids:
                self._finish(req, FinishReason.STOP)
            elif req.num_output >= req.params.max_new_tokens:
                self._finish(req, FinishReason.LENGTH)
        return gained

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Hands the request's computed full pages to the cache and frees the rest. Only the KV
        of tokens before the last is kept: a later step may have computed the last token's, but
        the cache then holds the same pages whether or not steps overlap."""
        if req in self.running:
            self.running.remove(req)
            if self.reuse:
                self._settle(req, min(req.cached_len, req.known_len - 1))
            else:
                self._release(req)
        elif req in self.waiting:  # retracted while its last token was in flight: holds nothing
            self.waiting.remove(req)
        self._end(req, reason)

    def _share(self, req: Request, kv_len: int) -> None:
        """Caches the full pages of `req`'s first `kv_len` tokens, their KV computed, while it
        runs (as SGLang caches unfinished requests): other requests hit them from now on, and
        the host and storage tiers may copy them before `req` ends. Not where the cache holds
        more of those tokens on device than `req` shares (another request cached them
        meanwhile): its own pages stay its own until its end (`_settle`), as the steps already
        dispatched read them. Its pages are those the chunk was dispatched with: a request is
        retracted (and so re-admitted on other pages) only while no step is in flight."""
        full = kv_len // self.page_size * self.page_size
        if not self.reuse or full <= req.shared_len or req.cache_handle is None:
            return
        tokens = req.tokens[:full]
        if self.cache.match(tokens).device_len > req.shared_len:
            return
        self.cache.insert(tokens, req.device_pages[:full // self.page_size], req.counted_len)
        node = self.cache.match(tokens).last_device_node
        self.cache.lock(node)
        self.cache.unlock(req.cache_handle)
        req.cache_handle, req.shared_len = node, full
        req.counted_len, req.counted_node = full, node

    def _settle(self, req: Request, kv_len: int) -> None:
        """Inserts the full pages of `req`'s first `kv_len` tokens into the cache, frees the
        rest and unlocks its prefix (`kv_len` >= `shared_len`: the shared prefix is computed)."""
        full_pages = kv_len // self.page_size
        known = self.cache.insert(req.tokens[: full_pages * self.page_size],
                                  req.device_pages[:full_pages], req.counted_len)
        shared_pages = req.shared_len // self.page_size
        duplicates = req.device_pages[shared_pages: known // self.page_size]
        self.cache.free_device(duplicates + req.device_pages[full_pages:])
        self.cache.unlock(req.cache_handle)
        req.device_pages, req.cache_handle = [], None

    def _end(self, req: Request, reason: FinishReason) -> None:
        self.fetches.forget(req.request_id)  # a read from storage still in flight ends
        req.status, req.finish_reason, req.pending = RequestStatus.FINISHED, reason, 0

    def owned_device_pages(self) -> list[int]:
        """Private pages held by running requests, for the cache's page accounting."""
        return [p for r in self.running for p in r.device_pages[r.shared_len // self.page_size:]]
