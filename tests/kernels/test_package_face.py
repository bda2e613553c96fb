"""pallas_kernels' layout: no package attribute shadows a submodule, no import cycle between
kernels."""

from __future__ import annotations

import ast
import pkgutil
import types
from pathlib import Path

import jhicache.pallas_kernels as pk


def _submodules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(pk.__path__)]


def test_no_package_name_shadows_a_submodule() -> None:
    for name in _submodules():
        attr = getattr(pk, name, None)  # None: not imported yet, so nothing can shadow it
        assert attr is None or isinstance(attr, types.ModuleType), (
            f"pallas_kernels.{name} is {attr!r}")


def _imported_modules(path: Path) -> set[str]:
    """Modules `path` imports, at any depth (function-local imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_kernel_modules_import_no_sibling_kernel() -> None:
    """Shared pieces live in _attention / _common; the extend and decode modules import neither each
    other."""
    root = Path(pk.__file__).parent
    for own, other in (("extend_attention", "decode_attention"),
                       ("decode_attention", "extend_attention")):
        assert f"jhicache.pallas_kernels.{other}" not in _imported_modules(root / f"{own}.py")
