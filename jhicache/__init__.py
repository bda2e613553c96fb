"""jhicache: hierarchical (device + pinned host) KV cache for JAX serving."""

from pathlib import Path as _Path

# `jhicache.models` and `jhicache.pallas_kernels` are the repo's top-level folders `models/` and
# `pallas_kernels/`. An install maps them in (pyproject's package-dir); from a bare checkout on
# PYTHONPATH, the repo root joins this package's search path so that they are found there too.
_ROOT = _Path(__file__).resolve().parent.parent
if all((_ROOT / f).is_file()
       for f in ("pyproject.toml", "models/__init__.py", "pallas_kernels/__init__.py")):
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

# The public names load on first use, so that `import jhicache.config` (settings, enums) needs
# no JAX, and importing one submodule does not build the whole engine.
_EXPORTS = {
    "AsyncEngine": "jhicache.async_engine",
    "CacheMode": "jhicache.config",
    "Engine": "jhicache.engine",
    "EngineConfig": "jhicache.config",
    "EngineStats": "jhicache.stats",
    "FetchPolicy": "jhicache.config",
    "KVDtype": "jhicache.config",
    "RequestOutput": "jhicache.request",
    "SamplingParams": "jhicache.sampling",
    "StorageWritePolicy": "jhicache.config",
    "WritePolicy": "jhicache.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jhicache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
