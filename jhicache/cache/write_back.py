"""WriteBacks: device->host copies of pages, gathered on the device, then copied in pieces.

| phase   | what runs where                                                                      |
|---------|--------------------------------------------------------------------------------------|
| queue   | nothing (page id lists)                                                              |
| launch  | jitted gathers of the pages into staging arrays, one per power-of-two piece, a head  |
|         | first (`gather_pieces`, `TransferTuning`), on the compute stream: ordered after the |
|         | compute that wrote the pages and before any compute that reuses them                 |
| advance | a piece's device->host copies, once its staging is ready, on the copier's            |
|         | low-priority stream, a few layers at a time, oldest piece first                      |
A launched write is done once its last piece's copies have landed (`retire_done`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jhicache.buckets import pow2_bucket
from jhicache.cache.copier import Copier, Direction, Mark
from jhicache.cache.device_pool import DevicePool, PagePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.transfer_op import TransferOp, is_ready, runs
from jhicache.config import TransferTuning


def _stack_pages(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...],
                 ids: jax.Array) -> jax.Array:
    """Pages `ids` of every layer's K then V -> one contiguous [layers, 2, n, S, H, D] staging
    array (an XLA gather: whole pages, every element independent). One array, not one per
    layer: the host reads one address per piece, and the dispatch has one output to set up."""
    return jnp.stack([jnp.stack([k[ids], v[ids]]) for k, v in zip(ks, vs)])


gather_kv = jax.jit(_stack_pages)


def _sharded_gather(pool: PagePool):
    """`gather_kv` whose staging stays split as the pool's pages are (on the head axis, one
    contiguous [layers, 2, n, S, H / shards, D] buffer per device), so each device's shard of a
    page is copied to its own host block. Stated, not left to propagation: the copies rely on
    it."""
    sharding = pool.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise ValueError(f"a page pool over several devices needs a NamedSharding, got {sharding}")
    staging = jax.sharding.NamedSharding(sharding.mesh,
                                         jax.sharding.PartitionSpec(None, None, *sharding.spec))
    return jax.jit(_stack_pages, out_shardings=staging)


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


class Write:
    """One piece of a launched write-back: staged on device, then copied to host."""

    def __init__(self, ops: list[TransferOp], staging: jax.Array, host_ids: np.ndarray) -> None:
        self.ops, self.staging, self.host_ids = ops, staging, host_ids
        self.rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # dsts, srcs, sizes
        self.next_layer = 0  # the next layer whose host copies to queue
        self.start: Mark | None = None  # timed, before its first host copy
        self.mark: Mark | None = None  # timed, set once all its host copies are queued


class WriteBacks:
    """Queues, gathers and copies device pages to host pages, oldest first."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, copier: Copier,
                 tuning: TransferTuning, loads_queued: Callable[[], Mark | None]) -> None:
        self.device_pool, self.host_pool, self.copier = device_pool, host_pool, copier
        self.tuning = tuning
        # Called before any host copy: queues every load issued so far and returns the mark after
        # them (a host page a write fills may still be read by an earlier load).
        self._loads_queued = loads_queued
        self.shards = device_pool.num_shards
        self.layer_bytes = host_pool.layer_page_bytes  # of one shard
        self._gather = gather_kv if self.shards == 1 else _sharded_gather(device_pool)
        self.queued: list[TransferOp] = []
        self.launched: list[Write] = []  # pieces not retired, oldest first
        self._writing: dict[int, Write] = {}  # host page -> the newest write into it, until done
        self.seconds = 0.0  # per piece, its first copy's start to its last copy's end, summed

    def queued_into(self, host_pages: Iterable[int]) -> bool:
        """Whether a queued (not launched) write-back fills any of `host_pages`."""
        filling = {p for op in self.queued for p in op.host_pages}
        return bool(filling) and any(p in filling for p in host_pages)

    def writes_into(self, host_ids: np.ndarray) -> list[Write]:
        """The newest launched write into each of `host_ids`, until it is done."""
        writes = {id(w): w for p in host_ids.tolist() if (w := self._writing.get(p)) is not None}
        return list(writes.values())

    def pending_gathers(self) -> list[jax.Array]:
        """The gathers dispatched whose copies are not all queued: they may still read any
        device page freed now."""
        return [w.staging for w in self.launched if w.mark is None]

    def gather_sizes(self) -> list[int]:
        """Every padded page count a gather can take: the pieces of any write-back
        (`gather_pieces`) are power-of-two buckets no larger than the pool."""
        sizes, size = [], pow2_bucket(1)
        while size <= pow2_bucket(self.device_pool.layout.num_pages):
            sizes.append(size)
            size *= 2
        return sizes

    def lower_gather(self, size: int) -> jax.stages.Lowered:
        """The gather of `size` pages, lowered for this pool (as `launch` calls it), for a
        warm-up to compile ahead of serving."""
        return self._gather.lower(*self.device_pool.layer_types(), np.zeros(size, np.int32))

    def launch(self) -> list[TransferOp]:
        """Dispatches the gathers of every queued write-back: one per piece of `gather_pieces`;
        the ops are reported once the last piece has landed. Returns the ops launched."""
        ops, self.queued = self.queued, []
        if not ops:
            return ops
        device = np.asarray([p for op in ops for p in op.device_pages], np.int64)
        host = np.asarray([p for op in ops for p in op.host_pages], np.int64)
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
            write = Write(ops if i == len(pieces) - 1 else [], staging, host[start:start + size])
            self.launched.append(write)
            for page in write.host_ids.tolist():
                self._writing[page] = write
            # An earlier piece gathered while this one was dispatched: its copies start now.
            budget = self.advance(budget)
        return ops

    def advance(self, budget: float | None = None) -> float:
        """Queues host copies of staged pieces, strictly oldest first (two may write one host
        page: the newer must land last), about `budget` bytes of them (None: one piece,
        `tuning.write_piece_bytes`); returns what is left of the budget."""
        budget = self.tuning.write_piece_bytes if budget is None else budget
        for write in self.launched:
            if budget <= 0:
                break
            if write.mark is not None:
                continue
            if not is_ready(write.staging):
                break
            budget = self._issue(write, budget)
        return budget

    def queue_all(self, writes: list[Write]) -> None:
        """Blocks until `writes`, and every piece older than the newest of them, are staged,
        and queues all their copies (a load must follow them)."""
        if not writes:
            return
        newest = max(self.launched.index(w) for w in writes)
        for write in self.launched[:newest + 1]:
            if write.mark is None:
                write.staging.block_until_ready()
        self.advance(budget=math.inf)

    def _issue(self, write: Write, budget: float) -> float:
        """Queues a staged piece's host copies, whole layers while `budget` bytes last, in one
        batch; returns what is left of it. Small pieces at a time, because the copy engine
        serves copies in the order queued, across streams too: the forward's own small
        device->host copy (its sampled tokens) must not wait behind a whole write-back. One
        batch per piece, not per layer: no kernel waits for a written layer, and every driver
        call is host time that the steps around it pay."""
        after = self._loads_queued()
        if after is not None:
            self.copier.order_after(Direction.TO_HOST, after)  # host pages reused
        if write.rows is None:
            write.rows = self._rows(write)
            write.start = self.copier.mark(Direction.TO_HOST, timed=True)
        dsts, srcs, sizes = write.rows
        layers = self.device_pool.num_layers
        layer_bytes = float(sizes.sum())  # of one device shard, on its own copy stream
        first = write.next_layer
        more = layers if math.isinf(budget) else max(1, math.ceil(budget / layer_bytes))
        write.next_layer = min(layers, first + more)
        self._copy(dsts[:, first:write.next_layer].reshape(self.shards, -1),
                   srcs[:, first:write.next_layer].reshape(self.shards, -1),
                   np.tile(sizes, write.next_layer - first))
        if write.next_layer == layers:
            write.mark = self.copier.mark(Direction.TO_HOST, timed=True)
        return budget - layer_bytes * (write.next_layer - first)

    def _rows(self, write: Write) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every layer's copies of a staged piece, from one address per device shard: row i of
        the staging (the piece's i-th page) goes to host page host_ids[i], coalesced into
        runs. (dsts, srcs) [shards, layers, K runs then V runs], one size per run of a layer."""
        size = np.uint64(self.layer_bytes)
        src_rows, dst_pages, lengths = runs(np.arange(len(write.host_ids)), write.host_ids)
        layers, _, padded = write.staging.shape[:3]
        kv_rows = np.concatenate([src_rows, padded + src_rows]).astype(np.uint64)
        rows = np.arange(layers, dtype=np.uint64)[:, None] * np.uint64(2 * padded) + kv_rows
        base = np.asarray(self.device_pool.shard_pointers(write.staging), np.uint64)
        return (self.host_pool.layer_addresses(dst_pages), base[:, None, None] + rows * size,
                np.tile(lengths.astype(np.uint64) * size, 2))

    def _copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Queues [shards, n] copies: row i on device shard i's copier (one device: a plain one)."""
        if self.shards == 1:
            self.copier.copy(Direction.TO_HOST, dsts[0], srcs[0], sizes)
        else:
            self.copier.copy(Direction.TO_HOST, dsts, srcs, sizes)

    def retire_done(self, timed: Callable[[Mark | None, Mark | None], float]) -> list[TransferOp]:
        """Forgets the pieces whose copies have all landed; returns their ops."""
        done: list[TransferOp] = []
        done_writes = [w for w in self.launched
                       if w.mark is not None and self.copier.is_done(w.mark)]
        for write in done_writes:
            self.launched.remove(write)
            self.seconds += timed(write.start, write.mark)
            for page in write.host_ids.tolist():
                if self._writing.get(page) is write:
                    del self._writing[page]
            done += write.ops
        return done

    def flush(self) -> None:
        """Queues every launched piece's copies (blocking on each gather) and waits for them."""
        for write in list(self.launched):
            jax.block_until_ready(write.staging)
            self.advance(budget=math.inf)
        for write in self.launched:
            assert write.mark is not None
            self.copier.wait(write.mark)

