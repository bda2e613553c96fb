"""TransferController: queues write-backs (device->host) and load-backs (host->device) of page
pairs, launches each kind merged, and fences them against the computations that touch the
same pages.

How pages move
--------------
| phase          | what runs where                                                          |
|----------------|--------------------------------------------------------------------------|
| queue_*        | nothing (page id lists)                                                  |
| launch_writes  | jitted gathers of the pages into staging arrays, one per power-of-two    |
|                | piece, a head first (`gather_pieces`, `TransferTuning`; compute stream,  |
|                | so ordered after the compute that wrote them and before any compute that |
|                | reuses them); a piece's device->host copies are queued once its staging  |
|                | is ready (at a later piece's dispatch or `poll`), on the copier's        |
|                | low-priority stream                                                      |
| launch_loads   | per layer in order, K and V copies straight from host pages into the     |
|                | donated pool buffers, then the load's sequence number stored in that     |
|                | layer's device flag; a mark after the last (high-priority stream). May   |
|                | stop after the first layers: `finish_loads` queues the rest              |
| forward        | each layer's attention kernel waits on the device until the layer's flag |
|                | reaches the newest load the step reads (`LoadTicket.gate_seq`)           |
Copies run on streams of their own (`jhicache.cache.copier`), beside the forward; JAX does not
see them, so this module orders them by hand:
- A device page freed while dispatched compute may still write it (the in-flight step of a
  request that just finished, or a write-back's gather not yet run) is *fenced* with an array
  of that compute (`fence_device_pages`): no load copies into it until the array is ready.
- A load reading host pages whose write-back is still staged waits for that write to be
  queued, then starts after it (`order_after`); a write-back into host pages starts after every
  load already queued (a freed host page may still be read by one).
- The pool arrays keep their buffers (every program donates them, in place): loads copy into
  addresses read once, and `flush` checks that they are still the pool's.

Tensor parallelism: the pool arrays are split over devices on the KV heads, so a page's layer is
one block per device shard. Every copy moves all shards of its pages (shard i between device i's
buffer and the host pool's block i, on copier i of a `ShardedCopier`), the write-back's gather
keeps the pool's head split (its staging is per device too), and a mark is done only once every
device's part is: a layer has landed when all its shards have. One device is the same code with
one shard, on a plain copier.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.buckets import pow2_bucket
from jhicache.cache.copier import Copier, CopyRows, Direction, Mark, ShardedCopier
from jhicache.cache.device_pool import DevicePool, PagePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.ticket import LoadTicket


@dataclasses.dataclass(frozen=True)
class TransferTuning:
    """How much the controller queues at a time (bytes of one device shard).

    Attributes:
      write_piece_bytes: host copies of write-backs queued per poll (and per `launch_writes`):
        small against a whole write-back, because a forward's own small device->host copy
        (its sampled tokens) waits behind copies queued before it (`_issue_write`).
      gather_head_bytes: a write-back larger than this gathers this many bytes first (whole
        pages, a power of two of them), then pieces that double (`gather_pieces`): the first
        piece's copies start once it has gathered, while the rest gathers, instead of after
        the whole write-back's staging. Small enough to gather in a fraction of a millisecond,
        large enough that its per-layer copies run at the PCIe rate (BENCHMARKS.md, the
        write-back table).
      load_head_bytes: a load launched by its first layers queues at least this many bytes
        (whole layers) before the rest: enough copying to keep the copy engine busy while the
        host builds the step's inputs and dispatches the forward's first program, after which
        it queues the rest (the host-hit phases in BENCHMARKS.md). Where the whole load is
        smaller, it is queued at once.
    """

    write_piece_bytes: int = 64 << 20
    gather_head_bytes: int = 256 << 20
    load_head_bytes: int = 96 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransferTuning.{field.name}={value!r}: expected an int >= 1")


class TransferKind(enum.Enum):
    WRITE_BACK = "write_back"
    LOAD_BACK = "load_back"


class TransferOp(NamedTuple):
    """One queued copy of page pairs; reported back by `poll` once complete."""

    op_id: int
    kind: TransferKind
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    ticket: LoadTicket | None


def _stack_pages(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...],
                 ids: jax.Array) -> jax.Array:
    """Pages `ids` of every layer's K then V -> one contiguous [layers, 2, n, S, H, D] staging
    array (an XLA gather: whole pages, every element independent). One array, not one per
    layer: the host reads one address per piece, and the dispatch has one output to set up."""
    return jnp.stack([jnp.stack([k[ids], v[ids]]) for k, v in zip(ks, vs)])


_gather_kv = jax.jit(_stack_pages)


def _sharded_gather(pool: PagePool):
    """`_gather_kv` whose staging stays split as the pool's pages are (on the head axis, one
    contiguous [layers, 2, n, S, H / shards, D] buffer per device), so each device's shard of a
    page is copied to its own host block. Stated, not left to propagation: the copies rely on
    it."""
    sharding = pool.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise ValueError(f"a page pool over several devices needs a NamedSharding, got {sharding}")
    staging = jax.sharding.NamedSharding(sharding.mesh,
                                         jax.sharding.PartitionSpec(None, None, *sharding.spec))
    return jax.jit(_stack_pages, out_shardings=staging)


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page pairs coalesced where both ids step by one: (src starts, dst starts, lengths)."""
    if len(src) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], cut])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return src[starts], dst[starts], lengths


def gather_pieces(pages: int, smallest: int = 16,
                  head: int | None = None) -> list[tuple[int, int]]:
    """(start, size) pieces of a write-back of `pages` pages, each gathered padded to its
    power-of-two bucket (`pow2_bucket`, so no new shape compiles). Where padding the whole would
    waste more than an eighth of it, its largest power of two is split off and the rest pieced
    the same way, if that gathers fewer pages in all: 129 pages gather 128 + 16, not 256.
    `head` (pages, rounded down to a power of two, at least `smallest`): a write-back of more
    pages gathers that many first, then pieces twice as large as the one before while more than
    that is left, then the rest pieced as above: no piece gathers more than twice the pages
    before it, so at any size each piece's gather (HBM speed) runs while the piece before is
    copied (PCIe)."""
    if head is not None:
        if head < 1:
            raise ValueError(f"head must be at least one page, got {head}")
        head = max(smallest, 1 << (head.bit_length() - 1))

    def plan(start: int, left: int) -> tuple[int, list[tuple[int, int]]]:
        whole = (pow2_bucket(left, smallest), [(start, left)])
        if left <= smallest or whole[0] - left <= left // 8:
            return whole
        size = 1 << (left.bit_length() - 1)  # the largest power of two in what is left
        gathered, pieces = plan(start + size, left - size)
        return (size + gathered, [(start, size)] + pieces) if size + gathered < whole[0] else whole

    doubling: list[tuple[int, int]] = []
    start, size = 0, head or pages
    while pages - start > size:
        doubling.append((start, size))
        start, size = start + size, 2 * size
    return doubling + plan(start, pages - start)[1]


def _is_ready(array: jax.Array) -> bool:
    """Whether a dispatched program's output is computed (jax.Array's stubs lack is_ready)."""
    return array.is_ready()  # type: ignore[attr-defined]


class _Fence(NamedTuple):
    """A dispatched compute that may still touch some device pages: no load copies into them
    before it is ready. Kept per compute, not per page: a step frees many pages and the fences
    are asked of often (every poll), each `is_ready` a call into the runtime."""

    compute: jax.Array
    pages: set[int]


class _WriteRows(NamedTuple):
    """A staged write's copies: [shards, layers, K runs then V runs] addresses, one size per
    run of a layer."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray


class _Write:
    """One merged write-back launch: staged on device, then copied to host."""

    def __init__(self, ops: list[TransferOp], staging: jax.Array, host_ids: np.ndarray) -> None:
        self.ops, self.staging, self.host_ids = ops, staging, host_ids
        self.rows: _WriteRows | None = None  # its copies, built once its staging is ready
        self.next_layer = 0  # the next layer whose host copies to queue
        self.start: Mark | None = None  # timed, before its first host copy
        self.mark: Mark | None = None  # timed, set once all its host copies are queued


class _LoadPlan(NamedTuple):
    """A load's copies, a row per layer, and each layer's flag addresses [shards, layers]."""

    rows: CopyRows
    flags: np.ndarray


class _Load:
    """One merged load-back launch (the `LoadCopies` its tickets wait on). The device learns of
    each layer's landing through its flag; the host only of the whole load's, by one mark."""

    def __init__(self, controller: TransferController, ops: list[TransferOp],
                 device_ids: np.ndarray, host_ids: np.ndarray) -> None:
        self.controller, self.ops = controller, ops
        self.device_ids, self.host_ids = device_ids, host_ids
        self.start: Mark | None = None  # timed, before its first copy
        self.landed: Mark | None = None  # timed, after its last copy; set once all are queued
        self.seq = 0  # set when issued: what its layers' flags are set to once landed
        self.queued_layers = 0  # layers whose copies and flag are queued, in order
        self.plan: _LoadPlan | None = None  # its copies, while some are still to be queued

    def wait(self) -> None:
        self.controller.copier.wait(self.issue())

    def issue(self) -> Mark:
        """Issues the copies now if held back (blocking on what holds them); the landed mark."""
        if self.landed is None:
            self.controller.force_issue(self)
        assert self.landed is not None
        return self.landed

    def issued_seq(self) -> int:
        copier = self.controller.copier
        if not copier.beside_compute:  # the device cannot wait for these copies: land them now
            copier.wait(self.issue())
        elif self.seq == 0:  # held back: issue it now (its later layers may follow the forward)
            self.controller.force_issue(self)
        return self.seq

    def is_ready(self) -> bool:
        return self.landed is not None and self.controller.copier.is_done(self.landed)


class TransferController:
    """Merges, launches, fences and retires the copies between a device pool and a host pool."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier,
                 tuning: TransferTuning = TransferTuning()) -> None:
        if not device_pool.layout.same_page_shape(host_pool.layout):
            raise ValueError(f"page layouts differ: {device_pool.layout} vs {host_pool.layout}")
        shards = device_pool.num_shards
        if host_pool.shards != shards:
            raise ValueError(f"host pool has {host_pool.shards} shards, the device pool {shards}")
        if shards > 1 and not (isinstance(copier, ShardedCopier) and len(copier.copiers) == shards):
            raise ValueError(f"{shards} device shards need a ShardedCopier of {shards} copiers, "
                             f"got {copier}")
        self.device_pool, self.host_pool, self.copier = device_pool, host_pool, copier
        self.tuning = tuning
        self.shards = shards
        self.layer_bytes = host_pool.layer_page_bytes  # of one shard
        self._gather = _gather_kv if shards == 1 else _sharded_gather(device_pool)
        self._queued: dict[TransferKind, list[TransferOp]] = {k: [] for k in TransferKind}
        self._writes: list[_Write] = []  # launched, not retired
        self._loads: list[_Load] = []  # launched, not retired
        self._writing: dict[int, _Write] = {}  # host page -> the newest write into it, until done
        self._fences: dict[int, _Fence] = {}  # id of a compute (held by its fence) -> its fence
        self._last_load: Mark | None = None  # after the newest load's last copy
        self._queuing: _Load | None = None  # a load whose later layers are still to be queued
        self._last_seq = 0  # of the newest load issued; flags only grow (copies go in order)
        self._buffers: np.ndarray | None = None  # [layers, K|V, shards] uint64 addresses
        self._flags: np.ndarray | None = None  # [shards, layers] each layer's load flag address
        self._next_id = 0
        # *_s: per launch, its first copy's start to its last copy's end, by the copier's
        # timed marks (device-side events on a GPU), summed; a write-back's copies are queued
        # in pieces over several polls, and the gaps between them count.
        self.counters = {"write_back_ops": 0, "write_back_pages": 0, "load_back_ops": 0,
                         "load_back_pages": 0, "write_back_launches": 0, "load_back_launches": 0,
                         "write_back_s": 0.0, "load_back_s": 0.0}

    # -- queueing ------------------------------------------------------------------------------

    def _op(self, kind: TransferKind, device_pages: Sequence[int], host_pages: Sequence[int],
            ticket: LoadTicket | None = None) -> TransferOp:
        if len(device_pages) != len(host_pages) or not device_pages:
            raise ValueError("need equal, non-empty page lists: "
                             f"{len(device_pages)} vs {len(host_pages)}")
        op = TransferOp(self._next_id, kind, tuple(device_pages), tuple(host_pages), ticket)
        self._next_id += 1
        self._queued[kind].append(op)
        return op

    def queue_write_back(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Queues a device->host copy; returns its op id."""
        return self._op(TransferKind.WRITE_BACK, device_pages, host_pages).op_id

    def queue_load_back(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadTicket:
        """Queues a host->device copy; the ticket becomes waitable once launched."""
        ticket = LoadTicket(self._next_id, self.device_pool.num_layers, host_pages, device_pages)
        self._op(TransferKind.LOAD_BACK, device_pages, host_pages, ticket)
        return ticket

    def num_queued(self) -> int:
        return sum(len(q) for q in self._queued.values())

    def fence_device_pages(self, pages: Sequence[int], computes: Sequence[jax.Array]) -> None:
        """No load copies into `pages` before each of `computes` (outputs of dispatched
        programs that may still touch them) is ready."""
        self._prune_fences()  # none piles up
        for compute in computes:
            if _is_ready(compute):
                continue
            fence = self._fences.setdefault(id(compute), _Fence(compute, set()))
            fence.pages.update(pages)

    def fences_on(self, page: int) -> list[jax.Array]:
        """The computes still fencing a device page (as last asked)."""
        return [f.compute for f in self._fences.values() if page in f.pages]

    def pending_gathers(self) -> list[jax.Array]:
        """The write-back gathers dispatched and not known to have run: they may still read
        any page the cache frees now."""
        return [w.staging for w in self._writes if w.mark is None]

    def gather_sizes(self) -> list[int]:
        """Every padded page count a write-back's gather can take: the pieces of any write-back
        (`gather_pieces`) are power-of-two buckets no larger than the pool."""
        sizes, size = [], pow2_bucket(1)
        while size <= pow2_bucket(self.device_pool.layout.num_pages):
            sizes.append(size)
            size *= 2
        return sizes

    def lower_gather(self, size: int) -> jax.stages.Lowered:
        """The write-back gather of `size` pages, lowered for this pool (as `launch_writes`
        calls it), for a warm-up to compile ahead of serving."""
        return self._gather.lower(*self.device_pool.layer_types(), np.zeros(size, np.int32))

    # -- launching -----------------------------------------------------------------------------

    def launch(self) -> None:
        """Starts everything queued: write-backs first, then load-backs."""
        self.launch_writes()
        self.launch_loads()

    def _take(self, kind: TransferKind) -> tuple[list[TransferOp], np.ndarray, np.ndarray]:
        ops, self._queued[kind] = self._queued[kind], []
        device = np.asarray([p for op in ops for p in op.device_pages], np.int64)
        host = np.asarray([p for op in ops for p in op.host_pages], np.int64)
        if ops:
            self.counters[f"{kind.value}_ops"] += len(ops)
            self.counters[f"{kind.value}_pages"] += len(device)
            self.counters[f"{kind.value}_launches"] += 1
        return ops, device, host

    def launch_writes(self) -> None:
        """Dispatches the gathers of every queued write-back: one per piece of `gather_pieces`,
        whose ops are reported once the last piece landed. A piece's host copies are queued
        once its staging is ready: at a later piece's dispatch, in `poll`, or at `flush`.
        The gathers read the pages before any later compute can overwrite them, but a load's
        copy is not compute: it must wait for the gather (the cache fences freed pages on every
        pending gather, `pending_gathers`)."""
        ops, device, host = self._take(TransferKind.WRITE_BACK)
        if not ops:
            return
        pool = self.device_pool
        page_bytes = 2 * pool.num_layers * self.layer_bytes  # staged per device shard
        head = max(1, self.tuning.gather_head_bytes // page_bytes)
        pieces = gather_pieces(len(device), head=head)
        budget: float = self.tuning.write_piece_bytes  # this call's copies, over all its pieces
        for i, (start, size) in enumerate(pieces):
            ids = device[start:start + size]
            # padded with the last page, read again: one gather program per bucket of id lists
            ids = np.concatenate([ids, np.repeat(ids[-1:], pow2_bucket(size) - size)])
            staging = self._gather(tuple(pool.k), tuple(pool.v), ids.astype(np.int32))
            # One queue, copied in order: the last piece lands last, and carries the ops.
            write = _Write(ops if i == len(pieces) - 1 else [], staging, host[start:start + size])
            self._writes.append(write)
            for page in write.host_ids.tolist():
                self._writing[page] = write
            # An earlier piece gathered while this one was dispatched: its copies start now.
            budget = self._advance_writes(budget)

    def _issue_write(self, write: _Write, budget: float) -> float:
        """Queues a staged write's host copies (its staging is ready), whole layers while
        `budget` bytes last, in one batch; returns what is left of it. Small pieces at a time,
        because the copy engine serves copies in the order queued, across streams too: the
        forward's own small device->host copy (its sampled tokens) must not wait behind a whole
        write-back (BENCHMARKS.md, "Write-backs do not stall a forward beside them"). One
        batch per piece, not per layer: no kernel waits for a written layer, so nothing needs
        the layers apart, and every driver call is host time that the steps around it pay."""
        self.finish_loads()  # every load issued so far is then behind `_last_load`
        if self._last_load is not None:
            self.copier.order_after(Direction.TO_HOST, self._last_load)  # host pages reused
        if write.rows is None:
            write.rows = self._write_rows(write)
            write.start = self.copier.mark(Direction.TO_HOST, timed=True)
        rows, layers = write.rows, self.device_pool.num_layers
        layer_bytes = float(rows.sizes.sum())  # of one device shard, on its own copy stream
        first = write.next_layer
        more = layers if math.isinf(budget) else max(1, math.ceil(budget / layer_bytes))
        write.next_layer = min(layers, first + more)
        self._copy(Direction.TO_HOST, rows.dsts[:, first:write.next_layer].reshape(self.shards, -1),
                   rows.srcs[:, first:write.next_layer].reshape(self.shards, -1),
                   np.tile(rows.sizes, write.next_layer - first))
        if write.next_layer == layers:
            write.mark = self.copier.mark(Direction.TO_HOST, timed=True)
        return budget - layer_bytes * (write.next_layer - first)

    def _write_rows(self, write: _Write) -> _WriteRows:
        """Every layer's copies of a staged write, from one address per device shard: row i of
        the staging (a piece's i-th page) goes to host page host_ids[i], coalesced into runs."""
        size = np.uint64(self.layer_bytes)
        src_rows, dst_pages, lengths = runs(np.arange(len(write.host_ids)), write.host_ids)
        layers, _, padded = write.staging.shape[:3]
        kv_rows = np.concatenate([src_rows, padded + src_rows]).astype(np.uint64)
        rows = np.arange(layers, dtype=np.uint64)[:, None] * np.uint64(2 * padded) + kv_rows
        base = np.asarray(self.device_pool.shard_pointers(write.staging), np.uint64)
        return _WriteRows(self.host_pool.layer_addresses(dst_pages),
                          base[:, None, None] + rows * size,
                          np.tile(lengths.astype(np.uint64) * size, 2))

    def launch_loads(self, first_layers: int | None = None) -> None:
        """Starts every queued load-back whose pages are free of fences; the rest start once
        they are (`poll`), or when a forward waits on them. Called alone (ahead of the queued
        write-backs), it first launches any write-back that fills a host page to be loaded.

        `first_layers`: where the device waits for each layer's flag, queue only that many
        layers' copies of the load now (what a forward's first program reads), or more, up to
        `tuning.load_head_bytes`; the rest follow at `finish_loads`, or before any other copy
        that must come after them."""
        filling = {p for op in self._queued[TransferKind.WRITE_BACK] for p in op.host_pages}
        if filling and any(p in filling for op in self._queued[TransferKind.LOAD_BACK]
                           for p in op.host_pages):
            self.launch_writes()  # the loads then wait for those writes, as `_blockers` says
        ops, device, host = self._take(TransferKind.LOAD_BACK)
        if not ops:
            return
        load = _Load(self, ops, device, host)
        for op in ops:
            assert op.ticket is not None
            op.ticket.bind(load)
        self._loads.append(load)
        self._try_issue(load, first_layers if self.copier.beside_compute else None)

    def _blockers(self, load: _Load) -> tuple[list[jax.Array], list[_Write]]:
        """What holds `load` back: unready fences on its device pages, unqueued writes of its host
        pages."""
        self._prune_fences()
        pages = set(load.device_ids.tolist())
        fences = [f.compute for f in self._fences.values() if not pages.isdisjoint(f.pages)]
        writes = {id(w): w for p in load.host_ids.tolist()
                  if (w := self._writing.get(p)) is not None}
        return fences, [w for w in writes.values() if w.mark is None]

    def _try_issue(self, load: _Load, first_layers: int | None = None) -> None:
        self._advance_writes()
        fences, staged = self._blockers(load)
        if not fences and not staged:
            self._issue_load(load, first_layers)

    def force_issue(self, load: _Load) -> None:
        """Blocks on whatever holds `load` back, then issues it whole (a forward is waiting for
        it)."""
        if load.seq:  # issued in part
            self.finish_loads()
            return
        fences, staged = self._blockers(load)
        if staged:  # writes go out oldest first: every one before the newest it needs, too
            newest = max(self._writes.index(w) for w in staged)
            staged = [w for w in self._writes[:newest + 1] if w.mark is None]
        for compute in fences + [w.staging for w in staged]:
            compute.block_until_ready()
        self._advance_writes(budget=math.inf)
        self._issue_load(load)

    def _issue_load(self, load: _Load, first_layers: int | None = None) -> None:
        """Queues the load's copies layer by layer, each layer's flag after it: all of them, or
        the first `first_layers` (the rest at `finish_loads`)."""
        self.finish_loads()  # flags only grow: the load before must be wholly queued first
        for write in {id(w): w for p in load.host_ids.tolist()
                      if (w := self._writing.get(p))}.values():
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

    def _plan(self, load: _Load) -> _LoadPlan:
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
        return _LoadPlan(CopyRows(dsts.reshape(self.shards, layers, -1), srcs, sizes),
                         self._flags)

    def _queue_layers(self, load: _Load, upto: int) -> None:
        """Queues layers [load.queued_layers, upto) of the load, in order, each layer's flag
        after its copies; the landed mark once every layer is queued."""
        plan, num_layers = load.plan, self.device_pool.num_layers
        assert plan is not None
        for layer in range(load.queued_layers, min(upto, num_layers)):
            self.copier.copy_row(Direction.TO_DEVICE, plan.rows, layer)
            self.copier.signal(Direction.TO_DEVICE, plan.flags[:, layer], load.seq)
            load.queued_layers = layer + 1
        if load.queued_layers == num_layers:
            load.landed = self._last_load = self.copier.mark(Direction.TO_DEVICE, timed=True)
            load.plan, self._queuing = None, None

    def finish_loads(self) -> None:
        """Queues the later layers of a load launched with `first_layers` (no-op without one)."""
        if self._queuing is not None:
            self._queue_layers(self._queuing, self.device_pool.num_layers)

    def _copy(self, direction: Direction, dsts: np.ndarray, srcs: np.ndarray,
              sizes: np.ndarray) -> None:
        """Queues [shards, n] copies: row i on device shard i's copier (one device: a plain one)."""
        if self.shards == 1:
            self.copier.copy(direction, dsts[0], srcs[0], sizes)
        else:
            self.copier.copy(direction, dsts, srcs, sizes)

    def _pool_buffers(self) -> np.ndarray:
        """Each layer's K and V buffer addresses per device shard, [layers, K|V, shards], read once:
        the programs donate the pool arrays in place, so they never move (`check_buffers`). Read
        once because the pool's newest arrays are usually still being computed when a load is
        issued."""
        if self._buffers is None:
            jax.block_until_ready((self.device_pool.k, self.device_pool.v))
            self._buffers = self._current_buffers()
        return self._buffers

    def _current_buffers(self) -> np.ndarray:
        pool = self.device_pool
        return np.asarray([(pool.shard_pointers(k), pool.shard_pointers(v))
                           for k, v in zip(pool.k, pool.v)],
                          np.uint64)

    def check_buffers(self) -> None:
        """Raises if a pool array (any device shard of it) left its buffer (a program that did
        not donate it in place): copies issued into the old buffer would be lost."""
        if self._buffers is not None and not np.array_equal(self._current_buffers(), self._buffers):
            raise RuntimeError("a device pool array moved to another buffer; loads need the pool "
                               "donated in place by every program that updates it")

    # -- completion ----------------------------------------------------------------------------

    def _prune_fences(self) -> None:
        for key in [key for key, fence in self._fences.items() if _is_ready(fence.compute)]:
            del self._fences[key]

    def _advance_writes(self, budget: float | None = None) -> float:
        """Queues host copies of staged writes, strictly oldest first (two may write one host
        page: the newer must land last), about `budget` bytes of them (None: one piece,
        `tuning.write_piece_bytes`); returns what is left of the budget."""
        budget = self.tuning.write_piece_bytes if budget is None else budget
        for write in self._writes:
            if budget <= 0:
                break
            if write.mark is not None:
                continue
            if not _is_ready(write.staging):
                break
            budget = self._issue_write(write, budget)
        return budget

    def poll(self) -> list[TransferOp]:
        """Non-blocking: starts what is no longer held back; returns ops now complete."""
        self.finish_loads()
        self._prune_fences()  # also when no load waits: finished computes are let go
        self._advance_writes()
        for load in self._loads:
            if load.landed is None:
                self._try_issue(load)
        done: list[TransferOp] = []
        for write in [w for w in self._writes
                      if w.mark is not None and self.copier.is_done(w.mark)]:
            self._retire_write(write)
            done += write.ops
        for load in [ld for ld in self._loads
                     if ld.landed is not None and self.copier.is_done(ld.landed)]:
            self._retire_load(load)
            done += load.ops
        return done

    def _retire_write(self, write: _Write) -> None:
        self._writes.remove(write)
        self.counters["write_back_s"] += self._timed(write.start, write.mark)
        for page in write.host_ids.tolist():
            if self._writing.get(page) is write:
                del self._writing[page]

    def _retire_load(self, load: _Load) -> None:
        self._loads.remove(load)
        self.counters["load_back_s"] += self._timed(load.start, load.landed)

    def _timed(self, start: Mark | None, end: Mark | None) -> float:
        """Seconds between two done, timed marks (then given back to the copier)."""
        assert start is not None and end is not None
        seconds = self.copier.elapsed_s(start, end)
        self.copier.release(start)
        self.copier.release(end)
        return seconds

    def flush(self) -> list[TransferOp]:
        """Launches everything queued and blocks until every copy has finished."""
        self.launch()
        self.finish_loads()
        for write in list(self._writes):  # each piece's copies start once its gather has run
            jax.block_until_ready(write.staging)
            self._advance_writes(budget=math.inf)
        for load in self._loads:
            load.wait()
        for write in self._writes:
            assert write.mark is not None
            self.copier.wait(write.mark)
        jax.block_until_ready((self.device_pool.k, self.device_pool.v))
        self.check_buffers()
        return self.poll()

