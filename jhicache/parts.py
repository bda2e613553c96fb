"""EngineParts: an engine's construction in one place: the model's layout over its devices, the
tiers' sizes from the config and free memory (`CacheTiers.build` makes the pools, the copier and
the cache), the storage tier's namespace, and the scheduler, runner, step grid and step
executor built over them."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from jhicache.cache import RESERVED_PAGES, CacheTiers, DevicePool, HostPool, PoolLayout, PrefixCache
from jhicache.cache.fetches import FetchRule
from jhicache.cache.file_storage import FileStorage
from jhicache.cache.host_memory import available_bytes
from jhicache.cache.storage import Storage, StorageNamespace
from jhicache.config import CacheMode, EngineConfig, FetchPolicy, KVDtype, StorageBackend
from jhicache.executor import StepExecutor
from jhicache.grid import ShapeGrid
from jhicache.inputs import Limits
from jhicache.models import (
    CausalLM,
    DecoderConfig,
    init_random,
    load_pretrained,
    preset_config,
    read_config,
)
from jhicache.models.sharding import TensorParallel
from jhicache.penalties import TokenHistory
from jhicache.runner import ModelRunner
from jhicache.scheduler import Scheduler

_CPU_DEFAULT_DEVICE_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What an engine steps, built for one model and config."""

    tp: TensorParallel | None  # None: one device, no mesh
    device_pool: DevicePool
    cache: PrefixCache
    scheduler: Scheduler
    runner: ModelRunner
    grid: ShapeGrid
    executor: StepExecutor
    limits: Limits  # what a submitted request is checked against
    storage_for: Callable[[EngineConfig], Storage]  # a storage backend for a config's settings

    @classmethod
    def create(cls, model: CausalLM, config: EngineConfig) -> EngineParts:
        tp = tensor_parallel(model.config, config)
        # before the pool, whose default size is a share of the device memory left: replicated
        # over a mesh, as the logits it penalises are
        history = TokenHistory(config.max_running_requests, model.config.vocab_size,
                               jax.sharding.SingleDeviceSharding(jax.devices()[0]) if tp is None
                               else tp.sharding(jax.sharding.PartitionSpec()))
        layout = _device_layout(model.config, config, tp)
        hierarchical = config.cache_mode is CacheMode.HIERARCHICAL
        tiers = CacheTiers.build(
            layout, _host_tokens(layout, config) // config.page_size if hierarchical else 0,
            sharding=None if tp is None else tp.kv_pages_sharding, policy=config.write_policy,
            load_back_threshold=config.load_back_threshold,
            write_through_threshold=config.write_through_threshold,
            tuning=config.transfer_tuning,
            storage=(functools.partial(_storage, model.config, config)
                     if hierarchical and config.storage_enabled else None),
            storage_io_threads=config.storage_io_threads,
            storage_policy=config.storage_write_policy, fetch_rule=_fetch_rule(config))
        device_pool, host_pool, transfers, cache = (tiers.device_pool, tiers.host_pool,
                                                    tiers.transfers, tiers.cache)
        runner = ModelRunner(model, device_pool, tp)
        grid = ShapeGrid.create(
            chunked_prefill_tokens=config.chunked_prefill_tokens,
            max_running_requests=config.max_running_requests, page_size=config.page_size,
            max_context_len=_context_len(model.config, config, layout))
        # With a host tier every forward takes the load flags (one compiled variant per shape,
        # whether or not its loads are still landing); without one nothing is ever loaded.
        load_flags = device_pool.load_flags if host_pool is not None else None
        writes = None if transfers is None else transfers.writes
        return cls(tp, device_pool, cache, Scheduler(config, cache), runner, grid,
                   StepExecutor(runner, grid, load_flags, writes, history),
                   Limits(model.config.vocab_size, grid.max_context_len),
                   functools.partial(_storage, model.config, host_pool=host_pool))


def pretrained_model(path: str, config: EngineConfig) -> tuple[CausalLM, EngineConfig]:
    """A Hugging Face checkpoint's model (of a family `jhicache.models.FAMILIES` holds), read
    straight into the sharded layout, and the config naming it for the storage tier."""
    tp = tensor_parallel(read_config(path), config)
    model = load_pretrained(path, dtype=_jnp_dtype(config.dtype), tp=tp)
    if config.storage_model_name is None:
        config = dataclasses.replace(config, storage_model_name=f"checkpoint {Path(path).name}")
    return model, config


def preset_model(name: str, config: EngineConfig,
                 seed: int) -> tuple[CausalLM, EngineConfig]:
    """Seeded random weights of a preset shape, and the config naming them for the storage
    tier."""
    model_config = preset_config(name)
    tp = tensor_parallel(model_config, config)
    model = init_random(model_config, seed=seed, dtype=_jnp_dtype(config.dtype), tp=tp)
    if config.storage_model_name is None:
        config = dataclasses.replace(config, storage_model_name=f"preset {name} seed {seed}")
    return model, config


def tensor_parallel(model: DecoderConfig, config: EngineConfig) -> TensorParallel | None:
    """The model's layout over `config.tensor_parallel_size` devices; None for one device, whose
    programs then run without a mesh or shard_map."""
    if config.tensor_parallel_size == 1:
        return None
    return TensorParallel.create(config.tensor_parallel_size, model,
                                 field="EngineConfig.tensor_parallel_size")


def _jnp_dtype(dtype: KVDtype | str) -> jnp.dtype:
    return jnp.dtype(jnp.bfloat16 if KVDtype(dtype) is KVDtype.BFLOAT16 else jnp.float32)


def _device_layout(model: DecoderConfig, config: EngineConfig,
                   tp: TensorParallel | None) -> PoolLayout:
    dtype = _jnp_dtype(config.dtype)
    heads = model.num_key_value_heads if tp is None else tp.storage_kv_heads
    shards = 1 if tp is None else tp.size
    # per device: the default size is taken from one device's free memory
    token_bytes = (2 * model.num_hidden_layers * heads // shards * model.head_dim
                   * dtype.itemsize)
    tokens = config.device_kv_tokens or _default_device_tokens(token_bytes,
                                                               config.device_memory_fraction)
    return PoolLayout(num_layers=model.num_hidden_layers,
                      num_pages=tokens // config.page_size + 1, page_size=config.page_size,
                      num_kv_heads=heads, head_dim=model.head_dim, dtype=dtype)


def _context_len(model: DecoderConfig, config: EngineConfig, layout: PoolLayout) -> int:
    """The longest request (prompt and output): the model's context, capped by the device
    pool (a request's pages must fit in it) and by `max_context_len`."""
    pool = (layout.num_pages - RESERVED_PAGES) * config.page_size
    return min(model.max_position_embeddings, pool, config.max_context_len or pool)


def _host_tokens(layout: PoolLayout, config: EngineConfig) -> int:
    """The host pool's tokens: `host_kv_tokens`, or the ratio's share capped at 80% of the host
    memory available now (the whole pool is pinned at start)."""
    device_tokens = (layout.num_pages - RESERVED_PAGES) * config.page_size
    available = available_bytes()
    if config.host_kv_tokens is None and available is not None:
        cap = int(0.8 * available) // layout.page_bytes * config.page_size
        config = dataclasses.replace(
            config, host_kv_tokens=min(config.host_tokens_for(device_tokens), cap))
    return config.host_tokens_for(device_tokens)


def _storage(model: DecoderConfig, config: EngineConfig, host_pool: HostPool | None) -> Storage:
    """The storage tier's backend, a directory or a Mooncake Store, under a namespace that names
    the model (its given or derived name and its config's hash), the dtype, the page size and
    the host layout."""
    if host_pool is None:
        raise ValueError("a storage tier needs cache_mode='hierarchical' (a host tier)")
    namespace = _namespace(model, config, host_pool)
    if config.storage_backend is StorageBackend.MOONCAKE:
        from jhicache.cache.mooncake_storage import MooncakeStorage  # an optional extra

        # its callers at once: the tier's readers and its writer
        return MooncakeStorage(namespace, host_pool.page_views, config.storage_settings(),
                               callers=config.storage_io_threads + 1)
    assert config.storage_dir is not None
    return FileStorage(config.storage_dir, namespace, host_pool.page_views,
                       config.storage_capacity_bytes)


def _namespace(model: DecoderConfig, config: EngineConfig, host_pool: HostPool) -> StorageNamespace:
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    layout = host_pool.layout
    return StorageNamespace(
        model=f"{config.storage_model_name or 'model'} config {digest}",
        dtype=jnp.dtype(layout.dtype).name, page_size=layout.page_size,
        layout=(f"layer_first layers={layout.num_layers} kv_heads={layout.num_kv_heads} "
                f"head_dim={layout.head_dim} shards={host_pool.shards}"),
        page_bytes=layout.page_bytes, tensor_parallel_size=host_pool.shards)


def _fetch_rule(config: EngineConfig) -> FetchRule:
    return FetchRule(FetchPolicy(config.fetch_policy), config.fetch_threshold,
                     config.fetch_timeout_s, config.fetch_timeout_per_ki_token_s)


def _default_device_tokens(token_bytes: int, fraction: float) -> int:
    stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    if not stats:
        return _CPU_DEFAULT_DEVICE_TOKENS
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return max(int(free * fraction) // token_bytes, 1024)
