"""Every compute op: value and gradient equal single-device torch, on several layouts
(even, uneven, size-0 shards, Partial inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.sharding import ReduceOp
from tests.helpers.computecheck import LINE, MESH, lay, run, values

SUM, MAX = ReduceOp.SUM, ReduceOp.MAX

# (name, layout of a rank-2 operand) on the 2x4 mesh and on a 4-device line
LAYOUTS_2D = [
    ("R", lay(MESH, None, None)),
    ("S(dp),S(tp)", lay(MESH, "dp", "tp")),
    ("S(tp),S(dp)", lay(MESH, "tp", "dp")),
    ("S(dp,tp),R", lay(MESH, ("dp", "tp"), None)),
    ("R,S(tp)+P(dp)", lay(MESH, None, "tp", partial={"dp": SUM})),
    ("line S(x)", lay(LINE, "x", None)),
    ("line P(x)", lay(LINE, None, None, partial={"x": SUM})),
    ("line P(max)", lay(LINE, None, None, partial={"x": MAX})),
]
SHAPES_2D = [(8, 6), (5, 3), (3, 0), (2, 7)]  # even, uneven, empty, size-0 shards on 4 ways


def pairs() -> list[tuple[str, str, object, object]]:
    out = []
    for (na, a) in LAYOUTS_2D:
        for (nb, b) in LAYOUTS_2D:
            if a.mesh == b.mesh and (na == nb or na.startswith("R") or nb.startswith("S(tp)")):
                out.append((na, nb, a, b))
    return out


PAIRS = pairs()


@pytest.mark.parametrize("shape", SHAPES_2D, ids=str)
@pytest.mark.parametrize("na,nb,a,b", PAIRS, ids=[f"{p[0]}|{p[1]}" for p in PAIRS])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum"])
def test_binary(op: str, na: str, nb: str, a: object, b: object, shape: tuple[int, int]) -> None:
    fns = {"add": (sw.add, torch.add), "sub": (sw.sub, torch.sub), "mul": (sw.mul, torch.mul),
           "div": (sw.div, torch.div), "maximum": (sw.maximum, torch.maximum)}
    sw_fn, t_fn = fns[op]
    x = values(*shape, seed=1)
    y = values(*shape, seed=2, positive=True)
    run(sw_fn, t_fn, [(x, a), (y, b)])


@pytest.mark.parametrize("name,layout", LAYOUTS_2D, ids=[n for n, _ in LAYOUTS_2D])
@pytest.mark.parametrize("op", ["neg", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log",
                                "sqrt", "abs"])
def test_unary(op: str, name: str, layout: object) -> None:
    x = values(5, 6, seed=3)
    ref = {"gelu": F.gelu, "silu": F.silu}.get(op) or getattr(torch, op)
    fn = getattr(sw, op) if op != "abs" else abs
    if op in ("log", "sqrt"):  # on positive values (Partial blocks are random)
        out, _ = run(lambda t: fn(abs(t) + 0.5), lambda t: ref(abs(t) + 0.5), [(x, layout)])
        return
    out, _ = run(fn, ref, [(x, layout)])
    if layout.is_partial and op != "neg":  # nonlinear: resolved first
        assert not out.dist_layout.is_partial


@pytest.mark.parametrize("name,layout", LAYOUTS_2D[:6], ids=[n for n, _ in LAYOUTS_2D[:6]])
def test_operators_and_constants(name: str, layout: object) -> None:
    x = values(5, 6, seed=4, positive=True)
    run(lambda t: 2.0 * t + 1 - t / 3 - (-t) ** 2, lambda t: 2.0 * t + 1 - t / 3 - (-t) ** 2,
        [(x, layout)])
    run(lambda t: 1.5 / t - 2 ** t, lambda t: 1.5 / t - 2 ** t, [(x, layout)])
    run(lambda t, c: t * c + c, lambda t, c: t * c + c, [(x, layout), torch.tensor(2.5)])


def test_torch_constant_that_requires_grad() -> None:
    x = values(8, 6, seed=5)
    c = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    t = sw.tensor(x, sharding=lay(MESH, "dp", "tp"), requires_grad=True)
    (t * c).to_torch().sum().backward()
    c_ref = c.detach().clone().requires_grad_(True)
    (x * c_ref).sum().backward()
    assert torch.allclose(c.grad, c_ref.grad)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(op: str) -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    y = torch.tensor([[1.0, 0.0, 3.0], [9.0, 5.0, 0.0]], dtype=torch.float64)
    fn = getattr(sw, op)
    out, _ = run(fn, getattr(torch, op), [(x, lay(LINE, None, "x")), (y, lay(LINE, "x", None))],
                 grad=False)
    assert out.dtype == torch.bool
    run(fn, getattr(torch, op), [(x, lay(LINE, None, None, partial={"x": SUM})), 3.0],
        grad=False)
    import operator

    dunder = getattr(operator, op)
    run(dunder, dunder, [(x, lay(MESH, "dp", "tp")), (y, lay(MESH, None, "tp"))], grad=False)


def test_where() -> None:
    x, y = values(6, 4, seed=1), values(6, 4, seed=2)
    cond = x > 0
    c = sw.tensor(cond, sharding=lay(MESH, "dp", None))
    run(lambda a, b: sw.where(c, a, b), lambda a, b: torch.where(cond, a, b),
        [(x, lay(MESH, "dp", "tp")), (y, lay(MESH, None, None))])
    run(lambda a: sw.where(c, a, 0.0), lambda a: torch.where(cond, a, 0.0),
        [(x, lay(MESH, "tp", None))])


MATMUL_CASES = [
    ((6, 5), (5, 7)), ((5,), (5, 7)), ((6, 5), (5,)), ((5,), (5,)),
    ((3, 6, 5), (5, 7)), ((2, 1, 6, 5), (3, 5, 7)), ((6, 0), (0, 4)),
]


@pytest.mark.parametrize("sa,sb", MATMUL_CASES, ids=str)
def test_matmul(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    a, b = values(*sa, seed=1), values(*sb, seed=2)
    on = [(LINE, "x"), (MESH, "tp"), (MESH, ("dp", "tp"))]
    for mesh, axis in on:
        for da in range(len(sa)):
            for db in range(len(sb)):
                la = lay(mesh, *[axis if d == da else None for d in range(len(sa))])
                other = "dp" if axis == "tp" else None
                lb = lay(mesh, *[axis if d == db and axis != ("dp", "tp") else
                                 (other if d == db else None) for d in range(len(sb))])
                run(lambda p, q: p @ q, torch.matmul, [(a, la), (b, lb)])


def test_matmul_partial_operands() -> None:
    a, b = values(6, 5, seed=1), values(5, 4, seed=2)
    p = lay(MESH, None, None, partial={"tp": SUM})
    out, cc = run(sw.matmul, torch.matmul, [(a, p), (b, lay(MESH, None, None))])
    assert out.dist_layout.partial == (None, SUM) and cc.total == 0
    out, cc = run(sw.matmul, torch.matmul, [(a, p), (b, p)])  # one operand resolved
    assert out.dist_layout.partial == (None, SUM) and dict(cc.counts) == {"all_reduce": 1}


@pytest.mark.parametrize("eq,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ii->i", [(4, 4)]),
    ("...j,j->...", [(2, 3, 4), (4,)]),
    ("i j, j k -> k i", [(3, 4), (4, 2)]),
])
def test_einsum(eq: str, shapes: list[tuple[int, ...]]) -> None:
    vals = [values(*s, seed=i) for i, s in enumerate(shapes)]
    for mesh, axis in [(LINE, "x"), (MESH, "tp")]:
        for d in range(len(shapes[0])):
            layouts = [lay(mesh, *[axis if (i == 0 and k == d) else None for k in range(len(s))])
                       for i, s in enumerate(shapes)]
            run(lambda *ts: sw.einsum(eq, *ts), lambda *ts: torch.einsum(eq.replace(" ", ""),
                                                                       *ts),
                list(zip(vals, layouts)))


REDUCE_DIMS = [None, 0, 1, -1, (0, 1), (0, 2)]


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", REDUCE_DIMS, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin"])
def test_reductions(op: str, dim: object, keepdim: bool) -> None:
    x = values(5, 4, 3, seed=11)
    ref = getattr(torch, op)
    for layout in [lay(MESH, "dp", "tp", None), lay(MESH, ("tp", "dp"), None, None),
                   lay(LINE, "x", None, None), lay(LINE, None, None, "x"),
                   lay(MESH, None, "tp", None, partial={"dp": SUM})]:
        if dim is None:
            run(lambda t: getattr(sw, op)(t, keepdim=keepdim),
                (lambda t: ref(t).reshape([1] * 3)) if keepdim else ref, [(x, layout)])
        else:
            run(lambda t: getattr(t, op)(dim, keepdim), lambda t: ref(t, dim, keepdim),
                [(x, layout)])


def test_reductions_with_empty_shards() -> None:
    x = values(3, 5, seed=1)  # 3 rows on 4 devices: one empty shard
    for op in ["sum", "mean", "amax", "amin"]:
        out, cc = run(lambda t, op=op: getattr(sw, op)(t, 0), lambda t, op=op: getattr(
            torch, op)(t, 0), [(x, lay(LINE, "x", None))])
        assert cc.total == 0 and out.dist_layout.partial[0] is not None
    out, _ = run(lambda t: t.max(), torch.amax, [(x, lay(LINE, "x", None))])
    ints = torch.arange(15).reshape(3, 5)
    out, _ = run(lambda t: sw.amin(t, 0), lambda t: torch.amin(t, 0),
                 [(ints, lay(LINE, "x", None))], grad=False)


def test_sum_of_scalar_and_methods() -> None:
    x = values(4, 6, seed=2)
    run(lambda t: t.sum().sum(), lambda t: t.sum(), [(x, lay(MESH, "dp", "tp"))])
    run(lambda t: t.mean(dim=1).max(0).values, lambda t: t.mean(1).amax(0),
        [(x, lay(MESH, "dp", "tp"))])


@pytest.mark.parametrize("layout", [lay(MESH, "dp", "tp", None),
                                    lay(MESH, None, ("dp", "tp"), None),
                                    lay(LINE, None, None, "x", partial={}),
                                    lay(MESH, "tp", None, None, partial={"dp": SUM})], ids=str)
def test_permute_transpose(layout: object) -> None:
    x = values(4, 6, 3, seed=3)
    run(lambda t: t.permute(2, 0, 1), lambda t: t.permute(2, 0, 1), [(x, layout)])
    run(lambda t: sw.transpose(t, 0, -1), lambda t: t.transpose(0, -1), [(x, layout)])
    run(lambda t: t.T, lambda t: t.permute(2, 1, 0), [(x, layout)])
    y = values(5, 6, seed=1)
    run(lambda t: t.t(), lambda t: t.t(), [(y, lay(MESH, "tp", "dp"))])


@pytest.mark.parametrize("src,dst", [
    ((8, 6), (8, 2, 3)), ((8, 6), (48,)), ((4, 6, 2), (4, 12)), ((4, 1, 6), (4, 6)),
    ((4, 6), (4, 1, 6)), ((8, 6), (2, -1)), ((0, 4), (4, 0)), ((5, 3), (5, 3)),
], ids=str)
def test_reshape(src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    x = values(*src, seed=4)
    for layout in [lay(MESH, "dp", *([None] * (len(src) - 1))),
                   lay(MESH, *([None] * (len(src) - 1)), "tp"),
                   lay(LINE, "x", *([None] * (len(src) - 1)), partial=None),
                   lay(LINE, *([None] * len(src)), partial={"x": SUM})]:
        run(lambda t: t.reshape(dst), lambda t: t.reshape(dst), [(x, layout)])
        run(lambda t: t.view(*dst), lambda t: t.reshape(dst), [(x, layout)])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat(dim: int) -> None:
    a, b = values(4, 6, seed=1), values(4, 6, seed=2)
    for la, lb in [(lay(MESH, "dp", "tp"), lay(MESH, "dp", "tp")),
                   (lay(MESH, "tp", None), lay(MESH, None, "tp")),
                   (lay(LINE, None, None, partial={"x": SUM}),
                    lay(LINE, None, None, partial={"x": SUM})),
                   (lay(LINE, None, None, partial={"x": SUM}), lay(LINE, "x", None))]:
        run(lambda p, q: sw.cat([p, q], dim), lambda p, q: torch.cat([p, q], dim),
            [(a, la), (b, lb)])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(dim: int) -> None:
    x = values(5, 6, seed=8)
    for layout in LAYOUTS_2D:
        run(lambda t: t.softmax(dim), lambda t: torch.softmax(t, dim), [(x, layout[1])])


INDICES = [
    (slice(None), 1), (1,), (slice(1, 4),), (slice(None), slice(None, None, 2)),
    (Ellipsis, None), (None, slice(None), -1), (slice(None),), (slice(0, 5), slice(None)),
    (-1, slice(2, 3)), (),
]


@pytest.mark.parametrize("index", INDICES, ids=str)
def test_getitem(index: tuple[object, ...]) -> None:
    x = values(5, 6, seed=9)
    for _, layout in LAYOUTS_2D:
        run(lambda t: t[index], lambda t: t[index], [(x, layout)])
