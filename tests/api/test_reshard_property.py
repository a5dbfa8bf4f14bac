"""Property: resharding between random layouts keeps the global value (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.shardcheck import Snapshot, assert_shares_replicas, from_blocks, global_of, ints

SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
NAMES = ("dp", "tp", "pp")


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    return DeviceMesh.cpu(shape, NAMES[:ndim])


@st.composite
def layouts(draw: st.DrawFn, mesh: DeviceMesh, rank: int, partial: bool) -> Layout:
    """Per mesh axis: replicated, sharding a random dim, or (if allowed) Partial(op)."""
    kinds = ["R", "S", "P"] if partial else ["R", "S"]
    dims: list[list[int]] = [[] for _ in range(rank)]
    ops: list[ReduceOp | None] = [None] * mesh.ndim
    for a in range(mesh.ndim):
        kind = draw(st.sampled_from(kinds))
        if kind == "S":
            dims[draw(st.integers(0, rank - 1))].append(a)
        elif kind == "P":
            ops[a] = draw(st.sampled_from(list(ReduceOp)))
    # several mesh axes on one dim: any order (mesh order or not)
    dims = [draw(st.permutations(d)) if len(d) > 1 else d for d in dims]
    return Layout(mesh, tuple(tuple(d) for d in dims), tuple(ops))


@st.composite
def cases(draw: st.DrawFn, src_partial: bool, dst_partial: bool) -> tuple:
    mesh = draw(meshes())
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(rank))
    src = draw(layouts(mesh, rank, src_partial))
    dst = draw(layouts(mesh, rank, dst_partial))
    return shape, src, dst, draw(st.integers(0, 2**16))


def check_plan(plan: sw.Plan, src: Layout, dst: Layout) -> None:
    assert plan.src == src and plan.dst == dst
    if src == dst:
        assert plan.steps == ()
        return
    assert plan.steps, "different layouts need at least one step"
    assert plan.steps[0].before == src
    for a, b in zip(plan.steps, plan.steps[1:], strict=False):
        assert a.after == b.before
    assert plan.steps[-1].after == dst


def reshard_and_check(x: sw.Tensor, dst: Layout) -> sw.Tensor:
    snap = Snapshot(x)
    check_plan(sw.plan(x, dst), x.dist_layout, dst)
    y = sw.shard(x, dst.mesh, dst)
    snap.check()
    assert y.dist_layout == dst and y.shape == x.shape and y.dtype == x.dtype
    assert_shares_replicas(y)
    return y


@SETTINGS
@given(cases(src_partial=False, dst_partial=False))
def test_reshard_keeps_value_exactly(case: tuple) -> None:
    shape, src, dst, seed = case
    value = ints(shape, seed)
    x = sw.tensor(value, sharding=src)
    assert torch.equal(global_of(x), value)
    y = reshard_and_check(x, dst)
    assert torch.equal(global_of(y), value)
    assert torch.equal(y.to_torch(), value)


@SETTINGS
@given(cases(src_partial=True, dst_partial=True))
def test_reshard_from_partial_keeps_reduced_value(case: tuple) -> None:
    shape, src, dst, seed = case
    x = from_blocks(src, shape, seed)  # arbitrary per-device values on Partial axes
    want = global_of(x)
    y = reshard_and_check(x, dst)
    torch.testing.assert_close(global_of(y), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.to_torch(), want, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(cases(src_partial=False, dst_partial=True))
def test_place_into_any_layout(case: tuple) -> None:
    """Building a Tensor directly in a (possibly Partial) layout keeps the value."""
    shape, _, dst, seed = case
    value = ints(shape, seed)
    x = sw.tensor(value, sharding=dst)
    assert x.dist_layout == dst
    assert_shares_replicas(x)
    torch.testing.assert_close(global_of(x), value, rtol=0, atol=0)
