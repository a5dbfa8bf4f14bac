"""The house's floors: every import inside shardwise points down, and none forms a circle.

Floors (docs/DESIGN.md §1): 0 spec (sharding, devices) < 1 pure plans and rules <
2 runtime < 3 core (Tensor, op registry) < 4 API (everything else). Imports are
read from the source (module level and inside functions alike); the root package
``shardwise`` is a facade and may be imported by anyone.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "shardwise"

PURE = {"shardwise.ops.rules", "shardwise.ops.binding", "shardwise.ops.propagation"}
CORE = {"shardwise.tensors", "shardwise.tensor_meta", "shardwise.tensor_relayout",
        "shardwise.tensor_grad", "shardwise.chunks", "shardwise.dtensor_interop",
        "shardwise.ops.execute", "shardwise.ops.compute",
        "shardwise.ops.registry"}


def floor(module: str) -> int:
    if module.startswith(("shardwise.sharding", "shardwise.devices")):
        return 0
    if module.startswith("shardwise.planner") or module in PURE:
        return 1
    if module.startswith("shardwise.runtime"):
        return 2
    if module in CORE or module.startswith("shardwise.ops.torch_"):
        return 3
    return 4


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports() -> dict[str, set[str]]:
    """module -> the shardwise modules it imports (anywhere in its source)."""
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                if t.startswith("shardwise"):
                    m = known(t)
                    if m and m not in (name, "shardwise"):
                        found.add(m)
        graph[name] = found
    return graph


def test_the_graph_is_read() -> None:
    graph = imports()
    assert "shardwise.ops.torch_api" in graph["shardwise.ops"]
    assert "shardwise.tensors" in graph["shardwise.creation"]
    assert len(graph) > 50


def test_every_import_points_down() -> None:
    up = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
          for a, targets in imports().items() for b in targets
          if a != "shardwise" and floor(b) > floor(a)]
    assert not up, "\n".join(up)


def test_no_import_circles() -> None:
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_spec_floor_never_imports_torch() -> None:
    for name, path in modules().items():
        if floor(name) == 0 and name.startswith("shardwise.sharding"):
            text = path.read_text()
            assert "import torch" not in text, name


def test_the_two_backends_never_import_each_other() -> None:
    """runtime/simulated and runtime/process share only the modules beside
    runtime/__init__ (docs/DESIGN.md §1); shard_map and graph reach a backend's
    collectives only through the protocol or the simulated collectives."""
    sim, proc = "shardwise.runtime.simulated", "shardwise.runtime.process"
    crossing = [f"{a} imports {b}" for a, targets in imports().items() for b in targets
                if (a.startswith(sim) and b.startswith(proc))
                or (a.startswith(proc) and b.startswith(sim))]
    assert not crossing, crossing
    graph = imports()
    assert "shardwise.runtime.simulated.collectives" in graph["shardwise.graph.ops"]
    assert not any(b.startswith(proc) for b in graph["shardwise.shard_map_io"])
    assert not any(b.startswith(proc) for b in graph["shardwise.shard_map"])
