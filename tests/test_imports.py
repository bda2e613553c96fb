"""The package's imports point one way: no cycle among its modules, counting every import
(top-level, inside functions, and under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# jhicache.models and jhicache.pallas_kernels are the repo's top-level folders
PACKAGES = {"jhicache": ROOT / "jhicache", "jhicache.models": ROOT / "models",
            "jhicache.pallas_kernels": ROOT / "pallas_kernels"}


def _modules() -> dict[str, Path]:
    modules = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path) -> set[str]:
    """The dotted names `module` imports anywhere in its file (a `from x import y` names both
    x and x.y: y may be a submodule)."""
    names: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the root package, whose `__getattr__`
    names its exports by string, left out)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name if name and name != "jhicache" else None

    return {module: {r for r in map(resolve, _imported(module, path)) if r not in (None, module)}
            for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "jhicache.engine" in graph["jhicache.async_engine"]
    assert cycles(graph) == []


def test_lazy_and_type_checking_imports_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from jhicache.engine import Engine\n"
                      "def f():\n    import jhicache.stats\n    from . import grid\n")
    names = _imported("jhicache.m", source)
    assert {"jhicache.engine", "jhicache.stats", "jhicache.grid"} <= names


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
