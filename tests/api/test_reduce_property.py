"""Property: all_reduce / reduce_scatter combine the local values per device (psum),
over random meshes, layouts (even splits), reduce axes and reduce ops (hypothesis).

One reduce op per case (the source's Partial axes and the reduction share it), so
per-device psum and "resolve the Partial, keep the global value" agree.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.shardcheck import (
    REDUCE,
    Snapshot,
    assert_shares_replicas,
    coord,
    from_blocks,
    global_of,
)

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    ndim = draw(st.integers(1, 3))
    mesh = DeviceMesh.cpu(tuple(draw(st.integers(1, 3)) for _ in range(ndim)),
                          ("dp", "tp", "pp")[:ndim])
    rank = draw(st.integers(1, 3))
    op = draw(st.sampled_from(list(ReduceOp)))
    dims: list[list[int]] = [[] for _ in range(rank)]
    partial: list[ReduceOp | None] = [None] * ndim
    for a in range(ndim):
        kind = draw(st.sampled_from(["R", "S", "P"]))
        if kind == "S":
            dims[draw(st.integers(0, rank - 1))].append(a)
        elif kind == "P":
            partial[a] = op
    dims = [draw(st.permutations(d)) if len(d) > 1 else d for d in dims]
    layout = Layout(mesh, tuple(tuple(d) for d in dims), tuple(partial))
    # even splits: every block has the same shape (psum needs it)
    shape = tuple(math.prod(mesh.mesh_shape[a] for a in d) * draw(st.integers(0, 3))
                  for d in layout.dims)
    axes = draw(st.lists(st.sampled_from(range(ndim)), min_size=1, unique=True))
    return layout, shape, tuple(axes), op, draw(st.integers(0, rank - 1)), draw(st.integers())


def psum(x: sw.Tensor, axes: tuple[int, ...], op: ReduceOp) -> list[torch.Tensor]:
    mesh = x.mesh
    out = []
    for k in range(mesh.num_devices):
        c = coord(mesh, k)
        group = [j for j in range(mesh.num_devices)
                 if all(coord(mesh, j)[a] == c[a] for a in range(mesh.ndim) if a not in axes)]
        out.append(REDUCE[op](torch.stack([x.shards[j].detach() for j in group]), 0))
    return out


@SETTINGS
@given(cases())
def test_all_reduce_is_psum(case: tuple) -> None:
    layout, shape, axes, op, _, seed = case
    x = from_blocks(layout, shape, seed % 1000)
    snap = Snapshot(x)
    names = [x.mesh.axis_names[a] for a in axes]
    y = sw.all_reduce(x, reduce_axes=names, reduce_op=op.value)
    snap.check()
    assert all(y.dist_layout.partial[a] is None for a in axes)
    assert all(a not in y.dist_layout.sharded_axes for a in axes)
    assert_shares_replicas(y)
    for got, want in zip(y.shards, psum(x, axes, op), strict=True):
        torch.testing.assert_close(got, want)


@SETTINGS
@given(cases())
def test_reduce_scatter_is_psum_then_scatter(case: tuple) -> None:
    layout, shape, axes, op, dim, seed = case
    x = from_blocks(layout, shape, seed % 1000)
    snap = Snapshot(x)
    names = [x.mesh.axis_names[a] for a in axes]
    y = sw.reduce_scatter(x, dim, reduce_axes=names, reduce_op=op)
    snap.check()
    assert y.dist_layout.dims[dim][-len(axes):] == axes  # appended minor-most, in the given order
    assert_shares_replicas(y)
    reduced = sw.all_reduce(x, reduce_axes=names, reduce_op=op)
    want = global_of(sw.Tensor(psum(x, axes, op), reduced.dist_layout, reduced.shape))
    torch.testing.assert_close(global_of(y), want)
