"""The simulated runtime's size-dependent routes give the same values.

Small tensors (``SMALL_BYTES``) gather whole and cut views, reduce with one
``stack().sum()``; large ones build block by block, reduce_scatter per block and
return adjacent views of one buffer as a view. Tests force each route on small
data by moving the threshold.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import shardwise as sw
from shardwise.runtime import buffers, simulated
from shardwise.runtime.simulated import host_paths
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.meshes import M4, M23

MESHES = [M4, M23]


def layouts(mesh: DeviceMesh, rank: int) -> list[Layout]:
    """Every layout with each mesh axis replicated or sharding one dim (mesh order)."""
    out = []
    for choice in itertools.product(range(-1, rank), repeat=mesh.ndim):
        dims = tuple(tuple(a for a in range(mesh.ndim) if choice[a] == d) for d in range(rank))
        out.append(Layout(mesh, dims, (None,) * mesh.ndim))
    return out


def global_value(t: sw.Tensor) -> torch.Tensor:
    return t.to_torch()


@pytest.fixture(params=["small", "large", "huge"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """small: below SMALL_BYTES; large: above it (one-buffer all_to_all); huge: also
    above the mmap limit (cat per target, reduce_scatter block by block)."""
    monkeypatch.setattr(buffers, "SMALL_BYTES", 1 << 40 if request.param == "small" else -1)
    if request.param == "huge":  # also: results go into out= buffers (buffers.empty)
        monkeypatch.setattr(host_paths, "MMAP_MAX", -1)
        monkeypatch.setattr(buffers, "MAPPED", -1)
    return str(request.param)


@pytest.mark.parametrize("mesh", MESHES, ids=repr)
@pytest.mark.parametrize("shape", [(6, 5), (7, 3, 2)])
def test_layout_ops_exact_on_both_routes(route: str, mesh: DeviceMesh, shape: tuple) -> None:
    value = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    for src, dst in itertools.product(layouts(mesh, len(shape)), repeat=2):
        x = sw.tensor(value, sharding=src)
        y = sw.shard(x, mesh, dst)
        assert y.dist_layout == dst
        assert torch.equal(global_value(y), value), (route, src, dst)
        # independent buffers (no shared storage to take a view of)
        x2 = sw.from_local([s.clone() for s in x.shards], src, shape=shape)
        assert torch.equal(global_value(sw.shard(x2, mesh, dst)), value), (route, src, dst)


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("n", [2, 5])
def test_reductions_on_both_routes(route: str, op: ReduceOp, n: int) -> None:
    mesh = DeviceMesh.cpu((n,), ("x",))
    gen = torch.Generator().manual_seed(n)
    terms = [torch.rand(7, 3, generator=gen) + 0.5 for _ in range(n)]
    x = sw.from_local(terms, sw.PlacementMapping(mesh, (sw.Partial(op),)), shape=(7, 3))
    stacked = torch.stack(terms)
    want = {ReduceOp.SUM: stacked.sum(0), ReduceOp.AVG: stacked.mean(0),
            ReduceOp.MAX: stacked.amax(0), ReduceOp.MIN: stacked.amin(0),
            ReduceOp.PROD: stacked.prod(0)}[op]
    torch.testing.assert_close(global_value(sw.all_reduce(x)), want)
    rs = sw.reduce_scatter(x, 0)
    assert rs.dist_layout.dims == ((0,), ())
    torch.testing.assert_close(global_value(rs), want)
    assert [tuple(s.shape) for s in rs.shards] == [
        tuple(b.shape) for b in want.tensor_split(n, 0)]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD])
def test_reduction_gradients_on_routes(route: str, op: ReduceOp) -> None:
    """While autograd records, no route writes into an out= buffer (not differentiable)."""
    mesh = DeviceMesh.cpu((4,), ("x",))
    gen = torch.Generator().manual_seed(3)
    terms = [(torch.rand(8, 3, generator=gen) + 0.5).requires_grad_() for _ in range(4)]
    ref = [t.detach().clone().requires_grad_() for t in terms]
    w = torch.randn(8, 3, generator=gen)
    fn = {ReduceOp.SUM: lambda s: s.sum(0), ReduceOp.MAX: lambda s: s.amax(0),
          ReduceOp.PROD: lambda s: s.prod(0)}[op]
    (fn(torch.stack(ref)) * w).sum().backward()
    x = sw.from_local(terms, sw.PlacementMapping(mesh, (sw.Partial(op),)), shape=(8, 3))
    (sw.all_reduce(x).shards[0] * w).sum().backward()
    for t, r in zip(terms, ref):
        torch.testing.assert_close(t.grad, r.grad)


def test_reduce_scatter_huge_route_is_per_block(route: str) -> None:
    mesh = DeviceMesh.cpu((4,), ("x",))
    terms = [torch.randn(8, 4) for _ in range(4)]
    x = sw.from_local(terms, sw.PlacementMapping(mesh, (sw.Partial(),)), shape=(8, 4))
    rs = sw.reduce_scatter(x, 0)
    storages = {s.untyped_storage().data_ptr() for s in rs.shards}
    # huge: one buffer per block; otherwise views of one reduced buffer
    assert len(storages) == (4 if route == "huge" else 1)
    want = terms[0] + terms[1] + terms[2] + terms[3]  # left to right, as the big routes
    if route != "small":
        assert torch.equal(torch.cat(rs.shards), want)
    else:
        torch.testing.assert_close(torch.cat(rs.shards), want)


def test_adjacent_views_gather_without_copy(route: str) -> None:
    mesh = DeviceMesh.cpu((4,), ("x",))
    value = torch.randn(8, 6)
    x = sw.tensor(value, sharding=sw.PlacementMapping(mesh, (sw.Sharded(0),)))
    y = sw.all_gather(x)
    same = y.shards[0].untyped_storage().data_ptr() == x.shards[0].untyped_storage().data_ptr()
    assert same == (route != "small")
    assert torch.equal(y.shards[0], value)
    assert not torch.equal(y.to_torch().add_(1), y.shards[0])  # to_torch copies shared storage


def test_no_view_while_recording_gradients(route: str) -> None:
    mesh = DeviceMesh.cpu((4,), ("x",))
    x = sw.tensor(torch.randn(8, 6), sharding=sw.PlacementMapping(mesh, (sw.Sharded(0),)),
                  requires_grad=True)
    y = sw.all_gather(x)
    w = torch.randn(8, 6)
    (y.shards[0] * w).sum().backward()
    grads = torch.cat([s.grad for s in x.shards])
    assert torch.equal(grads, w)


def test_buffer_reuse_toggle() -> None:
    was = simulated.buffer_reuse()
    try:
        ok = simulated.set_buffer_reuse(True)
        assert simulated.buffer_reuse() == ok
        mesh = DeviceMesh.cpu((4,), ("x",))
        value = torch.randn(64, 64)
        x = sw.from_local([b.clone() for b in value.tensor_split(4)],
                          sw.PlacementMapping(mesh, (sw.Sharded(0),)), shape=(64, 64))
        assert torch.equal(sw.all_gather(x).to_torch(), value)
    finally:
        simulated.set_buffer_reuse(was)
    assert simulated.buffer_reuse() is False or was
