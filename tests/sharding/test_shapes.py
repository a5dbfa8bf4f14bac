"""Shape arithmetic: the split rule, multi-axis dims, per-device shapes and their inverse."""

from __future__ import annotations

import itertools

import pytest

from shardwise.sharding import (
    ConversionError,
    DeviceMesh,
    DistributedBufferType,
    DistributedTensorType,
    Layout,
    NamedMapping,
    Partial,
    PlacementMapping,
    Replicated,
    Sharded,
    ShardingError,
    global_shape_from_local,
    local_shard_shape_from_global,
    shard_shape,
)
from shardwise.sharding.devices import CPU
from shardwise.sharding.shapes import (
    local_bounds,
    local_shape,
    piece_index,
    split_bounds,
    split_size,
)
from shardwise.sharding.types import BufferType, TensorType

R = Replicated()

# --- the split rule -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "n", "sizes"),
    [
        (5, 2, [3, 2]),
        (6, 4, [2, 2, 1, 1]),
        (0, 3, [0, 0, 0]),
        (2, 4, [1, 1, 0, 0]),
        (8, 4, [2, 2, 2, 2]),
        (7, 3, [3, 2, 2]),
        (1, 1, [1]),
        (3, 1, [3]),
        (10, 4, [3, 3, 2, 2]),
    ],
)
def test_split_table(size: int, n: int, sizes: list[int]) -> None:
    assert [split_size(size, n, k) for k in range(n)] == sizes
    bounds = [split_bounds(size, n, k) for k in range(n)]
    # contiguous, in order, covering [0, size)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert [stop - start for start, stop in bounds] == sizes


def test_split_bounds_examples() -> None:
    assert [split_bounds(5, 2, k) for k in range(2)] == [(0, 3), (3, 5)]
    assert [split_bounds(6, 4, k) for k in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [split_bounds(2, 4, k) for k in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


# --- multi-axis dims ------------------------------------------------------------------------


def test_piece_index() -> None:
    shape = (2, 3)
    # axes (a, b): coord (i, j) takes piece i * size(b) + j
    assert piece_index(shape, (0, 1), (1, 2)) == (1 * 3 + 2, 6)
    assert piece_index(shape, (0, 1), (0, 1)) == (1, 6)
    # axes (b, a): coord (i, j) takes piece j * size(a) + i
    assert piece_index(shape, (1, 0), (1, 2)) == (2 * 2 + 1, 6)
    assert piece_index(shape, (1,), (1, 2)) == (2, 3)
    assert piece_index(shape, (), (1, 2)) == (0, 1)


def test_multi_axis_dim_pieces() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("a", "b"))
    layout = Layout(mesh, ((0, 1),), (None, None))
    # 14 rows over 6 pieces: sizes 3,3,2,2,2,2 at starts 0,3,6,8,10,12
    expected = {
        (0, 0): ((0, 3),),
        (0, 1): ((3, 6),),
        (0, 2): ((6, 8),),
        (1, 0): ((8, 10),),
        (1, 1): ((10, 12),),
        (1, 2): ((12, 14),),
    }
    for coord, bounds in expected.items():
        assert local_bounds((14,), layout, coord) == bounds
    reversed_layout = Layout(mesh, ((1, 0),), (None, None))
    # axes (b, a): coord (i, j) takes piece j * 2 + i
    assert local_bounds((14,), reversed_layout, (0, 0)) == ((0, 3),)
    assert local_bounds((14,), reversed_layout, (1, 0)) == ((3, 6),)
    assert local_bounds((14,), reversed_layout, (0, 1)) == ((6, 8),)
    assert local_bounds((14,), reversed_layout, (1, 2)) == ((12, 14),)


def test_local_shape_and_bounds_agree() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("a", "b"))
    layout = Layout(mesh, ((1,), (), (0,)), (None, None))
    for k in range(mesh.num_devices):
        coord = mesh.coord_of(k)
        bounds = local_bounds((7, 2, 3), layout, coord)
        assert local_shape((7, 2, 3), layout, coord) == tuple(b - a for a, b in bounds)
        assert bounds[1] == (0, 2)


def test_local_shape_rank_mismatch_raises() -> None:
    layout = Layout.replicated(DeviceMesh.cpu(2, "x"), 2)
    with pytest.raises(ShardingError, match=r"Shape \(4,\) has rank 1 .* rank 2"):
        local_shape((4,), layout, (0,))
    with pytest.raises(ShardingError, match=r"Shape \(4, 4, 4\) has rank 3"):
        local_bounds((4, 4, 4), layout, (0,))


# --- shard_shape ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_shape", "placements", "mesh_shape", "expected"),
    [
        ((8, 6), [Sharded(0), Sharded(1)], (2, 4), (4, 2)),
        ((8, 6), [Sharded(1), Sharded(0)], (2, 4), (2, 3)),
        ((5, 3), [Sharded(0)], (2,), (3, 3)),
        ((5, 3), [R], (2,), (5, 3)),
        ((5, 3), [Partial()], (2,), (5, 3)),
        ((7,), [Sharded(0), Sharded(0)], (2, 2), (2,)),
        ((7,), [Sharded(-1), R], (3, 2), (3,)),
        ((0, 4), [Sharded(0)], (3,), (0, 4)),
        ((), [R, Partial("max")], (2, 2), ()),
    ],
)
def test_shard_shape(
    global_shape: tuple[int, ...],
    placements: list,
    mesh_shape: tuple[int, ...],
    expected: tuple[int, ...],
) -> None:
    assert shard_shape(global_shape, placements, mesh_shape) == expected


def test_shard_shape_validation() -> None:
    with pytest.raises(ShardingError, match="2 axes but 1 placements"):
        shard_shape((4,), [Sharded(0)], (2, 2))
    with pytest.raises(ShardingError, match="Got -1"):
        shard_shape((4, -1), [R], (2,))
    with pytest.raises(ShardingError, match="out of range for a tensor of rank 1"):
        shard_shape((4,), [Sharded(1)], (2,))


# --- local_shard_shape_from_global ----------------------------------------------------------


def test_local_shapes_row_major() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    shapes = local_shard_shape_from_global((5, 7), mesh, [Sharded(0), Sharded(1)])
    assert shapes == [(3, 3), (3, 2), (3, 2), (2, 3), (2, 2), (2, 2)]
    shapes = local_shard_shape_from_global((5, 7), mesh, [Sharded(1), Sharded(0)])
    assert shapes == [(2, 4), (2, 4), (1, 4), (2, 3), (2, 3), (1, 3)]


def test_local_shapes_replicated_and_partial() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    assert local_shard_shape_from_global((3, 3), mesh, [R, Partial()]) == [(3, 3)] * 4
    assert local_shard_shape_from_global((3,), mesh, [Partial("max"), Sharded(0)]) == [
        (2,),
        (1,),
        (2,),
        (1,),
    ]


def test_local_shapes_multi_axis() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    # dim 0 split over (dp, tp) into 4 pieces of 7: 2,2,2,1
    assert local_shard_shape_from_global((7,), mesh, [Sharded(0), Sharded(0)]) == [
        (2,),
        (2,),
        (2,),
        (1,),
    ]


def test_local_shapes_zero_and_scalar() -> None:
    mesh = DeviceMesh.cpu(3, "x")
    assert local_shard_shape_from_global((2, 0), mesh, [Sharded(0)]) == [(1, 0), (1, 0), (0, 0)]
    assert local_shard_shape_from_global((), mesh, [R]) == [(), (), ()]


def test_local_shapes_validation() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    with pytest.raises(ShardingError, match=r"Got 2\.5"):
        local_shard_shape_from_global((2.5,), mesh, [R])
    with pytest.raises(ShardingError, match="Got True"):
        local_shard_shape_from_global((True,), mesh, [R])
    with pytest.raises(ShardingError, match="1 axes but 2 placements"):
        local_shard_shape_from_global((4,), mesh, [R, R])


# --- global_shape_from_local -------------------------------------------------------------


def test_global_from_local_even() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    assert global_shape_from_local((3, 3), DeviceMesh.cpu(2, "x"), [Sharded(0)]) == (6, 3)
    assert global_shape_from_local((2, 5), mesh, [Sharded(1), Sharded(0)]) == (6, 10)
    assert global_shape_from_local((2,), mesh, [Sharded(0), Sharded(0)]) == (12,)
    assert global_shape_from_local((2, 5), mesh, [R, Partial()]) == (2, 5)


@pytest.mark.parametrize(
    ("global_shape", "placements"),
    [
        ((4, 6), [Sharded(0), Sharded(1)]),
        ((4, 6), [Sharded(1), R]),
        ((12,), [Sharded(0), Sharded(0)]),
        ((2, 3), [Partial(), Sharded(1)]),
    ],
)
def test_global_from_local_is_inverse_for_even_splits(
    global_shape: tuple[int, ...], placements: list
) -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    locals_ = local_shard_shape_from_global(global_shape, mesh, placements)
    for shape in locals_:
        assert global_shape_from_local(shape, mesh, placements) == global_shape
    assert global_shape_from_local(locals_[0], mesh, placements, local_shapes=locals_) == (
        global_shape
    )


@pytest.mark.parametrize(
    ("global_shape", "placements"),
    [
        ((5, 7), [Sharded(0), Sharded(1)]),
        ((5, 7), [Sharded(1), Sharded(0)]),
        ((7,), [Sharded(0), Sharded(0)]),
        ((1, 2), [Partial("min"), Sharded(1)]),
        ((0, 2), [Sharded(0), R]),
    ],
)
def test_global_from_local_uneven_needs_all_shapes(
    global_shape: tuple[int, ...], placements: list
) -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    locals_ = local_shard_shape_from_global(global_shape, mesh, placements)
    for shape in locals_:
        got = global_shape_from_local(shape, mesh, placements, local_shapes=locals_)
        assert got == global_shape


def test_global_from_local_uneven_without_shapes_assumes_even() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    # 5 rows over 2 devices give (3,), which alone reads as an even split of 6
    assert global_shape_from_local((3,), mesh, [Sharded(0)]) == (6,)
    assert global_shape_from_local((3,), mesh, [Sharded(0)], local_shapes=[(3,), (2,)]) == (5,)


def test_global_from_local_inconsistent_shapes_raise() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    with pytest.raises(ShardingError, match=r"do not follow the split rule.*\(5,\)"):
        global_shape_from_local((2,), mesh, [Sharded(0)], local_shapes=[(2,), (3,)])
    with pytest.raises(ShardingError, match="do not follow the split rule"):
        global_shape_from_local((3, 4), mesh, [Sharded(0)], local_shapes=[(3, 4), (3, 5)])
    with pytest.raises(ShardingError, match="do not follow the split rule"):
        # replicated copies must have equal shapes
        global_shape_from_local((3,), mesh, [R], local_shapes=[(3,), (2,)])
    with pytest.raises(ShardingError, match="gives 1 shapes for DeviceMesh\\(x=2\\)"):
        global_shape_from_local((3,), mesh, [Sharded(0)], local_shapes=[(3,)])
    with pytest.raises(ShardingError, match=r"include it"):
        global_shape_from_local((3,), mesh, [Sharded(0)], local_shapes=[(2,), (2,)])
    with pytest.raises(ShardingError, match=r"rank of local_shape"):
        global_shape_from_local((3,), mesh, [Sharded(0)], local_shapes=[(3,), (2, 1)])
    with pytest.raises(ShardingError, match="Got -2"):
        global_shape_from_local((3,), mesh, [Sharded(0)], local_shapes=[(3,), (-2,)])


# --- distributed types ------------------------------------------------------------------


def test_distributed_tensor_type() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    t = DistributedTensorType("float32", [5, 4], mesh, [Sharded(0), Sharded(1)])
    assert t.shape == (5, 4)
    assert t.rank == 2
    assert t.placements == (Sharded(0), Sharded(1))
    assert t.sharding == PlacementMapping(mesh, [Sharded(0), Sharded(1)])
    assert t.local_shapes == local_shard_shape_from_global((5, 4), mesh, t.placements)
    types = t.local_types
    assert types[0] == TensorType("float32", (3, 2), CPU(0))
    assert types[5] == TensorType("float32", (2, 1), CPU(5))
    assert all(type(x) is TensorType for x in types)
    assert repr(t) == (
        "DistributedTensorType(float32, [5, 4], DeviceMesh(dp=2, tp=3), "
        "[Sharded(axis=0), Sharded(axis=1)])"
    )
    assert t == DistributedTensorType("float32", (5, 4), mesh, (Sharded(0), Sharded(1)))
    assert hash(t) == hash(DistributedTensorType("float32", (5, 4), mesh, (Sharded(0), Sharded(1))))


def test_distributed_buffer_type() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    b = DistributedBufferType("int8", (3,), mesh, [Sharded(0)])
    assert [type(x) for x in b.local_types] == [BufferType, BufferType]
    assert [x.shape for x in b.local_types] == [(2,), (1,)]
    assert repr(b.local_types[1]) == "BufferType(int8, [1], CPU(1))"
    assert b != DistributedTensorType("int8", (3,), mesh, [Sharded(0)])


def test_distributed_type_from_sharding() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    t = DistributedTensorType.from_sharding(
        "float32", (6,), NamedMapping(mesh, ("tp",), unreduced={"dp"}, reduce_op="max")
    )
    assert isinstance(t, DistributedTensorType)
    assert t.placements == (Partial("max"), Sharded(0))
    with pytest.raises(ConversionError, match="not mesh order"):
        DistributedTensorType.from_sharding("float32", (6,), NamedMapping(mesh, (("tp", "dp"),)))


def test_distributed_type_validation() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    with pytest.raises(ShardingError, match="Got -1"):
        DistributedTensorType("float32", (-1,), mesh, [R])
    with pytest.raises(ShardingError, match="1 axes but 2 placements"):
        DistributedTensorType("float32", (4,), mesh, [R, R])
    with pytest.raises(ShardingError, match="out of range for a tensor of rank 1"):
        DistributedTensorType("float32", (4,), mesh, [Sharded(1)])
