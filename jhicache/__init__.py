"""jhicache: hierarchical (device + pinned host) KV cache for JAX serving."""

from pathlib import Path as _Path

# `jhicache.models` and `jhicache.pallas_kernels` are the repo's top-level folders `models/` and
# `pallas_kernels/`. An install maps them in (pyproject's package-dir); from a bare checkout on
# PYTHONPATH, the repo root joins this package's search path so that they are found there too.
_ROOT = _Path(__file__).resolve().parent.parent
if all((_ROOT / f).is_file() for f in ("pyproject.toml", "models/__init__.py", "pallas_kernels/__init__.py")):
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

from jhicache.config import CacheMode, EngineConfig, KVDtype
from jhicache.engine import Engine
from jhicache.request import RequestOutput
from jhicache.sampling import SamplingParams

__all__ = ["CacheMode", "Engine", "EngineConfig", "KVDtype", "RequestOutput", "SamplingParams"]
