"""The house's floors: every import inside shardwise points down, and none forms a circle.

Floors (docs/DESIGN.md §1) are folders: 0 spec (``sharding/``) < 1 pure plans and rules
(``planner/``, ``propagation/``) < 2 runtime (``runtime/``) < 3 core (``tensors/``,
``ops/``) < 4 API (``api/``, ``spmd/``, ``parallel/``, ``checkpoint/``, ``graph/``,
``debug/``, ``cli/``). The top of the package holds only public faces (``__init__``,
``lax``, ``distributed``), which re-export and may import any floor; nothing below
may import them. Imports are read from the source (module level and inside
functions alike), and importing ``a.b.c`` imports the packages ``a.b`` (their
``__init__``) first, unless the importer lives inside them. Floor 4 reaches a runtime
only through the ``Backend`` protocol (``shardwise.runtime``), never by importing
``runtime.process`` or ``runtime.simulated``.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "shardwise"

FLOORS = {"sharding": 0, "planner": 1, "propagation": 1, "runtime": 2, "tensors": 3, "ops": 3,
          "api": 4, "spmd": 4, "parallel": 4, "pipelining": 4, "checkpoint": 4, "graph": 4,
          "debug": 4, "planning": 4, "cli": 4}
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
    return {name: set(found) for name, found in import_sites().items()}


def import_sites() -> dict[str, dict[str, str]]:
    """module -> {imported shardwise module: where the first import of it is}, where
    being "module level" or "in <function>()"; a package's ``__init__`` counts as
    imported with its submodules (Python runs it first) unless the importer is inside
    that package (it ran already)."""
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: dict[str, str] = {}
        for node, where in _imports_in(ast.parse(path.read_text()), "module level"):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                if not t.startswith("shardwise"):
                    continue
                m = known(t)
                if m is None:
                    continue
                parts = m.split(".")
                for i in range(2, len(parts) + 1):  # the packages first, then the module
                    step = ".".join(parts[:i])
                    if step in mods and step != name and not name.startswith(step + "."):
                        found.setdefault(step, where)
        graph[name] = found
    return graph


def _imports_in(node: ast.AST, where: str) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import under ``node``, with the function it runs in (or ``where``)."""
    out: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append((child, where))
        inner = (f"in {child.name}()" if isinstance(child, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef))
                 else where)
        out.extend(_imports_in(child, inner))
    return out


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


def circles(graph: dict[str, dict[str, str]]) -> list[str]:
    """One circle of imports per strongly connected component of ``graph`` (Tarjan),
    written as a path, each step saying where its import is."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path(graph, comp) for comp in comps]


def _path(graph: dict[str, dict[str, str]], comp: set[str]) -> str:
    """The shortest circle through the first module of ``comp`` (breadth first)."""
    start = min(comp)
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w in comp and w not in came:
                came[w] = v
                todo.append(w)
        if start in came:
            break
    steps = [start]
    while len(steps) == 1 or steps[-1] != start:
        steps.append(came[steps[-1]])
    steps.reverse()
    return start + "".join(f" -> ({graph[a][b]}) {b}" for a, b in itertools.pairwise(steps))


def test_no_import_circles() -> None:
    found = circles(import_sites())
    assert not found, "import circles (imports inside functions count):\n" + "\n".join(found)


def test_a_circle_through_a_function_level_import_is_named() -> None:
    graph = {"a": {"b": "in f()"}, "b": {"c": "module level"}, "c": {"a": "module level"},
             "d": {"a": "module level"}}
    assert circles(graph) == ["a -> (in f()) b -> (module level) c -> (module level) a"]
    assert circles({"a": {"b": "in f()"}, "b": {}}) == []


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
    runtime/__init__ (docs/DESIGN.md §1)."""
    sim, proc = "shardwise.runtime.simulated", "shardwise.runtime.process"
    crossing = [f"{a} imports {b}" for a, targets in imports().items() for b in targets
                if (a.startswith(sim) and b.startswith(proc))
                or (a.startswith(proc) and b.startswith(sim))]
    assert not crossing, crossing
    graph = imports()
    assert "shardwise.runtime.collectives" in graph["shardwise.graph.ops"]


def backend_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """Floor-4 imports of a backend's package (``runtime.process``, ``runtime.simulated``),
    at module level or inside a function: floor 4 reaches a runtime only through the
    ``Backend`` protocol (``backend_for``, ``world_backend``)."""
    backends = {("runtime", "process"), ("runtime", "simulated")}
    return [f"{a} imports {b} ({where})" for a, targets in sorted(graph.items())
            if a not in FACES and floor(a) == 4
            for b, where in sorted(targets.items()) if tuple(b.split(".")[1:3]) in backends]


def test_floor_4_reaches_a_runtime_only_through_the_protocol() -> None:
    found = backend_imports(import_sites())
    assert not found, ("floor 4 imports a backend around the Backend protocol:\n"
                       + "\n".join(found))


def test_a_backend_import_inside_a_function_is_named() -> None:
    graph = {"shardwise.api.x": {"shardwise.runtime.process.p2p": "in f()",
                                 "shardwise.runtime": "module level"},
             "shardwise.tensors.y": {"shardwise.runtime.simulated": "module level"}}
    assert backend_imports(graph) == [
        "shardwise.api.x imports shardwise.runtime.process.p2p (in f())"]


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
