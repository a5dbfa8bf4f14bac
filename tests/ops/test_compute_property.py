"""Property: elementwise ops on random layouts (random meshes, uneven and empty
shards, Partial inputs of any op, broadcasting) keep values equal to torch."""

from __future__ import annotations

import operator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.computecheck import make
from tests.helpers.shardcheck import assert_shares_replicas, global_of

NAMES = ("a", "b", "c")
# op: (shardwise, torch)
BINARY = {"add": (operator.add,) * 2, "sub": (operator.sub,) * 2, "mul": (operator.mul,) * 2,
          "div": (operator.truediv,) * 2, "maximum": (sw.maximum, torch.maximum),
          "gt": (operator.gt,) * 2}
UNARY = {"neg": (operator.neg,) * 2, "relu": (sw.relu, torch.relu),
         "tanh": (sw.tanh, torch.tanh), "exp": (sw.exp, torch.exp)}


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    ndim = draw(st.integers(1, 3))
    return DeviceMesh.cpu(tuple(draw(st.integers(1, 3)) for _ in range(ndim)), NAMES[:ndim])


@st.composite
def layouts(draw: st.DrawFn, mesh: DeviceMesh, shape: tuple[int, ...]) -> Layout:
    dims: list[list[int]] = [[] for _ in shape]
    ops: list[ReduceOp | None] = [None] * mesh.ndim
    for a in range(mesh.ndim):
        kind = draw(st.sampled_from(["R", "S", "P"] if shape else ["R", "P"]))
        if kind == "S":
            dims[draw(st.integers(0, len(shape) - 1))].append(a)
        elif kind == "P":
            ops[a] = draw(st.sampled_from([ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX,
                                           ReduceOp.AVG]))
    dims = [draw(st.permutations(d)) if len(d) > 1 else d for d in dims]
    return Layout(mesh, tuple(tuple(d) for d in dims), tuple(ops))


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    mesh = draw(meshes())
    shape = tuple(draw(st.integers(0, 5)) for _ in range(draw(st.integers(0, 3))))
    # the second operand broadcasts: fewer leading dims, some dims of size 1
    cut = draw(st.integers(0, len(shape)))
    other = tuple(1 if draw(st.booleans()) and draw(st.booleans()) else s for s in shape[cut:])
    if draw(st.booleans()):
        shape, other = other, shape
    return (mesh, shape, draw(layouts(mesh, shape)), other, draw(layouts(mesh, other)),
            draw(st.sampled_from(sorted(BINARY) + sorted(UNARY))), draw(st.integers(0, 99)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_elementwise_on_random_layouts(case: tuple) -> None:
    mesh, shape, la, other, lb, op, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = make(torch.randn(shape, generator=gen, dtype=torch.float64), la, grad=False)
    y = make(torch.randn(other, generator=gen, dtype=torch.float64).abs() + 0.5, lb, grad=False)
    gx, gy = global_of(x), global_of(y)
    if op in UNARY:
        out, expect = UNARY[op][0](x), UNARY[op][1](gx)
    else:
        if op == "div":
            y, gy = abs(y) + 0.5, gy.abs() + 0.5
        out, expect = BINARY[op][0](x, y), BINARY[op][1](gx, gy)
    got = global_of(out)
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert torch.allclose(got, expect, atol=1e-9, equal_nan=True), (got, expect)
    assert_shares_replicas(out)
    assert out.mesh == mesh and out.dist_layout.ndim == len(expect.shape)
    # only Partial(SUM) passes through, and only for (multi)linear ops
    for p in out.dist_layout.partial:
        assert p in (None, ReduceOp.SUM)
        if p is not None:
            assert op in ("add", "sub", "mul", "div", "neg"), (op, out.dist_layout)
