"""The house's floors: every import inside shardwise points down, and none forms a circle.

Floors (docs/DESIGN.md §1) are folders: 0 spec (``sharding/``) < 1 pure plans and rules
(``planner/``, ``propagation/``) < 2 runtime (``runtime/``) < 3 core (``tensors/``,
``ops/``) < 4 API (``api/``, ``spmd/``, ``parallel/``, ``checkpoint/``, ``graph/``,
``debug/``, ``cli/``). The top of the package holds only public faces (``__init__``,
``lax``, ``distributed``), which re-export and may import any floor; nothing below
may import them. Imports are read from the source (module level and inside
functions alike).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "shardwise"

FLOORS = {"sharding": 0, "planner": 1, "propagation": 1, "runtime": 2, "tensors": 3, "ops": 3,
          "api": 4, "spmd": 4, "parallel": 4, "pipelining": 4, "checkpoint": 4, "graph": 4,
          "debug": 4, "cli": 4}
FACES = {"shardwise", "shardwise.lax", "shardwise.distributed"}
#: one floor above every folder: the faces re-export, and only users import them
FACE_FLOOR = 5


def floor(module: str) -> int:
    if module in FACES:
        return FACE_FLOOR
    folder = module.split(".")[1]
    if folder not in FLOORS:
        raise AssertionError(f"{module} is in no floor folder: add its folder to FLOORS "
                             "(and docs/DESIGN.md §1) or move it into one")
    return FLOORS[folder]


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
    assert "shardwise.tensors.tensor" in graph["shardwise.api.creation"]
    assert "shardwise.spmd.lax" in graph["shardwise.lax"]
    assert len(graph) > 50


def test_the_top_holds_only_public_faces_and_floor_folders() -> None:
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith((".", "__pycache__"))}
    files = {n for n in top if (ROOT / n).is_file()}
    assert files == {"__init__.py", "lax.py", "distributed.py", "py.typed"}, files
    assert top - files == set(FLOORS), top - files
    for name in FACES - {"shardwise"}:  # a face re-exports: no definitions of its own
        tree = ast.parse((ROOT / (name.split(".")[1] + ".py")).read_text())
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defs, f"{name} defines {[d.name for d in defs]}; define them in a floor"


def test_every_module_is_on_a_floor() -> None:
    for name in modules():
        floor(name)


def test_every_import_points_down() -> None:
    up = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
          for a, targets in imports().items() for b in targets
          if floor(b) > floor(a)]
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
    """No spec module imports torch; ``sharding.devices`` binds a device to torch only
    inside the functions that need it (lazily), never at import."""
    for name, path in modules().items():
        if floor(name) != 0:
            continue
        tree = ast.parse(path.read_text())
        if name == "shardwise.sharding.devices":
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not any("torch" in ast.unparse(n) for n in top), name
        else:
            assert "import torch" not in path.read_text(), name


def test_the_two_backends_never_import_each_other() -> None:
    """runtime/simulated and runtime/process share only the modules beside
    runtime/__init__ (docs/DESIGN.md §1); shard_map and graph reach a backend's
    collectives only through the protocol or the in-process collectives."""
    sim, proc = "shardwise.runtime.simulated", "shardwise.runtime.process"
    crossing = [f"{a} imports {b}" for a, targets in imports().items() for b in targets
                if (a.startswith(sim) and b.startswith(proc))
                or (a.startswith(proc) and b.startswith(sim))]
    assert not crossing, crossing
    graph = imports()
    assert "shardwise.runtime.collectives" in graph["shardwise.graph.ops"]
    assert not any(b.startswith(proc) for b in graph["shardwise.spmd.io"])
    assert not any(b.startswith(proc) for b in graph["shardwise.spmd.shard_map"])


def test_the_tests_mirror_the_package() -> None:
    """``tests/<folder>`` per package folder (plus the shared ``helpers``), and helpers are
    imported as a package, never through ``sys.path`` edits."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir()  # (a folder left with only caches is none)
               if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    assert folders - {"helpers"} <= set(FLOORS), folders - {"helpers"} - set(FLOORS)
    edits = [str(p.relative_to(tests)) for p in tests.rglob("*.py")
             if any(f"sys.path.{verb}" in p.read_text() for verb in ("insert", "append"))
             and p.name != "test_layers.py"]
    assert not edits, edits
