"""The package's import structure (issue 9): no import cycles inside ``torchrec_herald``, and nothing in
``sharding/``, ``planner/`` or ``ops/`` imports ``pipeline/`` (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1] / "torchrec_herald"


def _import_graph() -> Dict[str, Set[str]]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # from ..x import y: resolved against the package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
                graph[m].update(t for t in [module] + [f"{module}.{a.name}" for a in node.names] if t in mods)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchrec_herald"):
                graph[m].update(t for t in [node.module] + [f"{node.module}.{a.name}" for a in node.names] if t in mods)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert "torchrec_herald.sharding.plan_exec" in graph and "torchrec_herald.layout" in graph
    assert _cycles(graph) == []


def test_lower_layers_never_import_the_pipeline() -> None:
    graph = _import_graph()
    upward = sorted((m, t) for m, targets in graph.items() for t in targets
                    if m.split(".")[1] in ("sharding", "planner", "ops") and t.startswith("torchrec_herald.pipeline"))
    assert upward == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
