"""Values of every communication op against a torch reference, on 1-D to 3-D meshes.

Non-reducing (layout) ops must be bit-identical to the reference (``torch.equal``);
reductions are compared with ``allclose``. Every op is also checked not to mutate
its input, and every result is checked shard by shard by the oracle in
``shardcheck.py`` (shapes per the split rule, replicas equal).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import shardwise as sw
from shardwise import (
    CPU,
    DeviceMesh,
    NamedMapping,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
)
from shardwise.sharding import Layout
from tests.helpers.meshes import M4, M22, M23, M222
from tests.helpers.shardcheck import (
    REDUCE,
    Snapshot,
    assert_shares_replicas,
    coord,
    global_of,
    ints,
)

MESHES = [M4, M22, M23, M222]
# even, uneven (5 over 4, 2 over 3) and empty dims
SHAPES = [(12, 6), (5, 7), (2, 3), (0, 4), (4, 6, 5)]


def mid(mesh: DeviceMesh) -> str:
    return repr(mesh)


def layout_of(mesh: DeviceMesh, dims: tuple, partial: tuple | None = None) -> Layout:
    names = mesh.axis_names
    return Layout(mesh, tuple(tuple(names.index(n) for n in d) for d in dims),
                  partial or (None,) * mesh.ndim)


def sharded_layouts(mesh: DeviceMesh, rank: int) -> list[Layout]:
    """A spread of non-Partial layouts: each axis alone, all axes on one dim in mesh
    order and reversed, and axes spread over dims."""
    names = mesh.axis_names
    out = [Layout.replicated(mesh, rank)]
    for n in names:
        out.append(layout_of(mesh, ((n,),) + ((),) * (rank - 1)))
        out.append(layout_of(mesh, ((),) * (rank - 1) + ((n,),)))
    if len(names) > 1:
        out.append(layout_of(mesh, (names,) + ((),) * (rank - 1)))
        out.append(layout_of(mesh, (names[::-1],) + ((),) * (rank - 1)))
        spread = [[] for _ in range(rank)]
        for i, n in enumerate(names):
            spread[i % rank].append(n)
        out.append(layout_of(mesh, tuple(tuple(s) for s in spread)))
    return out


def case_ids(case: tuple) -> str:
    return f"{case[0]!r}-{case[1]}"


CASES = [(m, s) for m in MESHES for s in SHAPES]


def run(op, x: sw.Tensor, *args, **kwargs) -> sw.Tensor:
    """Apply ``op``, checking it leaves ``x`` untouched and gives a well-formed result."""
    snap = Snapshot(x)
    y = op(x, *args, **kwargs)
    snap.check()
    assert isinstance(y, sw.Tensor)
    assert_shares_replicas(y)
    return y


# --- construction ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_tensor_places_blocks_by_split_rule(case: tuple) -> None:
    mesh, shape = case
    value = ints(shape, 1)
    for layout in sharded_layouts(mesh, len(shape)):
        x = sw.tensor(value, sharding=layout)
        assert x.dist_layout == layout and x.shape == shape
        assert torch.equal(global_of(x), value)
        assert torch.equal(x.to_torch(), value)
        assert_shares_replicas(x)


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_filled_constructors(case: tuple) -> None:
    mesh, shape = case
    for layout in sharded_layouts(mesh, len(shape)):
        assert torch.equal(global_of(sw.zeros(shape, sharding=layout)), torch.zeros(shape))
        assert torch.equal(global_of(sw.ones(shape, sharding=layout)), torch.ones(shape))
        assert torch.equal(global_of(sw.full(shape, 2.5, sharding=layout)),
                           torch.full(shape, 2.5))
        r = sw.randn(shape, sharding=layout, seed=3)
        assert global_of(r).shape == shape and r.dtype == torch.float32
        assert torch.equal(global_of(r), r.to_torch())


@pytest.mark.parametrize("mesh", MESHES, ids=mid)
@pytest.mark.parametrize("n", [0, 1, 2, 5, 9, 12])
def test_arange(mesh: DeviceMesh, n: int) -> None:
    for layout in sharded_layouts(mesh, 1):
        x = sw.arange(n, sharding=layout)
        assert torch.equal(global_of(x), torch.arange(n))


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_partial_constructors_keep_value(mesh: DeviceMesh, op: ReduceOp) -> None:
    value = ints((5, 3), 2)
    partial = tuple(op if a == 0 else None for a in range(mesh.ndim))
    layout = Layout(mesh, ((), ()), partial)
    x = sw.tensor(value, sharding=layout)
    torch.testing.assert_close(global_of(x), value)
    torch.testing.assert_close(global_of(sw.full((5, 3), 3.0, sharding=layout)),
                               torch.full((5, 3), 3.0))


@pytest.mark.parametrize("ops", [(ReduceOp.PROD, ReduceOp.SUM), (ReduceOp.SUM, ReduceOp.PROD),
                                 (ReduceOp.MAX, ReduceOp.SUM), (ReduceOp.PROD, ReduceOp.AVG)])
def test_mixed_partial_ops_keep_value(ops: tuple) -> None:
    """Regression: a Partial(PROD) outer axis over a Partial(SUM) inner axis used to
    reduce to size(inner) * value (make_partial order followed a set's hash order)."""
    value = torch.tensor([3.0, 5.0, -2.0])
    layout = Layout(M22, ((),), ops)
    x = sw.tensor(value, sharding=layout)
    torch.testing.assert_close(global_of(x), value)
    torch.testing.assert_close(x.to_torch(), value)
    r = sw.tensor(value, sharding=Layout.replicated(M22, 1))
    y = run(sw.shard, r, M22, layout)
    torch.testing.assert_close(global_of(y), value)
    # from a SUM Partial on the inner axis (kept) to PROD on the outer one added
    p = sw.shard(r, M22, Layout(M22, ((),), (None, ReduceOp.SUM)))
    z = run(sw.shard, p, M22, Layout(M22, ((),), (ReduceOp.PROD, ReduceOp.SUM)))
    torch.testing.assert_close(global_of(z), value)


def test_from_local_uneven() -> None:
    rows = [torch.full((2, 3), float(k)) for k in range(3)] + [torch.full((1, 3), 3.0)]
    x = sw.from_local(rows, PlacementMapping(M4, [Sharded(0)]), shape=(7, 3))
    assert torch.equal(global_of(x), torch.cat(rows))
    assert x.shards[3] is rows[3]


# --- shard / reshard ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_shard_between_layouts(case: tuple) -> None:
    mesh, shape = case
    value = ints(shape, 3)
    layouts = sharded_layouts(mesh, len(shape))
    for src in layouts:
        x = sw.tensor(value, sharding=src)
        for dst in layouts:
            y = run(sw.shard, x, mesh, dst)
            assert y.dist_layout == dst
            assert torch.equal(global_of(y), value)


@pytest.mark.parametrize("mesh", MESHES, ids=mid)
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("shape", [(8, 6), (5, 3), (2, 2), (0, 3)], ids=str)
def test_shard_partial_source(mesh: DeviceMesh, op: ReduceOp, shape: tuple) -> None:
    partial = (op,) + (None,) * (mesh.ndim - 1)
    locals_ = [ints(shape, k, low=1, high=4) for k in range(mesh.num_devices)]
    x = sw.from_local(locals_, Layout(mesh, ((), ()), partial), shape)
    want = global_of(x)
    rest = mesh.axis_names[1:]
    targets = [Layout.replicated(mesh, 2), layout_of(mesh, ((mesh.axis_names[0],), ()))]
    if rest:
        targets.append(layout_of(mesh, (rest, ()), partial))
    for dst in targets:
        y = run(sw.shard, x, mesh, dst)
        torch.testing.assert_close(global_of(y), want)
    # Partial of another op: resolves, then re-made
    other = ReduceOp.MAX if op is not ReduceOp.MAX else ReduceOp.SUM
    y = run(sw.shard, x, mesh, Layout(mesh, ((), ()), (other, *partial[1:])))
    torch.testing.assert_close(global_of(y), want)


def test_shard_accepts_every_sharding_form() -> None:
    value = ints((4, 6), 4)
    x = sw.tensor(value)
    forms = [
        (["tp", "dp"], (("tp",), ("dp",))),
        ([("dp", "tp"), None], (("dp", "tp"), ())),
        ([("tp", "dp"), None], (("tp", "dp"), ())),
        (PlacementMapping(M22, [Sharded(1), Sharded(0)]), (("tp",), ("dp",))),
        (NamedMapping(M22, (None, ("tp", "dp"))), ((), ("tp", "dp"))),
    ]
    for spec, dims in forms:
        y = run(sw.shard, x, M22, spec)
        assert y.dist_layout == layout_of(M22, dims)
        assert torch.equal(global_of(y), value)
    y = sw.shard(value, M22, ["dp", None])  # host data
    assert torch.equal(global_of(y), value)
    assert y.dist_layout == layout_of(M22, (("dp",), ()))
    r = sw.shard(x, M22, ["dp", None], replicated_axes={"tp"})
    assert r.dist_layout == layout_of(M22, (("dp",), ())) and torch.equal(global_of(r), value)
    z = sw.shard(x, M22, [None, None], partial_sum_axes={"tp"})
    assert z.dist_layout.partial == (None, ReduceOp.SUM)
    assert torch.equal(global_of(z), value)


def test_reshard_is_deprecated_alias() -> None:
    x = sw.tensor(ints((5, 4), 5), sharding=PlacementMapping(M22, [Sharded(0), Replicated()]))
    with pytest.warns(DeprecationWarning, match="shard"):
        y = sw.reshard(x, M22, [None, ("tp", "dp")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = sw.shard(x, M22, [None, ("tp", "dp")])
    assert y.dist_layout == z.dist_layout
    assert torch.equal(global_of(y), global_of(z))


# --- all_gather ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_all_gather(case: tuple) -> None:
    mesh, shape = case
    value = ints(shape, 6)
    rank = len(shape)
    for src in sharded_layouts(mesh, rank):
        x = sw.tensor(value, sharding=src)
        for axis in [*range(rank), -1, None]:
            y = run(sw.all_gather, x, axis)
            want = list(src.dims)
            if axis is None:
                want = [()] * rank
            else:
                want[axis] = ()
            assert y.dist_layout == src.with_dims(tuple(want))
            assert torch.equal(global_of(y), value)
        full = sw.all_gather(x)
        assert all(s is full.shards[0] for s in full.shards)


def test_all_gather_keeps_partial_axes() -> None:
    layout = Layout(M22, ((1,), ()), (ReduceOp.MAX, None))
    rows = [3, 2, 3, 2]  # device (dp, tp) holds tp-piece tp of 5 rows
    x = sw.from_local([ints((r, 2), k) for k, r in enumerate(rows)], layout, (5, 2))
    y = run(sw.all_gather, x, 0)
    assert y.dist_layout == Layout(M22, ((), ()), (ReduceOp.MAX, None))
    assert torch.equal(global_of(y), global_of(x))


# --- all_to_all ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_all_to_all_moves_minor_axis(case: tuple) -> None:
    mesh, shape = case
    value = ints(shape, 7)
    rank = len(shape)
    for src in sharded_layouts(mesh, rank):
        x = sw.tensor(value, sharding=src)
        for concat in range(rank):
            if not src.dims[concat]:
                continue
            for split in range(rank):
                y = run(sw.all_to_all, x, split, concat)
                if split == concat:
                    assert y is x
                    continue
                dims = list(src.dims)
                a = dims[concat][-1]
                dims[concat] = dims[concat][:-1]
                dims[split] = (*dims[split], a)
                assert y.dist_layout == src.with_dims(tuple(dims))
                assert torch.equal(global_of(y), value)


def test_all_to_all_per_device_matches_jax_tiled() -> None:
    """Each device splits its block along split_axis into one chunk per peer and
    concatenates what it receives along concat_axis."""
    value = ints((8, 8), 8)
    x = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    y = run(sw.all_to_all, x, 1, 0)
    for k in range(4):
        chunks = [x.shards[j].chunk(4, dim=1)[k] for j in range(4)]
        assert torch.equal(y.shards[k], torch.cat(chunks, dim=0))


def test_all_to_all_uneven_and_negative_axes() -> None:
    value = ints((5, 7), 9)
    x = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    y = run(sw.all_to_all, x, -1, -2)
    assert y.dist_layout == layout_of(M4, ((), ("x",)))
    assert [tuple(s.shape) for s in y.shards] == [(5, 2), (5, 2), (5, 2), (5, 1)]
    assert torch.equal(global_of(y), value)
    z = run(sw.all_to_all, y, 0, 1)
    assert z.dist_layout == x.dist_layout and torch.equal(global_of(z), value)
    # a dim split over (dp, tp): only the minor-most axis moves, named or not
    w = sw.tensor(ints((6, 4), 1), sharding=layout_of(M22, (("dp", "tp"), ())))
    v = run(sw.all_to_all, w, 1, 0, axis_name="tp")
    assert v.dist_layout == layout_of(M22, (("dp",), ("tp",)))
    assert torch.equal(global_of(v), global_of(w))


# --- all_reduce / reduce_scatter ------------------------------------------------------
def combine_groups(x: sw.Tensor, axes: tuple[int, ...], op: ReduceOp) -> list[torch.Tensor]:
    """psum semantics per device: combine the local values of the devices that differ
    from it only on ``axes``."""
    mesh = x.mesh
    out = []
    for k in range(mesh.num_devices):
        c = coord(mesh, k)
        group = [j for j in range(mesh.num_devices)
                 if all(coord(mesh, j)[a] == c[a] for a in range(mesh.ndim) if a not in axes)]
        out.append(REDUCE[op](torch.stack([x.shards[j] for j in group]), 0))
    return out


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_all_reduce_partial_keeps_global_value(mesh: DeviceMesh, op: ReduceOp) -> None:
    for shape in [(4, 6), (5, 3), (0, 2)]:
        partial = tuple(op if a % 2 == 0 else None for a in range(mesh.ndim))
        layout = Layout(mesh, ((), ()), partial)
        x = sw.from_local([ints(shape, k, low=1, high=4) for k in range(mesh.num_devices)],
                          layout, shape)
        want = global_of(x)
        y = run(sw.all_reduce, x)
        assert y.dist_layout == Layout.replicated(mesh, 2)
        torch.testing.assert_close(global_of(y), want)
        # per device: psum of the local values
        for got, exp in zip(y.shards, combine_groups(x, layout.partial_axes, op), strict=True):
            torch.testing.assert_close(got, exp)


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_all_reduce_replicated_is_psum(mesh: DeviceMesh, op: ReduceOp) -> None:
    """A Replicated v on n devices: SUM gives n*v, PROD v**n, AVG/MIN/MAX v."""
    value = ints((3, 4), 10, low=-2, high=3)
    x = sw.tensor(value, sharding=Layout.replicated(mesh, 2))
    n = mesh.num_devices
    want = {ReduceOp.SUM: n * value, ReduceOp.PROD: value**n}.get(op, value)
    y = run(sw.all_reduce, x, reduce_op=op.value)
    assert y.dist_layout == Layout.replicated(mesh, 2)
    torch.testing.assert_close(global_of(y), want)
    # over one named axis only
    a = mesh.axis_names[-1]
    m = mesh.axis_size(a)
    want1 = {ReduceOp.SUM: m * value, ReduceOp.PROD: value**m}.get(op, value)
    torch.testing.assert_close(global_of(run(sw.all_reduce, x, reduce_axes=a, reduce_op=op)),
                               want1)


@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_all_reduce_sharded_sums_local_blocks(mesh: DeviceMesh) -> None:
    """psum over the axes sharding a dim adds the blocks: [a, b] -> a + b."""
    value = ints((8, 3), 11)
    names = mesh.axis_names
    x = sw.tensor(value, sharding=layout_of(mesh, ((names[0],), ())))
    y = run(sw.all_reduce, x, reduce_axes=names[0])
    k = mesh.axis_size(names[0])
    assert y.shape == (8 // k, 3)
    assert y.dist_layout == Layout.replicated(mesh, 2)
    assert torch.equal(global_of(y), value.reshape(k, 8 // k, 3).sum(0))
    # over every axis (default): the mesh axes not sharding count as replicas
    z = run(sw.all_reduce, x)
    torch.testing.assert_close(global_of(z),
                               value.reshape(k, 8 // k, 3).sum(0) * (mesh.num_devices // k))
    for got, exp in zip(z.shards, combine_groups(x, tuple(range(mesh.ndim)), ReduceOp.SUM),
                        strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("dims", [("dp", "tp"), ("tp", "dp")])
def test_all_reduce_over_several_axes_sharding_one_dim(dims: tuple) -> None:
    """Regression: the evenness check used the dim size already shrunk by the first
    axis, so reducing over two axes of one (evenly) sharded dim raised."""
    value = ints((4, 3), 19)
    x = sw.tensor(value, sharding=layout_of(M22, (dims, ())))
    blocks = value.reshape(4, 1, 3)  # piece k = row k
    y = run(sw.all_reduce, x, reduce_axes=("dp", "tp"))
    assert y.shape == (1, 3) and y.dist_layout == Layout.replicated(M22, 2)
    assert torch.equal(global_of(y), blocks.sum(0))
    z = run(sw.reduce_scatter, x, 1, reduce_axes=dims)
    assert z.shape == (1, 3) and z.dist_layout == layout_of(M22, ((), dims))
    assert torch.equal(global_of(z), blocks.sum(0))
    # only the minor axis: the major one still shards the (halved) dim
    minor = dims[1]
    w = run(sw.all_reduce, x, reduce_axes=minor)
    assert w.shape == (2, 3) and w.dist_layout == layout_of(M22, ((dims[0],), ()))
    assert torch.equal(global_of(w), torch.cat([blocks[0] + blocks[1], blocks[2] + blocks[3]]))
    for got, exp in zip(w.shards, combine_groups(x, (M22.axis_index(minor),), ReduceOp.SUM),
                        strict=True):
        assert torch.equal(got, exp)


def test_all_reduce_partial_and_replicated_axes_together() -> None:
    """Over a Partial axis and a Replicated one: the Partial resolves, the replicas add."""
    layout = Layout(M23, ((), ()), (ReduceOp.SUM, None))
    x = sw.from_local([ints((2, 3), k) for k in range(6)], layout, (2, 3))
    y = run(sw.all_reduce, x, reduce_axes=("tp", "dp"))
    assert torch.equal(global_of(y), 3 * global_of(x))
    for got, exp in zip(y.shards, combine_groups(x, (0, 1), ReduceOp.SUM), strict=True):
        assert torch.equal(got, exp)


def test_all_reduce_op_overrides_the_partial_op() -> None:
    """reduce_op combines the local values by that op, whatever the Partial's op."""
    layout = Layout(M4, ((),), (ReduceOp.SUM,))
    x = sw.from_local([torch.tensor([float(k), -float(k)]) for k in range(4)], layout, (2,))
    y = run(sw.all_reduce, x, reduce_op="max")
    assert torch.equal(global_of(y), torch.tensor([3.0, 0.0]))
    z = run(sw.reduce_scatter, x, 0, reduce_op=ReduceOp.MIN)
    assert torch.equal(global_of(z), torch.tensor([0.0, -3.0]))


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_reduce_scatter_partial(mesh: DeviceMesh, op: ReduceOp) -> None:
    names = mesh.axis_names
    for shape in [(8, 6), (5, 7), (2, 3), (0, 4)]:
        layout = Layout(mesh, ((), ()), (op,) * mesh.ndim)
        x = sw.from_local([ints(shape, k, low=1, high=3) for k in range(mesh.num_devices)],
                          layout, shape)
        want = global_of(x)
        for axis in (0, 1, -1):
            y = run(sw.reduce_scatter, x, axis)
            assert y.dist_layout == Layout(mesh, ((), ()), (None,) * mesh.ndim).with_dims(
                tuple(tuple(range(mesh.ndim)) if d == axis % 2 else () for d in range(2)))
            torch.testing.assert_close(global_of(y), want)
        # a subset of axes, in non-mesh order: the others stay Partial
        if mesh.ndim > 1:
            axes = names[::-1][: mesh.ndim - 1]
            y = run(sw.reduce_scatter, x, 0, reduce_axes=axes)
            assert y.dist_layout.dims[0] == tuple(names.index(a) for a in axes)
            assert y.dist_layout.partial[0] is op
            torch.testing.assert_close(global_of(y), want)


@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_reduce_scatter_replicated_is_psum_scatter(mesh: DeviceMesh) -> None:
    value = ints((5, 6), 12)
    x = sw.tensor(value, sharding=Layout.replicated(mesh, 2))
    y = run(sw.reduce_scatter, x, 0, reduce_op="sum")
    assert y.dist_layout.dims[0] == tuple(range(mesh.ndim))
    assert torch.equal(global_of(y), value * mesh.num_devices)
    z = run(sw.reduce_scatter, x, 1, reduce_op=ReduceOp.MAX)
    assert torch.equal(global_of(z), value)


# --- broadcast, transfers -------------------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES, ids=mid)
def test_distributed_broadcast(mesh: DeviceMesh) -> None:
    value = ints((5, 3), 13)
    src = sw.tensor(value)
    y = run(sw.distributed_broadcast, src, mesh)
    assert y.mesh == mesh and y.dist_layout == Layout.replicated(mesh, 2)
    assert torch.equal(global_of(y), value)
    assert all(s is y.shards[0] for s in y.shards)
    with mesh:
        z = sw.distributed_broadcast(value)
    assert z.mesh == mesh and torch.equal(global_of(z), value)
    # from a sharded tensor on another mesh
    other = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    w = run(sw.distributed_broadcast, other, mesh)
    assert torch.equal(global_of(w), value)


@pytest.mark.parametrize("mesh", MESHES, ids=mid)
@pytest.mark.parametrize("shape", [(5, 3), (0, 2), (2, 2)], ids=str)
def test_to_device_gathers_and_distributes(mesh: DeviceMesh, shape: tuple) -> None:
    value = ints(shape, 14)
    for layout in sharded_layouts(mesh, 2):
        x = sw.tensor(value, sharding=layout)
        for fn in (lambda t: sw.to_device(t, CPU(0)), lambda t: sw.transfer_to(t, CPU(0)),
                   sw.cpu):
            y = run(fn, x)
            assert y.dist_device == CPU(0) and y.mesh.is_single
            assert torch.equal(global_of(y), value)
        # to another device, and to another mesh
        assert sw.to_device(x, CPU(5)).dist_device == CPU(5)
        z = run(sw.to_device, x, sharding=PlacementMapping(M4, [Sharded(1)]))
        assert z.mesh == M4 and torch.equal(global_of(z), value)
        # same mesh: a reshard
        back = run(sw.to_device, z, sharding=layout)
        assert back.dist_layout == layout and torch.equal(global_of(back), value)
    assert sw.to_device(x) is x
    host = sw.to_device(value)
    assert host.dist_device == CPU(0) and torch.equal(host.to_torch(), value)


def test_to_device_partial_source_reduces() -> None:
    layout = Layout(M22, ((), ()), (ReduceOp.SUM, ReduceOp.MAX))
    x = sw.from_local([ints((3, 2), k) for k in range(4)], layout, (3, 2))
    y = run(sw.cpu, x)
    torch.testing.assert_close(global_of(y), global_of(x))


# --- ppermute ---------------------------------------------------------------------------
def test_ppermute_flat_cycle() -> None:
    value = ints((8, 3), 15)
    x = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    perm = [(k, (k + 1) % 4) for k in range(4)]
    y = run(sw.ppermute, x, perm)
    assert y.dist_layout == x.dist_layout
    for src, dst in perm:
        assert torch.equal(y.shards[dst], x.shards[src])
    assert torch.equal(global_of(y), torch.roll(value, 2, dims=0))


def test_ppermute_receivers_of_nothing_get_zeros() -> None:
    value = ints((8, 3), 16, low=1, high=5)
    x = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    y = run(sw.ppermute, x, [(0, 2), (3, 1)])
    assert torch.equal(y.shards[2], x.shards[0])
    assert torch.equal(y.shards[1], x.shards[3])
    for k in (0, 3):
        assert torch.equal(y.shards[k], torch.zeros(2, 3))
    assert torch.equal(global_of(y), torch.cat([torch.zeros(2, 3), value[6:], value[:2],
                                                torch.zeros(2, 3)]))
    empty = run(sw.ppermute, x, [])
    assert torch.equal(global_of(empty), torch.zeros(8, 3))


@pytest.mark.parametrize("mesh", [M22, M23, M222], ids=mid)
def test_ppermute_along_axis(mesh: DeviceMesh) -> None:
    names = mesh.axis_names
    a = names[-1]
    n = mesh.axis_size(a)
    value = ints((2 * n * 2, 3), 17)
    x = sw.tensor(value, sharding=layout_of(mesh, ((names[0], a), ())))
    perm = [(i, (i + 1) % n) for i in range(n)]
    y = run(sw.ppermute, x, perm, axis_name=a)
    ai = mesh.axis_index(a)
    for k in range(mesh.num_devices):
        c = list(coord(mesh, k))
        c[ai] = (c[ai] - 1) % n
        assert torch.equal(y.shards[k], x.shards[mesh.index_of(c)])
    # along a replicated axis a full permutation keeps the value
    r = sw.tensor(value, sharding=layout_of(mesh, ((names[0],), ())))
    z = run(sw.ppermute, r, perm, axis_name=a)
    assert torch.equal(global_of(z), value)


def test_ppermute_uneven_and_empty_blocks_of_equal_shape() -> None:
    """2 rows over 4 devices: blocks [1, 1, 0, 0]; equal-shape blocks trade places."""
    value = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    x = sw.tensor(value, sharding=PlacementMapping(M4, [Sharded(0)]))
    y = run(sw.ppermute, x, [(0, 1), (1, 0), (2, 3), (3, 2)])
    assert [tuple(s.shape) for s in y.shards] == [(1, 2), (1, 2), (0, 2), (0, 2)]
    assert torch.equal(global_of(y), value.flip(0))
    five = sw.tensor(ints((5, 2), 3), sharding=PlacementMapping(M4, [Sharded(0)]))
    z = run(sw.ppermute, five, [(1, 2), (2, 1)])  # blocks [2, 1, 1, 1]
    assert torch.equal(z.shards[1], five.shards[2])
    assert torch.equal(z.shards[0], torch.zeros(2, 2))


def test_ppermute_partial_keeps_layout() -> None:
    layout = Layout(M4, ((),), (ReduceOp.SUM,))
    x = sw.from_local([torch.full((3,), float(k)) for k in range(4)], layout, (3,))
    y = run(sw.ppermute, x, [(0, 1), (1, 0)])
    assert y.dist_layout == layout
    assert torch.equal(global_of(y), torch.full((3,), 1.0))


# --- composite: a value through a chain of ops ----------------------------------------
@pytest.mark.parametrize("shape", [(6, 4, 5), (5, 3, 2), (2, 2, 0)], ids=str)
def test_chain_on_3d_mesh(shape: tuple) -> None:
    value = ints(shape, 18)
    x = sw.tensor(value, sharding=layout_of(M222, (("a",), ("c", "b"), ())))
    y = run(sw.all_to_all, x, 2, 1)
    y = run(sw.shard, y, M222, layout_of(M222, ((), ("a",), ("b", "c"))))
    y = run(sw.all_gather, y, 1)
    assert torch.equal(global_of(y), value)
    p = run(sw.shard, y, M222, layout_of(M222, ((), (), ("c",)), (ReduceOp.SUM, None, None)))
    q = run(sw.reduce_scatter, p, 0)
    assert q.dist_layout == layout_of(M222, (("a",), (), ("c",)))
    assert torch.equal(global_of(q), value)
    assert math.prod(q.shape) == value.numel()
