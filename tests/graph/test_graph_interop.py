"""Between per-device values and distributed Tensors: from_tensor / to_tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
from shardwise.graph import Signals, from_tensor, ops, to_tensor
from shardwise.sharding import (
    DeviceMesh,
    DistributedTensorType,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingError,
    TensorType,
)
from shardwise.sharding.devices import CPU
from shardwise.sharding.errors import ShardingTypeError
from shardwise.tensors.tensor import Tensor
from tests.helpers.meshes import M22 as MESH


def same(a: Tensor, b: Tensor) -> bool:
    return (a.shape == b.shape and a.dist_layout == b.dist_layout and a.dtype == b.dtype
            and all(torch.equal(x, y) for x, y in zip(a.shards, b.shards, strict=True))
            and torch.equal(a.to_torch(), b.to_torch()))


SHARDINGS = {
    "S0,S1": PlacementMapping(MESH, [Sharded(0), Sharded(1)]),
    "R,S0": PlacementMapping(MESH, [Replicated(), Sharded(0)]),
    "S(dp,tp)": NamedMapping(MESH, (("dp", "tp"), None)),
    "P(sum),S1": PlacementMapping(MESH, [Partial(), Sharded(1)]),
    "P(max),R": PlacementMapping(MESH, [Partial(ReduceOp.MAX), Replicated()]),
    "R,R": PlacementMapping(MESH, [Replicated(), Replicated()]),
}


@pytest.mark.parametrize("name", list(SHARDINGS))
def test_round_trip(name: str) -> None:
    sharding = SHARDINGS[name]
    t = shardwise.tensor(torch.arange(35.0).reshape(7, 5), sharding=sharding)
    parts = from_tensor(t)
    assert [p.dist_device for p in parts] == list(MESH.devices)
    assert [p.shape for p in parts] == t.local_shapes
    assert all(isinstance(p, Tensor) and p.mesh.is_single for p in parts)
    back = to_tensor(parts, t.sharding, t.shape)
    assert isinstance(back, Tensor) and same(back, t)
    types = from_tensor(t.dist_type)
    assert types == [TensorType(p.dtype, p.shape, p.dist_device) for p in parts]
    assert to_tensor(types, t.sharding, t.shape) == t.dist_type


def test_from_tensor_gives_local_values_and_new_objects() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    t = shardwise.tensor([1.0, 2.0, 3.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    parts = from_tensor(t)
    assert [p.to_torch().tolist() for p in parts] == [[1.0, 2.0], [3.0]]
    assert all(p.shards[0] is not s for p, s in zip(parts, t.shards, strict=True))


def test_to_tensor_derives_an_even_shape() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    xs = [shardwise.tensor([[1.0, 2.0]], device=CPU(i)) for i in range(2)]
    t = to_tensor(xs, PlacementMapping(mesh, [Sharded(1)]))
    assert isinstance(t, Tensor) and t.shape == (1, 4)
    assert t.to_torch().tolist() == [[1.0, 2.0, 1.0, 2.0]]
    types = [TensorType(torch.float32, (1, 2), CPU(i)) for i in range(2)]
    assert to_tensor(types, PlacementMapping(mesh, [Sharded(1)])) == DistributedTensorType(
        torch.float32, (1, 4), mesh, [Sharded(1)])


def test_graph_ops_compose_with_distributed_tensors() -> None:
    """allgather over a Sharded(0) tensor's per-device values = its global value."""
    mesh = DeviceMesh.cpu(3, "x")
    value = torch.arange(14.0).reshape(7, 2)
    t = shardwise.tensor(value, sharding=PlacementMapping(mesh, [Sharded(0)]))
    gathered = ops.allgather(from_tensor(t), Signals(mesh.devices))
    back = to_tensor(gathered, PlacementMapping(mesh, [Replicated()]))
    assert torch.equal(back.to_torch(), value)  # type: ignore[union-attr]
    summed = ops.allreduce.sum(from_tensor(t.dist_type)[1:], Signals(mesh.devices[1:]))
    assert summed == [TensorType(torch.float32, (2, 2), CPU(i)) for i in (1, 2)]


KINDS = ["tensor", "type"]


def parts_of(kind: str, shapes: list[tuple[int, ...]], devices: list[int],
             dtypes: list[torch.dtype] | None = None) -> list[Any]:
    dtypes = dtypes or [torch.float32] * len(shapes)
    if kind == "tensor":
        return [shardwise.tensor(torch.zeros(s, dtype=d), device=CPU(i))
                for s, i, d in zip(shapes, devices, dtypes, strict=True)]
    return [TensorType(d, s, CPU(i)) for s, i, d in zip(shapes, devices, dtypes, strict=True)]


S0 = PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)])


@pytest.mark.parametrize("kind", KINDS)
def test_to_tensor_errors(kind: str) -> None:
    with pytest.raises(ShardingError, match=r"got 3 values for DeviceMesh\(x=2\) with 2 devices"):
        to_tensor(parts_of(kind, [(2,)] * 3, [0, 1, 2]), S0)
    with pytest.raises(ShardingError, match=r"values\[0\] is on CPU\(1\) but mesh device 0 is "
                                            r"CPU\(0\)"):
        to_tensor(parts_of(kind, [(2,)] * 2, [1, 0]), S0)
    with pytest.raises(ShardingError, match=r"holds shape \(1,\)|has shape \(1,\)"):
        to_tensor(parts_of(kind, [(2,), (1,)], [0, 1]), S0)  # uneven needs shape=
    with pytest.raises(ShardingError, match=r"dtype"):
        to_tensor(parts_of(kind, [(2,)] * 2, [0, 1], [torch.float32, torch.int64]), S0)
    with pytest.raises(ShardingError, match="got none"):
        to_tensor([], S0)
    assert to_tensor(parts_of(kind, [(2,), (1,)], [0, 1]), S0, (3,)) is not None


def test_from_tensor_needs_a_tensor() -> None:
    with pytest.raises(ShardingTypeError, match=r"got Tensor|got list"):
        from_tensor([1.0])  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2,), (4,), (2, 2), (3, 1)]), st.integers(0, 9), st.integers(0, 5),
       st.data())
def test_round_trip_property(mesh_shape: tuple[int, ...], rows: int, cols: int,
                             data: Any) -> None:
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh.cpu(mesh_shape, names)
    placements = [data.draw(st.sampled_from([Replicated(), Sharded(0), Sharded(1), Partial()]))
                  for _ in names]
    sharding = PlacementMapping(mesh, placements)
    t = shardwise.tensor(torch.randn(rows, cols, dtype=torch.float64), sharding=sharding)
    back = to_tensor(from_tensor(t), sharding, t.shape)
    assert isinstance(back, Tensor) and same(back, t)
    assert to_tensor(from_tensor(t.dist_type), sharding, t.shape) == t.dist_type
