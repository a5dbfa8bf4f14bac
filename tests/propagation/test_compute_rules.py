"""The rule table (pure data) bound to shapes, and the errors users see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.propagation.binding import bind, normalize_index
from shardwise.propagation.rules import (
    ELEMENTWISE_LINEAR,
    ELEMENTWISE_NONLINEAR,
    ELEMENTWISE_RULE,
    ELEMENTWISE_SHARED,
    MATMUL,
    RULES,
    Passes,
    Rule,
)
from shardwise.sharding import DeviceMesh, ReduceOp
from tests.helpers.computecheck import LINE, MESH, lay, values


def text(op: str, shapes: tuple[tuple[int, ...], ...], *params: object) -> str:
    f = bind(op, shapes, *params)
    full = sorted(f.full)
    return f"{f.text} {list(f.out_shape)} full={full}"


@pytest.mark.parametrize("op,shapes,params,want", [
    ("add", ((4, 8), (8,)), (), "#0 #1, #1 -> #0 #1 [4, 8] full=[]"),
    ("add", ((4, 1), (1, 8)), (), "#0 #1'0!, #0'1! #1 -> #0 #1 [4, 8] full=[1, 2]"),
    ("add", ((3, 0), (1, 0)), (), "#0 #1, #0'1! #1 -> #0 #1 [3, 0] full=[2]"),
    ("mul", ((), (3,)), (), ", #0 -> #0 [3] full=[]"),
    ("relu", ((2, 3),), (), "#0 #1 -> #0 #1 [2, 3] full=[]"),
    ("matmul", ((4, 8), (8, 2)), (), "i k, k j -> i j [4, 2] full=[]"),
    ("matmul", ((8,), (2, 8, 3)), (), "k, #0 k j -> #0 j [2, 3] full=[]"),
    ("matmul", ((5, 8), (8,)), (), "i k, k -> i [5] full=[]"),
    ("matmul", ((8,), (8,)), (), "k, k -> [] full=[]"),
    ("matmul", ((5, 2, 8, 3), (2, 3, 4)), (),
     "#0 #1 i k, #1 k j -> #0 #1 i j [5, 2, 8, 4] full=[]"),
    ("einsum", ((2, 3, 4), (2, 4, 5)), ("bij,bjk->bik",),
     "b i j, b j k -> b i k [2, 3, 5] full=[]"),
    ("einsum", ((3, 4), (4,)), ("ij,j",), "i j, j -> i [3] full=[]"),
    ("einsum", ((3, 3),), ("ii->i",), "i! i! -> i! [3] full=[0]"),
    ("sum", ((4, 8, 3),), ((1,), False), "d0 d1 d2 -> d0 d2 [4, 3] full=[]"),
    ("amax", ((4, 8, 3),), ((0, 2), True), "d0 d1 d2 -> k0 d1 k2 [1, 8, 1] full=[]"),
    ("permute", ((4, 8, 3),), ((2, 0, 1),), "d0 d1 d2 -> d2 d0 d1 [3, 4, 8] full=[]"),
    ("softmax", ((4, 8),), (1,), "d0 d1! -> d0 d1! [4, 8] full=[1]"),
    ("cat", ((4, 8), (2, 8)), (0,), "c0! d1, c1! d1 -> c! d1 [6, 8] full=[0, 2, 3]"),
    # a merge: the new dim is the compound of the old ones (major first, minors whole)
    ("reshape", ((4, 6, 8),), ((4, 48),), "d0 d1 d2! -> d0 (d1 d2!) [4, 48] full=[2]"),
    ("reshape", ((4, 1, 6),), ((4, 6),), "d0 d1! d2 -> d0 d2 [4, 6] full=[1]"),
    ("reshape", ((4, 6),), ((4, 1, 6),), "d0 d1 -> d0 o1 d1 [4, 1, 6] full=[]"),
    # a split: the old dim is the compound of the new ones
    ("reshape", ((4, 6),), ((2, 2, -1),), "(o0 o1!) d1 -> o0 o1! d1 [2, 2, 6] full=[1]"),
    # neither, (6, 4) -> (4, 6): the run's first dims share a major of size gcd(6, 4)
    ("reshape", ((6, 4),), ((4, 6),), "(m0 d0!) d1! -> (m0 o0!) o1! [4, 6] full=[1, 2, 3, 4]"),
    # ... named alone on the side whose first dim it is: gcd(8, 4) == 4, gcd(2, 4) == 2
    ("reshape", ((8, 6),), ((4, 12),), "(m0 d0!) d1! -> m0 o1! [4, 12] full=[1, 2, 3]"),
    ("reshape", ((2, 12),), ((4, 6),), "m0 d1! -> (m0 o0!) o1! [4, 6] full=[1, 2, 3]"),
    # coprime first dims: a major of size 1 (sharded over size-1 mesh axes only)
    ("reshape", ((3, 4),), ((4, 3),), "(m0 d0!) d1! -> (m0 o0!) o1! [4, 3] full=[1, 2, 3, 4]"),
    # runs are independent: a regroup, a split, a kept dim (-1 inferred)
    ("reshape", ((6, 4, 8, 5),), ((4, 6, 2, 4, -1),),
     "(m0 d0!) d1! (o2 o3!) d3 -> (m0 o0!) o1! o2 o3! d3 [4, 6, 2, 4, 5] "
     "full=[1, 2, 4, 6, 7]"),
    # size-0: no runs to align, every dim whole; size-1 dims come and go alone
    ("reshape", ((0, 4),), ((4, 0),), "d0! d1! -> o0! o1! [4, 0] full=[0, 1, 2, 3]"),
    ("reshape", ((1, 6, 1),), ((6, 1, 1),), "d0! d1 d2 -> d1 d2 o2 [6, 1, 1] full=[0]"),
    ("getitem", ((4, 8, 3),), ((("slice", None, None, None), 1),),
     "d0 d1! d2 -> d0 d2 [4, 3] full=[1]"),
    ("getitem", ((4, 8, 3),), ((Ellipsis, ("slice", 1, 3, None), None),),
     "d0 d1 d2! -> d0 d1 s2 n3 [4, 8, 2, 1] full=[2]"),
])
def test_bound_rules(op: str, shapes: tuple[tuple[int, ...], ...], params: tuple[object, ...],
                     want: str) -> None:
    assert text(op, shapes, *params) == want


def test_the_table_flags() -> None:
    assert RULES["add"].passes is Passes.LINEAR and RULES["neg"].passes is Passes.LINEAR
    assert RULES["mul"].passes is Passes.MULTILINEAR
    assert RULES["div"].carriers == (0,)
    for op in ("relu", "gelu", "tanh", "exp", "softmax", "eq", "lt", "maximum", "amax", "pow"):
        assert RULES[op].passes is Passes.NONLINEAR, op
    for op in ("sum", "mean", "permute", "reshape", "getitem", "cat"):
        assert RULES[op].passes is Passes.LINEAR, op
    assert RULES["matmul"].reduce is ReduceOp.SUM and RULES["amax"].reduce is ReduceOp.MAX
    assert RULES["amin"].reduce is ReduceOp.MIN and RULES["relu"].reduce is None
    assert set(MATMUL) == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize("module", ["rules", "binding"])
def test_rules_are_pure_python(module: str) -> None:
    import importlib

    mod = importlib.import_module(f"shardwise.propagation.{module}")
    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.split(".")[0] == "torch" for m in imported), imported
    # shardwise.sharding.shapes: the spec floor's shape arithmetic (reshape_groups), which
    # never imports torch either (tests/test_layers.py)
    assert {m for m in imported if m and m.startswith("shardwise")} <= {
        "shardwise.sharding.errors", "shardwise.sharding.placements",
        "shardwise.sharding.shapes", "shardwise.propagation.rules"}


def test_normalize_index() -> None:
    full, s = ("slice", None, None, None), ("slice", 1, None, 2)
    assert normalize_index((1, full), (4, 5)) == (("int", 1), ("full",))
    assert normalize_index((Ellipsis, s, None), (4, 5)) == (("full",), ("slice", 1, 5, 2),
                                                            ("new",))
    assert normalize_index((-1,), (4, 5)) == (("int", 3), ("full",))
    assert normalize_index((("slice", 0, 9, None),), (4,)) == (("full",),)
    with pytest.raises(IndexError, match="out of bounds"):
        normalize_index((4,), (4,))
    with pytest.raises(IndexError, match="too many"):
        normalize_index((0, 0), (4,))


# --- errors --------------------------------------------------------------------------------
def test_shape_errors_name_the_op_and_shapes() -> None:
    a = sw.tensor(values(4, 5), sharding=lay(LINE, "x", None))
    b = sw.tensor(values(4, 5), sharding=lay(LINE, None, None))
    with pytest.raises(sw.ShardingError, match=r"matmul: operands of shapes \[4, 5\], \[4, 5\]"):
        a @ b
    with pytest.raises(sw.ShardingError, match=r"add: .*\[4, 5\], \[3\]"):
        a + sw.tensor(values(3), sharding=lay(LINE, None))
    with pytest.raises(sw.ShardingError, match="matmul: both operands need at least one dim"):
        sw.matmul(a.sum(), a)
    with pytest.raises(sw.ShardingError, match="reshape: shape \\[4, 5\\]"):
        a.reshape(3, 7)
    with pytest.raises(sw.ShardingError, match="cat: every tensor needs rank 2"):
        sw.cat([a, a.sum(0)])
    with pytest.raises(sw.ShardingError, match="permute"):
        a.permute(0, 0)
    with pytest.raises(sw.ShardingError, match="out of range"):
        a.sum(2)


def test_mesh_mismatch_names_both_meshes() -> None:
    a = sw.tensor(values(4, 4), sharding=lay(LINE, "x", None))
    b = sw.tensor(values(4, 4), sharding=lay(MESH, None, None))
    with pytest.raises(sw.ShardingError, match=r"DeviceMesh\(dp=2, tp=4\).*DeviceMesh\(x=4\)"):
        a + b


def test_operand_kinds() -> None:
    a = sw.tensor(values(4, 4), sharding=lay(LINE, "x", None))
    # a plain torch tensor among shardwise ones is Replicated on the mesh (JAX semantics)
    mixed = sw.add(a, torch.ones(4, 4))
    assert mixed.dist_layout == a.dist_layout
    assert torch.equal(mixed.to_torch(), a.to_torch() + 1)
    with pytest.raises(TypeError):
        a + "text"
    with pytest.raises(sw.ShardingError, match=r"at least one shardwise\.Tensor"):
        sw.add(1, 2)
    assert (a == None) is False  # noqa: E711
    assert a != "text"


def test_advanced_indexing_runs_gathered_with_one_warning() -> None:
    a = sw.tensor(values(4, 4), sharding=lay(LINE, "x", None))
    pairs = (torch.tensor([0, 1]), torch.tensor([2, 3]))  # two index tensors: no rule
    with pytest.warns(sw.ShardwiseFallbackWarning, match="__getitem__"):
        picked = a[pairs]
    assert torch.equal(picked.to_torch(), a.to_torch()[pairs])
    assert torch.equal(a[[0, 1]].to_torch(), a.to_torch()[[0, 1]])  # one: index_select
    with pytest.raises(IndexError, match="out of bounds"):
        a[4]
    assert [row.to_torch().tolist() for row in a] == a.to_torch().tolist()


def test_bool_and_hash() -> None:
    a = sw.tensor(values(4), sharding=lay(LINE, "x"))
    with pytest.raises(sw.ShardingError, match="ambiguous"):
        bool(a == a)
    assert bool((a == a).sum() == 4)
    assert len({a, a}) == 1


def test_errors_from_torch_say_op_and_shapes() -> None:
    mesh = DeviceMesh.cpu((2,), ("x",))
    a = sw.tensor(torch.ones(4, dtype=torch.int64), sharding=lay(mesh, "x"))
    with pytest.raises(sw.ShardingError, match=r"softmax failed on the local blocks .* global "
                                               r"shapes \[\[4\]\]"):
        a.softmax(0)


def test_every_elementwise_name_has_its_rule() -> None:
    """The one list of elementwise names (which ops/elementwise.py registers) names only
    rules the table holds."""
    named = [*ELEMENTWISE_LINEAR.items(), *((n, ELEMENTWISE_RULE.get(n, n))
                                            for n in ELEMENTWISE_NONLINEAR + ELEMENTWISE_SHARED)]
    assert [(n, r) for n, r in named if r not in RULES] == []
    assert len({n for n, _ in named}) == len(named)


def test_family_builders_are_registered_with_their_rules(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from shardwise.propagation import binding

    assert not hasattr(binding, "_FAMILIES")  # no lookup of builders by family name
    built = {op for op, rule in RULES.items() if rule.build is not None}
    assert {"matmul", "einsum", "sum", "mean", "amax", "amin", "permute", "softmax", "cat",
            "reshape", "getitem", "normalize", "topk", "sdpa"} <= built
    assert all(callable(RULES[op].build) for op in built)
    # a new family is one table row holding its builder; bind calls it with the arguments
    calls: list[tuple] = []

    def swap(shapes: tuple[tuple[int, ...], ...], k: int) -> str:
        calls.append((shapes, k))
        return "a b -> b a"

    monkeypatch.setitem(RULES, "test_swap_family", Rule("a b -> b a", Passes.LINEAR,
                                                        build=swap))
    f = bind("test_swap_family", ((2, 3),), 7)
    assert f.text == "a b -> b a" and f.out_shape == (3, 2) and calls == [(((2, 3),), 7)]
