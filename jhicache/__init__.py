"""jhicache: hierarchical (device + pinned host) KV cache for JAX serving."""

from jhicache.config import CacheMode, EngineConfig, KVDtype
from jhicache.engine import Engine
from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams

__all__ = ["CacheMode", "Engine", "EngineConfig", "KVDtype", "RequestOutput", "SamplingParams"]
