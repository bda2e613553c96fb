"""EngineConfig: the engine's frozen, self-validating settings (no I/O, no JAX)."""

from __future__ import annotations

import dataclasses
import enum

from jhicache.cache import TransferPath, WritePolicy


class CacheMode(enum.Enum):
    """How much prefix reuse the engine does."""

    OFF = "off"  # every prompt is computed in full
    DEVICE = "device"  # radix cache on the device tier only
    HIERARCHICAL = "hierarchical"  # device tier plus a pinned-host tier under it


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


def _require_positive(field: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{field}={value!r}: expected a positive integer")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Enum fields also accept their string values; `None` sizes are derived.

    Attributes:
      page_size: tokens per KV page, in both tiers.
      device_kv_tokens: device pool capacity in tokens; None sizes it from free device memory.
      host_kv_tokens: host pool capacity in tokens; None means `host_to_device_ratio` x device.
      cache_mode: "off", "device" or "hierarchical".
      write_policy: "write_back", "write_through" or "write_through_selective".
      write_through_threshold: hits before a node is written through (selective policy).
      dtype: "bfloat16" or "float32", for weights and KV pages.
      max_running_requests: requests decoded together at most.
      chunked_prefill_tokens: most new prompt tokens computed in one prefill step.
      load_back_threshold: host runs shorter than this many tokens are recomputed, not loaded.
      device_memory_fraction: share of free device memory the default device pool takes.
      check_invariants_every_step: debug flag: page accounting is verified after each step.
      transfer_path: host tier layout and copy path: "pages" (zero-copy Pallas kernels over a
        paged host pool; compute stream) or "segments" (host segments moved by copy-engine DMA
        one layer ahead of the forward, see jhicache/cache/segment_transfer.py; the default:
        it loaded an 8k-token prefix faster on the H200, see BENCHMARKS.md).
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
    host_to_device_ratio: int = 4
    device_memory_fraction: float = 0.5
    check_invariants_every_step: bool = False
    transfer_path: TransferPath | str = TransferPath.SEGMENTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_mode", _as_enum(CacheMode, self.cache_mode, "cache_mode"))
        object.__setattr__(self, "write_policy", _as_enum(WritePolicy, self.write_policy, "write_policy"))
        object.__setattr__(self, "dtype", _as_enum(KVDtype, self.dtype, "dtype"))
        object.__setattr__(self, "transfer_path", _as_enum(TransferPath, self.transfer_path, "transfer_path"))
        for field in ("page_size", "write_through_threshold", "max_running_requests",
                      "chunked_prefill_tokens", "host_to_device_ratio"):
            _require_positive(field, getattr(self, field))
        for field in ("device_kv_tokens", "host_kv_tokens"):
            _require_positive(field, getattr(self, field), allow_none=True)
        if not isinstance(self.load_back_threshold, int) or self.load_back_threshold < 0:
            raise ValueError(f"EngineConfig.load_back_threshold={self.load_back_threshold!r}: expected an int >= 0")
        if not 0.0 < self.device_memory_fraction <= 0.95:
            raise ValueError(f"EngineConfig.device_memory_fraction={self.device_memory_fraction!r}: expected (0, 0.95]")
        if self.chunked_prefill_tokens < self.page_size:
            raise ValueError("EngineConfig.chunked_prefill_tokens must be at least page_size")
        self._check_pool_sizes()

    def _check_pool_sizes(self) -> None:
        if self.device_kv_tokens is not None and self.device_kv_tokens < 2 * self.page_size:
            raise ValueError("EngineConfig.device_kv_tokens must hold at least two pages")
        if self.host_kv_tokens is not None and self.device_kv_tokens is not None:
            if self.host_kv_tokens <= self.device_kv_tokens:
                raise ValueError("EngineConfig.host_kv_tokens must exceed device_kv_tokens")

    def host_tokens_for(self, device_tokens: int) -> int:
        """Host pool capacity for a device pool of `device_tokens`."""
        if self.host_kv_tokens is not None:
            if self.host_kv_tokens <= device_tokens:
                raise ValueError("EngineConfig.host_kv_tokens must exceed the device pool's capacity")
            return self.host_kv_tokens
        return self.host_to_device_ratio * device_tokens
