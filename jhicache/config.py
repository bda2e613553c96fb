"""EngineConfig: the engine's frozen, self-validating settings (no I/O, no JAX)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
from typing import Any


class CacheMode(enum.Enum):
    """How much prefix reuse the engine does."""

    OFF = "off"  # every prompt is computed in full
    DEVICE = "device"  # radix cache on the device tier only
    HIERARCHICAL = "hierarchical"  # device tier plus a pinned-host tier under it


class WritePolicy(enum.Enum):
    """When a node's device pages are copied to the host tier."""

    WRITE_BACK = "write_back"  # only when the node is evicted from device
    WRITE_THROUGH = "write_through"  # when the node enters the tree (first insert visit)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # at the `threshold`-th insert visit


class StorageWritePolicy(enum.Enum):
    """When host pages are written to the storage tier."""

    WRITE_THROUGH = "write_through"  # when they are written to host
    WRITE_BACK = "write_back"  # when they are evicted from host (kept until written)


class StorageBackend(enum.Enum):
    """Where the storage tier keeps its pages."""

    FILE = "file"  # a directory (storage_dir), local or shared: one file a page
    MOONCAKE = "mooncake"  # a Mooncake Store that several servers share


# The storage backend config's keys, by backend (Mooncake's own store config names, as
# SGLang's --hicache-storage-backend-extra-config takes them)
STORAGE_BACKEND_KEYS = {
    StorageBackend.FILE: (),
    StorageBackend.MOONCAKE: ("local_hostname", "metadata_server", "global_segment_size",
                              "local_buffer_size", "protocol", "device_name",
                              "master_server_address"),
}


class FetchPolicy(enum.Enum):
    """How long a request waits for its pages to be read from storage (SGLang's prefetch
    stop policies)."""

    BEST_EFFORT = "best_effort"  # admitted when its turn comes, with the pages read by then
    WAIT_COMPLETE = "wait_complete"  # admitted once every page found has been read
    TIMEOUT = "timeout"  # as wait_complete, up to a base plus a per-token allowance
    # admitted at once: computes the prefix's head while its tail is read from storage, last
    # page first, and takes the pages read from where the two meet (the best TTFT when the
    # disk reads about as fast as the GPU computes; costs GPU time the others would get)
    SPLIT = "split"


class KVDtype(enum.Enum):
    """Storage dtype of weights and KV pages."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


def _as_enum(enum_type: type[enum.Enum], value: object, field: str) -> enum.Enum:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"EngineConfig.{field}={value!r}: expected one of {allowed}") from None


def _backend_config(text: str, keys: tuple[str, ...]) -> str:
    """The storage backend config as sorted JSON text; ValueError naming what is wrong (not
    JSON, not an object, a key the backend does not take)."""
    where = "EngineConfig.storage_backend_config"
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} for this backend; known: "
                         f"{list(keys)}")
    return json.dumps(value, sort_keys=True)


def _int(field: str, value: object, low: int) -> int:
    """`value` as a Python int >= low; numpy integers count, bools, floats and strings do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"EngineConfig.{field}={value!r}: expected an int >= {low}")
    return int(value)


def _real(field: str, value: object, low: float, high: float, *, low_open: bool) -> float:
    """`value` as a float in (low, high] (or [low, high]); bools and strings do not count."""
    number = math.nan  # fails every test below
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    above_low = low < number if low_open else low <= number
    if not (math.isfinite(number) and above_low and number <= high):
        span = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"EngineConfig.{field}={value!r}: expected a number in {span}")
    return number


def _page_multiple(field: str, tokens: int, page_size: int) -> None:
    """Pools hold whole pages: a size that is not a multiple is refused rather than rounded."""
    if tokens % page_size:
        down, up = tokens // page_size * page_size, -(-tokens // page_size) * page_size
        raise ValueError(f"EngineConfig.{field}={tokens} is not a multiple of "
                         f"page_size={page_size}; use {down or up} or {up}")


@dataclasses.dataclass(frozen=True)
class TransferTuning:
    """How much the transfers queue at a time (bytes of one device shard).

    Attributes:
      write_piece_bytes: host copies of write-backs queued per poll (and per `launch_writes`):
        small against a whole write-back, because a forward's own small device->host copy
        (its sampled tokens) waits behind copies queued before it (`WriteBacks._issue`).
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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Enum fields also accept their string values; `None` sizes are derived.

    Attributes:
      page_size: tokens per KV page, in both tiers.
      device_kv_tokens: device pool capacity in tokens; None sizes it from free device memory
        (`device_memory_fraction` of it) on a GPU, and means 16384 tokens on the CPU.
      host_kv_tokens: host pool capacity in tokens; None means `host_to_device_ratio` x device.
        Both sizes must be whole pages (multiples of page_size).
      cache_mode: "off", "device" or "hierarchical".
      write_policy: "write_back", "write_through" or "write_through_selective".
      write_through_threshold: hits before a node is written through (selective policy).
      dtype: "bfloat16" or "float32", for weights and KV pages.
      max_running_requests: requests decoded together at most.
      chunked_prefill_tokens: most new prompt tokens computed in one prefill step.
      load_back_threshold: host runs shorter than this many tokens are recomputed, not loaded.
      host_to_device_ratio: host pool size as a multiple (> 1) of the device pool's, when
        host_kv_tokens is None; capped at 80% of the host memory available, since the whole
        host pool is allocated and pinned when the engine starts.
      device_memory_fraction: share of free device memory the default device pool takes.
      check_invariants_every_step: debug flag: page accounting is verified after each step.
      overlap_schedule: plan and dispatch step N+1 while step N runs on the device, feeding
        its sampled tokens on the device (False: the lock-step loop, for debugging).
      tensor_parallel_size: devices the model is sharded over (Megatron-style, one mesh axis).
        It must divide the device count and the attention heads (checked when the engine is
        built). Every cache mode works with it: both tiers are split on the KV heads, each
        device with its own shard of every page.
      max_context_len: the longest request (prompt plus max_new_tokens) the engine admits;
        None: the model's context, capped by the device pool. It sets the page-table width
        of every step shape; longer requests are refused when they are submitted.
      fail_on_compile: compiling a program outside `warmup()` raises CompileError naming it
        (as vLLM's TPU backend can): for checking that the warm-up covers every step.
      storage_dir: a directory for the storage tier under the host tier (hierarchical mode
        only): host pages are written there (see storage_write_policy), and a request's
        pages past its cached prefix are read back from it. Pages live in a
        subdirectory per namespace (model, dtype, page size, layout) and survive restarts:
        `Engine.close` writes every cached page storage lacks, whatever the write policies.
        None: no storage tier.
      storage_backend: "file" (the default: a tier in `storage_dir`, when one is given) or
        "mooncake" (a tier in a Mooncake Store that several servers share; no storage_dir).
      storage_backend_config: the backend's settings as JSON text (an object; on the command
        line "@FILE" reads it from a file); for Mooncake its store config names
        (`STORAGE_BACKEND_KEYS`), over its `MOONCAKE_*` environment variables.
      storage_write_policy: "write_through" (a page goes to storage when it is written to
        host) or "write_back" (when it is evicted from host: its host page is freed once
        written). Either way a prefix's head pages are planned before its tail.
      storage_capacity_bytes: the directory's cap for this namespace, however many servers
        write to it (LRU eviction over all their pages, from 95% down to 85% of it); None: no
        cap.
      storage_model_name: the model's identity in the namespace; None derives it (a preset's
        name and seed, a checkpoint directory's name, and the model config's hash). Give one
        name to share a directory between servers whose checkpoints live at different paths.
      fetch_policy: "best_effort", "wait_complete", "timeout" or "split" (see FetchPolicy).
      fetch_threshold: fewer tokens than this past the cached prefix are not asked of storage.
      fetch_timeout_s, fetch_timeout_per_ki_token_s: the timeout policy's allowance: the base
        plus this much per 1024 tokens asked for.
      storage_io_threads: threads reading from storage at once.
      transfer_tuning: how much the host tier's copies queue at a time (`TransferTuning`; on
        the command line, one flag per field: `--transfer-tuning-load-head-bytes`...).
    """

    page_size: int = 64
    device_kv_tokens: int | None = None
    host_kv_tokens: int | None = None
    cache_mode: CacheMode | str = CacheMode.HIERARCHICAL
    write_policy: WritePolicy | str = WritePolicy.WRITE_BACK
    write_through_threshold: int = 2
    dtype: KVDtype | str = KVDtype.BFLOAT16
    max_running_requests: int = 64
    chunked_prefill_tokens: int = 4096
    load_back_threshold: int = 10
    host_to_device_ratio: float = 4.0
    device_memory_fraction: float = 0.5
    check_invariants_every_step: bool = False
    overlap_schedule: bool = True
    tensor_parallel_size: int = 1
    max_context_len: int | None = None
    fail_on_compile: bool = False
    storage_dir: str | None = None
    storage_backend: StorageBackend | str = StorageBackend.FILE
    storage_backend_config: str | None = None
    storage_write_policy: StorageWritePolicy | str = StorageWritePolicy.WRITE_THROUGH
    storage_capacity_bytes: int | None = None
    storage_model_name: str | None = None
    fetch_policy: FetchPolicy | str = FetchPolicy.TIMEOUT
    fetch_threshold: int = 256
    fetch_timeout_s: float = 2.0
    fetch_timeout_per_ki_token_s: float = 0.1
    storage_io_threads: int = 8
    transfer_tuning: TransferTuning = TransferTuning()

    def __post_init__(self) -> None:
        fix = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen)
        fix("cache_mode", _as_enum(CacheMode, self.cache_mode, "cache_mode"))
        fix("write_policy", _as_enum(WritePolicy, self.write_policy, "write_policy"))
        fix("dtype", _as_enum(KVDtype, self.dtype, "dtype"))
        fix("fetch_policy", _as_enum(FetchPolicy, self.fetch_policy, "fetch_policy"))
        fix("storage_write_policy", _as_enum(StorageWritePolicy, self.storage_write_policy,
                                             "storage_write_policy"))
        fix("storage_backend", _as_enum(StorageBackend, self.storage_backend, "storage_backend"))
        for field in ("page_size", "write_through_threshold", "max_running_requests",
                      "chunked_prefill_tokens", "tensor_parallel_size"):
            fix(field, _int(field, getattr(self, field), 1))
        if self.max_context_len is not None:
            fix("max_context_len", _int("max_context_len", self.max_context_len, 1))
        for field in ("device_kv_tokens", "host_kv_tokens"):
            if getattr(self, field) is not None:
                fix(field, _int(field, getattr(self, field), 1))
                _page_multiple(field, getattr(self, field), self.page_size)
        fix("load_back_threshold", _int("load_back_threshold", self.load_back_threshold, 0))
        fix("host_to_device_ratio",
            _real("host_to_device_ratio", self.host_to_device_ratio, 1.0, 1e6, low_open=True))
        fix("device_memory_fraction",
            _real("device_memory_fraction", self.device_memory_fraction, 0.0, 0.95, low_open=True))
        for field in ("check_invariants_every_step", "overlap_schedule", "fail_on_compile"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"EngineConfig.{field}={getattr(self, field)!r}: "
                                 "expected True or False")
        if not isinstance(self.transfer_tuning, TransferTuning):
            raise ValueError(f"EngineConfig.transfer_tuning={self.transfer_tuning!r}: expected "
                             "a TransferTuning")
        self._check_storage()
        if self.chunked_prefill_tokens < self.page_size:
            raise ValueError("EngineConfig.chunked_prefill_tokens must be at least page_size")
        self._check_pool_sizes()

    def _check_storage(self) -> None:
        fix = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen)
        fix("fetch_threshold", _int("fetch_threshold", self.fetch_threshold, 0))
        fix("storage_io_threads", _int("storage_io_threads", self.storage_io_threads, 1))
        for field in ("fetch_timeout_s", "fetch_timeout_per_ki_token_s"):
            fix(field, _real(field, getattr(self, field), 0.0, 1e6, low_open=False))
        if self.storage_capacity_bytes is not None:
            fix("storage_capacity_bytes",
                _int("storage_capacity_bytes", self.storage_capacity_bytes, 1))
        for field in ("storage_dir", "storage_model_name"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"EngineConfig.{field}={value!r}: expected a non-empty string")
        if self.storage_backend is StorageBackend.MOONCAKE:
            for field in ("storage_dir", "storage_capacity_bytes"):
                if getattr(self, field) is not None:
                    raise ValueError(f"EngineConfig.{field} is not used by the mooncake "
                                     f"storage backend (the store's master holds its size)")
        if self.storage_enabled and self.cache_mode is not CacheMode.HIERARCHICAL:
            raise ValueError("a storage tier (EngineConfig.storage_dir or storage_backend="
                             "'mooncake') needs cache_mode='hierarchical' (the storage tier "
                             "sits under the host tier)")
        if self.storage_backend_config is not None:
            fix("storage_backend_config", _backend_config(
                self.storage_backend_config,
                STORAGE_BACKEND_KEYS[StorageBackend(self.storage_backend)]))

    @property
    def storage_enabled(self) -> bool:
        """Whether the engine has a storage tier (a directory, or a Mooncake Store)."""
        return self.storage_dir is not None or self.storage_backend is StorageBackend.MOONCAKE

    def with_storage(self, backend: StorageBackend | str | None, storage_dir: str | None = None,
                     backend_config: str | None = None) -> EngineConfig:
        """This config with another storage tier: `backend` "file" in `storage_dir`, or
        "mooncake" with `backend_config`, or none (None); ValueError for a bad setting."""
        if backend is None and (storage_dir or backend_config):
            raise ValueError("no storage tier takes no storage_dir or storage_backend_config")
        config = dataclasses.replace(self, storage_backend=backend or StorageBackend.FILE,
                                     storage_dir=storage_dir, storage_backend_config=backend_config)
        if backend is not None and not config.storage_enabled:
            raise ValueError("EngineConfig.storage_dir: the file storage backend needs one")
        return config

    def storage_settings(self) -> dict[str, Any]:
        """The storage backend's settings (`storage_backend_config`), as a dict."""
        text = self.storage_backend_config
        return {} if text is None else dict(json.loads(text))

    def _check_pool_sizes(self) -> None:
        if self.device_kv_tokens is not None and self.device_kv_tokens < 2 * self.page_size:
            raise ValueError("EngineConfig.device_kv_tokens must hold at least two pages")
        if self.cache_mode is not CacheMode.HIERARCHICAL:
            return  # no host pool is built, so its size is not checked against the device's
        if self.host_kv_tokens is not None and self.device_kv_tokens is not None:
            if self.host_kv_tokens <= self.device_kv_tokens:
                raise ValueError(f"EngineConfig.host_kv_tokens={self.host_kv_tokens} must exceed "
                                 f"device_kv_tokens={self.device_kv_tokens}")

    def host_tokens_for(self, device_tokens: int) -> int:
        """Host pool capacity for a device pool of `device_tokens` (whole pages)."""
        tokens = self.host_kv_tokens
        if tokens is None:
            tokens = (int(self.host_to_device_ratio * device_tokens) // self.page_size
                      * self.page_size)
        if tokens <= device_tokens:
            raise ValueError(f"EngineConfig: the host pool ({tokens} tokens) must exceed the "
                             f"device pool's capacity ({device_tokens} tokens); raise "
                             f"host_kv_tokens or host_to_device_ratio")
        return tokens
