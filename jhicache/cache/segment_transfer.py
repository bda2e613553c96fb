"""SegmentTransferController: the segments path. A write-back launch gathers its device pages on
device and DMAs them to new host segments (one per op and size chunk); a load-back DMAs whole
segment arrays to the device from launch on, layer group by layer group, and scatters each group's
rows into the device pool just before the forward computes that group.

Who does what, on which stream (all dispatch from the scheduler thread)
-----------------------------------------------------------------------
| phase                   | device work                                                     |
|-------------------------|-----------------------------------------------------------------|
| launch_writes           | per segment, one jitted gather of all layers' pages into        |
|                         | [2, n, S, H, D] staging arrays (compute stream), then one       |
|                         | device->host `device_put` of every array (copy engine)          |
| launch_loads            | the plan (segment arrays, rows, device pages), then one         |
|                         | host->device `device_put` per layer group (`layer_groups`: 1,   |
|                         | 2, then 4 layers) while the staged copies fit `staging_bytes`   |
|                         | (copy engine; queued in layer order, so it is busy from launch) |
| ticket.wait(l) (runner) | at the first layer of a group: the DMAs the freed staging room  |
|                         | allows (always two groups ahead), then one jitted scatter of    |
|                         | this group's rows into the donated pool arrays (compute         |
|                         | stream); the host thread never blocks                           |
| drive_loads / poll      | the same for every layer not yet dispatched (a ticket whose     |
|                         | batch never ran must still complete: nothing stays half-loaded) |
The copy engine only overlaps compute for a *whole* pinned_host array: slicing one compiles to
a compute-stream fusion (reference/h200_probe_notes.md). Hence one host array per segment and
layer, read whole, and the page placement done on device. And a host->device `device_put`
dispatched while compute is queued waits for that compute (H200, 28 x 16.8 MB: 9.1 ms alone or
before 11.6 ms of matmuls, 18.9 ms after them): hence every DMA the staging budget allows is
dispatched at launch, before the batch's forward.

Why this is safe with donated buffers
-------------------------------------
The gather reads the pool arrays and is dispatched before the pages can be freed (the cache
launches queued writes before any page leaves the tree), so JAX orders it before any later
kernel that donates those arrays ("ordered before any reuse", see transfer.py). Segments are
written once and never modified, so no host-side ordering is needed at all. The scatter donates
the pool arrays and `set_layer`s its outputs, and the forward's layer l takes those outputs as
input, so the data dependency orders scatter before compute. Until its layer is scattered a
loading page is only read by a batch holding the load's ticket (the runner calls `wait(l)`
first); every other forward runs after `drive_loads`/`poll` dispatched all layers.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax

from jhicache.cache.device_pool import PagePool
from jhicache.cache.host_pool import HostPool
from jhicache.cache.host_segments import HostSegmentPool
from jhicache.cache.ticket import LayerCopies, LoadMarks, array_ready, block_on, layer_groups
from jhicache.cache.transfer import ControllerBase, CopyFns, TransferController, TransferOp, pad_to, pow2_bucket
from jhicache.pallas_kernels.page_copy import gather_pages_layers, scatter_rows_layers

# How many bytes of a load's host->device DMAs are dispatched at launch, before the forward (an
# 8k-token Qwen2-7B prefix is 470 MB). The rest go out as the forward's waits reach them, behind
# queued compute (which they then wait for). This bounds what is queued ahead, not device memory:
# the forward never blocks, so a load's staged copies can all be alive at once.
STAGING_BYTES = 1 << 30


@jax.jit
def _gather_kv(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], ids: jax.Array) -> tuple[jax.Array, ...]:
    """Per layer, pages `ids` of K and V -> one contiguous [2, n, S, H, D] staging array (page-copy kernel)."""
    return tuple(gather_pages_layers((k, v), ids) for k, v in zip(ks, vs))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _scatter_kv(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], staged: tuple[tuple[jax.Array, ...], ...],
                rows: tuple[jax.Array, ...], ids: tuple[jax.Array, ...]
                ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array]:
    """For each layer of a group and each part, rows `rows` of the part's staged segment layer ->
    device pages `ids` (one dispatch for the group; a repeated pair is harmless). A page-copy
    kernel, not an XLA scatter: that ran at ~480 GB/s on the H200, 2 ms of an 8k Qwen2-7B load.
    Also returns a scalar read from an output (any one: all outputs of one run become ready
    together); unlike the donated K/V outputs it lives on, so its readiness tells when the
    group's pages were placed (LoadTimeline)."""
    new_k, new_v = [], []
    for k, v, parts in zip(ks, vs, staged):
        for part, part_rows, part_ids in zip(parts, rows, ids):
            k, v = scatter_rows_layers((k, v), part, part_rows, part_ids)
        new_k.append(k)
        new_v.append(v)
    return tuple(new_k), tuple(new_v), new_v[-1].reshape(-1)[0]


def segment_rows(n: int) -> int:
    """Rows of a segment holding n pages: a power of two up to 4, then a multiple of a quarter
    of n's power of two, so gathers compile 4 shapes per octave and padding wastes <= 25%."""
    if n <= 4:
        return pow2_bucket(n, 1)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


class _Part(NamedTuple):
    """The rows one load takes from one segment, padded to a power of two."""

    layers: list[jax.Array]  # the segment's per-layer pinned_host arrays (kept alive by the load)
    rows: jax.Array  # int32 [m]
    device_ids: jax.Array  # int32 [m]


class SegmentLoad:
    """One merged load-back launch; dispatches its layer groups in order as the tickets ask (LayerCopies)."""

    def __init__(self, parts: list[_Part], pool: PagePool, staging_bytes: int) -> None:
        self.parts, self.pool = parts, pool
        self._rows = tuple(p.rows for p in parts)
        self._ids = tuple(p.device_ids for p in parts)
        self._groups = layer_groups(pool.num_layers)
        self._group_of = [g for g, layers in enumerate(self._groups) for _ in layers]  # layer -> its group
        self._group_bytes = [sum(p.layers[layer].nbytes for layer in g for p in parts) for g in self._groups]
        self._staging_bytes = staging_bytes
        self._staged: dict[int, tuple[tuple[jax.Array, ...], ...]] = {}  # group -> per layer, device copies of each part
        self.outputs: list[jax.Array] = []  # per dispatched layer: the scattered K array
        self._landed: dict[int, tuple[jax.Array, ...]] = {}  # group -> its DMA's arrays (timing; freed at retire)
        self._placed: dict[int, jax.Array] = {}  # group -> a scalar its scatter computed (timing)
        self._next_group = 0
        self._next_prefetch = 0
        self._prefetch()  # at launch, before the batch's inputs and embedding are even dispatched

    @property
    def dispatched(self) -> bool:
        return len(self.outputs) == self.pool.num_layers

    def _prefetch(self) -> None:
        """Queues the DMAs of the next groups while the copies not yet handed to a scatter fit in
        `staging_bytes`, and always at least the group after the next one to scatter: the copy
        engine is kept busy from launch on, instead of one group ahead of a compute that may be
        shorter than the load."""
        staged = sum(self._group_bytes[g] for g in self._staged)
        while self._next_prefetch < len(self._groups):
            group = self._next_prefetch
            ahead = group <= self._next_group + 1
            if not ahead and staged + self._group_bytes[group] > self._staging_bytes:
                break
            # One call for the group: a batched device_put costs less host time than one per array.
            flat = jax.device_put([p.layers[layer] for layer in self._groups[group] for p in self.parts],
                                  self.pool.sharding)
            n = len(self.parts)
            self._staged[group] = tuple(tuple(flat[i : i + n]) for i in range(0, len(flat), n))
            self._landed[group] = tuple(flat)
            staged += self._group_bytes[group]
            self._next_prefetch += 1

    def _scatter(self, group: int) -> None:
        staged = self._staged.pop(group)
        self._next_group = group + 1
        self._prefetch()  # refills the window this group frees, before its scatter is queued
        layers = self._groups[group]
        ks, vs, self._placed[group] = _scatter_kv(
            tuple(self.pool.k[layer] for layer in layers), tuple(self.pool.v[layer] for layer in layers),
            staged, self._rows, self._ids)
        for layer, k, v in zip(layers, ks, vs):
            self.pool.set_layer(layer, k, v)
        self.outputs.extend(ks)

    def wait(self, layer: int) -> None:
        """Dispatches every layer group up to `layer`'s not yet dispatched; never blocks."""
        while len(self.outputs) <= layer:
            self._scatter(self._next_group)

    def is_ready(self, layer: int) -> bool:
        return layer < len(self.outputs) and array_ready(self.outputs[layer], layer, self._current)

    def block(self, layer: int) -> None:
        self.wait(layer)
        block_on(self.outputs[layer], layer, self._current)

    def marks(self, layer: int) -> LoadMarks:
        """`layer`'s group: the arrays its DMA wrote, and a scalar its scatter computed."""
        group = self._group_of[layer]
        return LoadMarks(self._landed[group], self._placed[group])

    def _current(self, layer: int) -> jax.Array:
        return self.pool.k[layer]


class SegmentTransferController(ControllerBase):
    """Segments path: merges and launches copies between a DevicePool and a HostSegmentPool."""

    def __init__(self, device_pool: PagePool, host_pool: HostSegmentPool, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(device_pool, host_pool.layout)
        self.host_pool = host_pool
        self.staging_bytes = staging_bytes

    def _write(self, ops: list[TransferOp]) -> LayerCopies:
        """One segment per op and chunk (`segment_chunks`): a later load of one node then moves only
        that node's segments over PCIe, not whatever else was evicted with it."""
        pool, num_layers = self.device_pool, self.device_pool.num_layers
        chunks = [(op.device_pages[a:b], op.host_pages[a:b]) for op in ops for a, b in _bounds(len(op.device_pages))]
        ids = jax.device_put([pad_to(dev, segment_rows(len(dev))) for dev, _ in chunks])  # one call, no compile
        staged = [_gather_kv(tuple(pool.k), tuple(pool.v), chunk_ids) for chunk_ids in ids]
        flat = jax.device_put([a for layers in staged for a in layers], self.host_pool.sharding)  # DMA, one call
        segments = [flat[i : i + num_layers] for i in range(0, len(flat), num_layers)]
        for layers, (_, host) in zip(segments, chunks):
            self.host_pool.add_segment(layers, host)
        return _WrittenSegments(segments)

    def _load(self, ops: list[TransferOp]) -> LayerCopies:
        host = [p for op in ops for p in op.host_pages]
        dev = [p for op in ops for p in op.device_pages]
        groups: dict[int, tuple[list[jax.Array], list[int], list[int]]] = {}
        for (segment, row), page in zip(self.host_pool.locate(host), dev):
            _, rows, ids = groups.setdefault(segment.seg_id, (segment.layers, [], []))
            rows.append(row)
            ids.append(page)
        parts = _parts(list(groups.values()))
        self.counters["load_back_moved_bytes"] += sum(a.nbytes for part in parts for a in part.layers)
        return SegmentLoad(parts, self.device_pool, self.staging_bytes)

    def drive_loads(self) -> None:
        """Dispatches the remaining layers of every launched load (non-blocking)."""
        for launch in self._in_flight:
            if isinstance(launch.copies, SegmentLoad) and not launch.copies.dispatched:
                launch.copies.wait(self.device_pool.num_layers - 1)


class _WrittenSegments:
    """A write-back launch's host arrays, per segment and layer (LayerCopies; never donated)."""

    def __init__(self, segments: list[list[jax.Array]]) -> None:
        self.segments = segments

    def wait(self, layer: int) -> None:
        self.block(layer)

    def is_ready(self, layer: int) -> bool:
        return all(layers[layer].is_ready() for layers in self.segments)

    def block(self, layer: int) -> None:
        for layers in self.segments:
            layers[layer].block_until_ready()

    def marks(self, layer: int) -> None:
        return None


def segment_chunks(n: int) -> list[int]:
    """How a write-back of n pages is cut into segments: up to three powers of two, largest first,
    while more than 16 pages are left, then the rest (padded by `segment_rows`). Loads DMA whole
    segments, so padding is PCIe time: this keeps it to a few percent instead of up to 25%, with
    few shapes to compile."""
    sizes: list[int] = []
    while n > 16 and len(sizes) < 3:
        sizes.append(1 << (n.bit_length() - 1))
        n -= sizes[-1]
    return sizes + [n] if n else sizes


def _bounds(n: int) -> list[tuple[int, int]]:
    starts = itertools.accumulate(segment_chunks(n), initial=0)
    return list(itertools.pairwise(starts))


def _parts(groups: list[tuple[list[jax.Array], list[int], list[int]]]) -> list[_Part]:
    """Each segment's (layers, rows, device pages), the ids padded to a power of two (repeated
    pairs copy the same page again: cheap, and few shapes to compile) and moved to the device in
    one batched call. Not `put_int32`: its unpack compiles once per set of shapes, and the parts of
    a load come in endless combinations."""
    sizes = [pow2_bucket(len(ids), 4) for _, _, ids in groups]
    put = jax.device_put([pad_to(x, size) for (_, rows, ids), size in zip(groups, sizes) for x in (rows, ids)])
    return [_Part(layers, put[2 * i], put[2 * i + 1]) for i, (layers, _, _) in enumerate(groups)]


def make_controller(device_pool: PagePool, host_pool: HostPool | HostSegmentPool,
                    copy_fns: CopyFns | None = None) -> ControllerBase:
    """The transfer controller matching the host pool's layout (`copy_fns`: pages path only)."""
    if isinstance(host_pool, HostSegmentPool):
        return SegmentTransferController(device_pool, host_pool)
    return TransferController(device_pool, host_pool, copy_fns)
