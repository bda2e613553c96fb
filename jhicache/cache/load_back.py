"""LoadBacks: host->device copies of pages, layer by layer, each layer's landing told to the
device by a flag.

| phase   | what runs where                                                                      |
|---------|--------------------------------------------------------------------------------------|
| queue   | nothing (page id lists); the ticket becomes waitable once launched                   |
| launch  | per layer in order, K and V copies straight from host pages into the donated pool   |
|         | buffers, then the load's sequence number stored in that layer's device flag; a mark  |
|         | after the last (high-priority stream). May stop after the first layers: `finish`     |
|         | queues the rest                                                                      |
| forward | each layer's attention kernel waits on the device until the layer's flag reaches    |
|         | the newest load the step reads (`LoadTicket.gate_seq`)                               |
A load is held back while a compute that may still touch its device pages runs (a *fence*) or
while a write-back into the host pages it reads is not yet queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jhicache.cache.copier import Copier, CopyRows, Direction, Mark
from jhicache.cache.device_pool import DevicePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.transfer_op import TransferOp, is_ready, runs
from jhicache.cache.write_back import WriteBacks
from jhicache.config import TransferTuning


class _Fence(NamedTuple):
    """A dispatched compute that may still touch some device pages: no load copies into them
    before it is ready. Kept per compute, not per page: a step frees many pages and the fences
    are asked of often (every poll), each `is_ready` a call into the runtime."""

    compute: jax.Array
    pages: set[int]


class _Plan(NamedTuple):
    """A load's copies, a row per layer, and each layer's flag addresses [shards, layers]."""

    rows: CopyRows
    flags: np.ndarray


class Load:
    """One merged launch of load-backs (the `LoadCopies` its tickets wait on). The device learns
    of each layer's landing through its flag; the host only of the whole load's, by one mark."""

    def __init__(self, loads: LoadBacks, ops: list[TransferOp], device_ids: np.ndarray,
                 host_ids: np.ndarray) -> None:
        self.loads, self.ops = loads, ops
        self.device_ids, self.host_ids = device_ids, host_ids
        self.start: Mark | None = None  # timed, before its first copy
        self.landed: Mark | None = None  # timed, after its last copy; set once all are queued
        self.seq = 0  # set when issued: what its layers' flags are set to once landed
        self.queued_layers = 0  # layers whose copies and flag are queued, in order
        self.plan: _Plan | None = None  # its copies, while some are still to be queued

    def wait(self) -> None:
        self.loads.copier.wait(self.issue())

    def issue(self) -> Mark:
        """Issues the copies now if held back (blocking on what holds them); the landed mark."""
        if self.landed is None:
            self.loads.force_issue(self)
        assert self.landed is not None
        return self.landed

    def issued_seq(self) -> int:
        copier = self.loads.copier
        if not copier.beside_compute:  # the device cannot wait for these copies: land them now
            copier.wait(self.issue())
        elif self.seq == 0:  # held back: issue it now (its later layers may follow the forward)
            self.loads.force_issue(self)
        return self.seq

    def is_ready(self) -> bool:
        return self.landed is not None and self.loads.copier.is_done(self.landed)


class LoadBacks:
    """Queues, fences, issues and retires the copies of host pages into device pages."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier,
                 tuning: TransferTuning, writes: WriteBacks) -> None:
        self.device_pool, self.host_pool, self.copier = device_pool, host_pool, copier
        self.tuning, self.writes = tuning, writes
        self.shards = device_pool.num_shards
        self.layer_bytes = host_pool.layer_page_bytes  # of one shard
        self.queued: list[TransferOp] = []
        self.launched: list[Load] = []  # not retired
        self.last_mark: Mark | None = None  # after the newest load's last copy
        self.seconds = 0.0  # per launch, its first copy's start to its last copy's end, summed
        self._fences: dict[int, _Fence] = {}  # id of a compute (held by its fence) -> its fence
        self._queuing: Load | None = None  # a load whose later layers are still to be queued
        self._last_seq = 0  # of the newest load issued; flags only grow (copies go in order)
        self._buffers: np.ndarray | None = None  # [layers, K|V, shards] uint64 addresses
        self._flags: np.ndarray | None = None  # [shards, layers] each layer's load flag address

    # -- fences --------------------------------------------------------------------------------

    def fence(self, pages: Sequence[int], computes: Sequence[jax.Array]) -> None:
        """No load copies into `pages` before each of `computes` (outputs of dispatched
        programs that may still touch them) is ready."""
        self._prune_fences()  # none piles up
        for compute in computes:
            if is_ready(compute):
                continue
            fence = self._fences.setdefault(id(compute), _Fence(compute, set()))
            fence.pages.update(pages)

    def fences_on(self, page: int) -> list[jax.Array]:
        """The computes still fencing a device page (as last asked)."""
        return [f.compute for f in self._fences.values() if page in f.pages]

    def _prune_fences(self) -> None:
        for key in [key for key, fence in self._fences.items() if is_ready(fence.compute)]:
            del self._fences[key]

    # -- launching -----------------------------------------------------------------------------

    def launch(self, first_layers: int | None = None) -> list[TransferOp]:
        """Starts the queued load-backs as one load, if nothing holds it back; otherwise it
        starts once nothing does (`retry`), or when a forward waits on it. Any queued
        write-back that fills a host page to be loaded is launched first. Returns the ops.

        `first_layers`: where the device waits for each layer's flag, queue only that many
        layers' copies now (what a forward's first program reads), or more, up to
        `tuning.load_head_bytes`; the rest follow at `finish`, or before any other copy that
        must come after them."""
        if self.writes.queued_into(p for op in self.queued for p in op.host_pages):
            self.writes.launch()  # the load then waits for those writes (`_blockers`)
        ops, self.queued = self.queued, []
        if not ops:
            return ops
        device = np.asarray([p for op in ops for p in op.device_pages], np.int64)
        host = np.asarray([p for op in ops for p in op.host_pages], np.int64)
        load = Load(self, ops, device, host)
        for op in ops:
            assert op.ticket is not None
            op.ticket.bind(load)
        self.launched.append(load)
        self._try_issue(load, first_layers if self.copier.beside_compute else None)
        return ops

    def retry(self) -> None:
        """Issues the launched loads that nothing holds back any more (non-blocking)."""
        self._prune_fences()  # also when no load waits: finished computes are let go
        for load in self.launched:
            if load.landed is None:
                self._try_issue(load)

    def _blockers(self, load: Load) -> tuple[list[jax.Array], list]:
        """What holds `load` back: unready fences on its device pages, unqueued writes of its
        host pages."""
        self._prune_fences()
        pages = set(load.device_ids.tolist())
        fences = [f.compute for f in self._fences.values() if not pages.isdisjoint(f.pages)]
        return fences, [w for w in self.writes.writes_into(load.host_ids) if w.mark is None]

    def _try_issue(self, load: Load, first_layers: int | None = None) -> None:
        self.writes.advance()
        fences, staged = self._blockers(load)
        if not fences and not staged:
            self._issue(load, first_layers)

    def force_issue(self, load: Load) -> None:
        """Blocks on whatever holds `load` back, then issues it whole (a forward is waiting for
        it)."""
        if load.seq:  # issued in part
            self.finish()
            return
        fences, staged = self._blockers(load)
        for compute in fences:
            compute.block_until_ready()
        self.writes.queue_all(staged)  # writes go out oldest first
        self._issue(load)

    def _issue(self, load: Load, first_layers: int | None = None) -> None:
        """Queues the load's copies layer by layer, each layer's flag after it: all of them, or
        the first `first_layers` (the rest at `finish`)."""
        self.finish()  # flags only grow: the load before must be wholly queued first
        for write in self.writes.writes_into(load.host_ids):
            assert write.mark is not None
            self.copier.order_after(Direction.TO_DEVICE, write.mark)
        pool = self.device_pool
        if self.copier.synchronous:  # copies at once: must not race the compute producing the pool
            jax.block_until_ready((pool.k, pool.v))
            self.check_buffers()
        load.plan = self._plan(load)
        self._last_seq += 1
        load.seq = self._last_seq
        load.start = self.copier.mark(Direction.TO_DEVICE, timed=True)
        self._queuing = load
        upto = pool.num_layers
        if first_layers is not None:
            layer_bytes = int(load.plan.rows.sizes.sum()) * self.shards
            upto = max(first_layers, -(-self.tuning.load_head_bytes // max(layer_bytes, 1)))
        self._queue_layers(load, upto)

    def _plan(self, load: Load) -> _Plan:
        size = np.uint64(self.layer_bytes)
        src_pages, dst_pages, lengths = runs(load.host_ids, load.device_ids)
        sizes = np.tile(lengths.astype(np.uint64) * size, 2)  # the K runs, then the V runs
        buffers = self._pool_buffers().transpose(2, 0, 1)[..., None]  # [shards, layers, K|V, 1]
        dsts = buffers + dst_pages.astype(np.uint64) * size
        srcs = self.host_pool.layer_addresses(src_pages)
        layers = self.device_pool.num_layers
        if self._flags is None:  # the flags array is never replaced: its addresses are read once
            self._flags = (self.device_pool.flag_addresses(0)[:, None]
                           + np.arange(layers, dtype=np.uint64) * np.uint64(4))  # int32 flags
        return _Plan(CopyRows(dsts.reshape(self.shards, layers, -1), srcs, sizes), self._flags)

    def _queue_layers(self, load: Load, upto: int) -> None:
        """Queues layers [load.queued_layers, upto) of the load, in order, each layer's flag
        after its copies; the landed mark once every layer is queued."""
        plan, num_layers = load.plan, self.device_pool.num_layers
        assert plan is not None
        for layer in range(load.queued_layers, min(upto, num_layers)):
            self.copier.copy_row(Direction.TO_DEVICE, plan.rows, layer)
            self.copier.signal(Direction.TO_DEVICE, plan.flags[:, layer], load.seq)
            load.queued_layers = layer + 1
        if load.queued_layers == num_layers:
            load.landed = self.last_mark = self.copier.mark(Direction.TO_DEVICE, timed=True)
            load.plan, self._queuing = None, None

    def finish(self) -> Mark | None:
        """Queues the later layers of a load launched with `first_layers` (no-op without one);
        returns the mark after every load issued so far."""
        if self._queuing is not None:
            self._queue_layers(self._queuing, self.device_pool.num_layers)
        return self.last_mark

    # -- the pool's buffers --------------------------------------------------------------------

    def _pool_buffers(self) -> np.ndarray:
        """Each layer's K and V buffer addresses per device shard, [layers, K|V, shards], read
        once: the programs donate the pool arrays in place, so they never move
        (`check_buffers`). Read once because the pool's newest arrays are usually still being
        computed when a load is issued."""
        if self._buffers is None:
            jax.block_until_ready((self.device_pool.k, self.device_pool.v))
            self._buffers = self._current_buffers()
        return self._buffers

    def _current_buffers(self) -> np.ndarray:
        pool = self.device_pool
        return np.asarray([(pool.shard_pointers(k), pool.shard_pointers(v))
                           for k, v in zip(pool.k, pool.v)], np.uint64)

    def check_buffers(self) -> None:
        """Raises if a pool array (any device shard of it) left its buffer (a program that did
        not donate it in place): copies issued into the old buffer would be lost."""
        if self._buffers is not None and not np.array_equal(self._current_buffers(), self._buffers):
            raise RuntimeError("a device pool array moved to another buffer; loads need the pool "
                               "donated in place by every program that updates it")

    # -- completion ----------------------------------------------------------------------------

    def retire_done(self, timed: Callable[[Mark | None, Mark | None], float]) -> list[TransferOp]:
        """Forgets the loads whose copies have all landed; returns their ops."""
        done: list[TransferOp] = []
        for load in [ld for ld in self.launched
                     if ld.landed is not None and self.copier.is_done(ld.landed)]:
            self.launched.remove(load)
            self.seconds += timed(load.start, load.landed)
            done += load.ops
        return done

    def wait_all(self) -> None:
        """Issues every launched load (blocking on what holds it) and waits for it to land."""
        self.finish()
        for load in self.launched:
            load.wait()
