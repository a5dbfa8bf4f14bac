"""Abstract evaluation: the graph ops on TensorTypes, and ``shardwise.eval_shape``
over graph ops and over the communication ops on DistributedTensorTypes."""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise
from shardwise import eval_shape
from shardwise.graph import Signals, from_tensor, ops, to_tensor
from shardwise.sharding import (
    BufferType,
    DeviceMesh,
    DistributedTensorType,
    Partial,
    PlacementMapping,
    Replicated,
    Sharded,
    ShardingError,
    TensorType,
)
from shardwise.sharding.devices import CPU
from tests.helpers.meshes import M22 as MESH

HUGE = (2**20, 2**16)  # float32: 256 GiB
S2 = Signals([CPU(0), CPU(1)])


def tt(shape: tuple[int, ...], i: int, dtype: Any = torch.float32) -> TensorType:
    return TensorType(dtype, shape, CPU(i))


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- graph ops on types ----------------------------------------------------------------
def test_graph_ops_on_huge_types_return_types() -> None:
    xs = [tt(HUGE, 0), tt(HUGE, 1)]
    assert ops.allgather(xs, S2) == [tt((2**21, 2**16), 0), tt((2**21, 2**16), 1)]
    assert ops.allgather(xs, S2, axis=1) == [tt((2**20, 2**17), 0), tt((2**20, 2**17), 1)]
    assert ops.allreduce.sum(xs, S2) == xs
    assert ops.reducescatter.sum(xs, S2) == [tt((2**19, 2**16), 0), tt((2**19, 2**16), 1)]
    assert ops.distributed_broadcast(xs[1], S2) == xs
    assert ops.transfer_to(xs[0], CPU(7)) == tt(HUGE, 7)
    assert ops.shard_and_stack([xs[0]] * 3, [CPU(2), CPU(3)], axis=-1) == [
        tt((3, 2**20, 2**15), 2), tt((3, 2**20, 2**15), 3)]


def test_types_keep_their_dtype_form() -> None:
    xs = [tt((3,), 0, "float32"), tt((2,), 1, "float32")]
    assert ops.allgather(xs, S2) == [tt((5,), 0, "float32"), tt((5,), 1, "float32")]
    # torch.float32 and "float32" are the same dtype for the checks.
    assert ops.allreduce.sum([tt((2,), 0, "float32"), tt((2,), 1)], S2)[0].shape == (2,)


def test_uneven_reducescatter_types() -> None:
    signals = Signals([CPU(i) for i in range(4)])
    xs = [tt((2, 5), i) for i in range(4)]
    assert [t.shape for t in ops.reducescatter.sum(xs, signals, axis=1)] == [
        (2, 2), (2, 1), (2, 1), (2, 1)]
    assert [t.shape for t in ops.reducescatter.sum(xs, signals, axis=0)] == [
        (1, 5), (1, 5), (0, 5), (0, 5)]


def test_buffer_types_are_not_values() -> None:
    buf = BufferType(torch.uint8, (64,), CPU(0))
    with pytest.raises(ShardingError, match="must be a single-device"):
        ops.transfer_to(buf, CPU(1))


# --- eval_shape over graph ops ---------------------------------------------------------------
def test_eval_shape_of_graph_ops() -> None:
    def step(a: Any, b: Any) -> dict[str, Any]:
        gathered = ops.allgather([a, b], S2)
        summed = ops.allreduce.sum(gathered, S2)
        return {"gathered": gathered, "moved": ops.transfer_to(summed[0], CPU(4))}

    out = eval_shape(step, tt((2, 3), 0), tt((1, 3), 1))
    assert out == {"gathered": [tt((3, 3), 0), tt((3, 3), 1)], "moved": tt((3, 3), 4)}


def test_eval_shape_matches_a_real_run_for_graph_ops() -> None:
    a = shardwise.tensor(torch.ones(2, 3), device=CPU(0))
    b = shardwise.tensor(torch.ones(1, 3), device=CPU(1))

    def step(a: Any, b: Any) -> tuple[Any, ...]:
        return (ops.reducescatter.sum(ops.allgather([a, b], S2), S2, axis=0),
                ops.shard_and_stack([a, a], [CPU(0), CPU(1), CPU(2)], axis=1))

    real = step(a, b)
    want = tuple([TensorType(o.dtype, o.shape, o.dist_device) for o in part] for part in real)
    assert eval_shape(step, TensorType(torch.float32, (2, 3), CPU(0)),
                      TensorType(torch.float32, (1, 3), CPU(1))) == want


def test_eval_shape_raises_what_the_op_raises() -> None:
    with pytest.raises(ShardingError, match=r"inputs\[1\] has dtype int64"):
        eval_shape(lambda a, b: ops.allgather([a, b], S2), tt((2,), 0), tt((2,), 1, torch.int64))


def test_eval_shape_rejects_unknown_dtypes() -> None:
    with pytest.raises(ShardingError, match="'float99', which is not a torch dtype"):
        eval_shape(lambda a: a, tt((2,), 0, "float99"))


def test_eval_shape_passes_other_values_through() -> None:
    assert eval_shape(lambda a, k, *, s: (a, k, s), tt((2,), 0), 3, s="x") == (tt((2,), 0), 3,
                                                                               "x")


# --- eval_shape over communication ops on distributed types -------------------------------
def test_eval_shape_of_all_gather_and_reduce_scatter_on_256_gib() -> None:
    mesh = DeviceMesh.cpu(4, "x")
    sharded = DistributedTensorType(torch.float32, HUGE, mesh, [Sharded(0)])
    partial = DistributedTensorType(torch.float32, HUGE, mesh, [Partial()])
    before = max_rss_bytes()
    gathered = eval_shape(shardwise.all_gather, sharded, 0)
    scattered = eval_shape(lambda t: shardwise.reduce_scatter(t, 1), partial)
    assert max_rss_bytes() - before < 2**30  # nothing near 256 GiB (or 64 GiB per shard)
    assert gathered == DistributedTensorType(torch.float32, HUGE, mesh, [Replicated()])
    assert scattered == DistributedTensorType(torch.float32, HUGE, mesh, [Sharded(1)])
    assert [t.shape for t in scattered.local_types] == [(2**20, 2**14)] * 4


OTHER = DeviceMesh.cpu(3, "z")
COMM: dict[str, tuple[list[Any], Callable[[Any], Any]]] = {
    "all_gather": ([Sharded(0), Sharded(1)], lambda t: shardwise.all_gather(t, 1)),
    "all_reduce": ([Partial(), Replicated()], lambda t: shardwise.all_reduce(t)),
    "all_reduce_replicated": ([Replicated(), Sharded(0)],
                              lambda t: shardwise.all_reduce(t, reduce_axes="dp")),
    "reduce_scatter": ([Partial(), Sharded(0)], lambda t: shardwise.reduce_scatter(t, 1)),
    "all_to_all": ([Sharded(0), Replicated()], lambda t: shardwise.all_to_all(t, 1, 0)),
    "shard": ([Sharded(0), Replicated()], lambda t: shardwise.shard(t, MESH, ["tp", "dp"])),
    "shard_other_mesh": ([Sharded(0), Partial()],
                         lambda t: shardwise.shard(t, OTHER, [None, "z"])),
    "ppermute": ([Sharded(0), Sharded(1)],
                 lambda t: shardwise.ppermute(t, [(0, 3), (3, 0), (1, 2)])),
    "ppermute_axis": ([Sharded(0), Replicated()],
                      lambda t: shardwise.ppermute(t, [(0, 1), (1, 0)], axis_name="dp")),
    "distributed_broadcast": ([Sharded(0), Replicated()],
                              lambda t: shardwise.distributed_broadcast(t, MESH)),
    "distributed_broadcast_other": ([Sharded(1), Partial()],
                                    lambda t: shardwise.distributed_broadcast(t, OTHER)),
    "to_device": ([Sharded(0), Sharded(1)], lambda t: shardwise.to_device(t, CPU(9))),
    "graph_roundtrip": ([Sharded(0), Sharded(1)],
                        lambda t: to_tensor(from_tensor(t), t.sharding, t.shape)),
}


@pytest.mark.parametrize("name", list(COMM))
def test_eval_shape_of_each_comm_op_matches_a_real_run(name: str) -> None:
    placements, fn = COMM[name]
    rows = 4 if name.startswith("ppermute") else 5  # ppermute needs even shards
    real_in = shardwise.tensor(torch.arange(rows * 6.0).reshape(rows, 6),
                               sharding=PlacementMapping(MESH, placements))
    real = fn(real_in)
    want = (TensorType(real.dtype, real.shape, real.mesh.devices[0]) if name == "to_device"
            else real.dist_type)
    assert eval_shape(fn, real_in.dist_type) == want


def test_eval_shape_of_comm_ops_on_huge_types_does_not_allocate() -> None:
    before = max_rss_bytes()
    for name, (placements, fn) in COMM.items():
        t = DistributedTensorType(torch.float32, HUGE, MESH, placements)
        out = eval_shape(fn, t)
        assert out.shape == HUGE, name
    assert max_rss_bytes() - before < 2**30


def test_eval_shape_of_a_mixed_program() -> None:
    """Distributed type in, per-device graph ops in the middle, types out."""
    mesh = DeviceMesh.cpu(2, "x")

    def program(t: Any) -> Any:
        parts = from_tensor(t)
        return ops.allreduce.sum(parts, Signals(mesh.devices))

    t = DistributedTensorType(torch.float32, HUGE, mesh, [Sharded(1)])
    assert eval_shape(program, t) == [TensorType(torch.float32, (2**20, 2**15), CPU(i))
                                      for i in range(2)]


def test_eval_shape_maps_torch_results_to_types() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    t = DistributedTensorType(torch.float64, (4, 2), mesh, [Sharded(0)])
    assert eval_shape(lambda x: x.to_torch(), t) == TensorType(torch.float64, (4, 2), CPU(0))
