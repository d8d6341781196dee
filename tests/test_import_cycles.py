"""No import cycle inside core/, function-level imports included: a module's imports, read
from its source (every ``import`` and ``from ... import`` anywhere in it), form a graph of
tessellm.core modules with no cycle, so the layers below (errors, interfaces with their spec
types, then model, parallel, engine) never reach back up."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
PACKAGE = "tessellm.core"


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The core modules ``path`` imports anywhere (``from pkg import sub`` counts as ``pkg.sub``)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def core_graph() -> dict[str, set[str]]:
    files = sorted(CORE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def test_core_has_no_import_cycle():
    graph = core_graph()
    # a package's __init__ importing its own modules is not a cycle through it: leave those edges out
    for name, edges in graph.items():
        graph[name] = {e for e in edges if not (name.startswith(e + ".") and e in graph)}
    assert cycles(graph) == []


def test_the_finder_sees_a_function_level_cycle(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def f():\n    from tessellm.core.b import g\n")
    (tmp_path / "b.py").write_text("from tessellm.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "CORE", tmp_path)
    files = sorted(tmp_path.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports_of(f, modules) for f in files}
    assert cycles(graph) == [["tessellm.core.a", "tessellm.core.b"]]
