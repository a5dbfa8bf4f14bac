"""DTensor interop without processes: the placement mapping, where the uneven-split
conventions differ, and the error on a simulated mesh (the conversions themselves run
on Gloo in test_gloo.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate, Shard

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, ReduceOp, Replicated, Sharded
from shardwise.sharding.layout import Layout
from shardwise.tensors.dtensor import differing_dims, layout_of, torch_placements
from tests.helpers.meshes import M4, M22


@pytest.mark.parametrize("ours, theirs", [
    ([Sharded(0), Replicated()], [Shard(0), Replicate()]),
    ([Replicated(), Sharded(1)], [Replicate(), Shard(1)]),
    ([Sharded(1), Sharded(1)], [Shard(1), Shard(1)]),
    ([Partial(ReduceOp.SUM), Sharded(0)], [TPartial("sum"), Shard(0)]),
    ([Partial(ReduceOp.AVG), Replicated()], [TPartial("avg"), Replicate()]),
    ([Replicated(), Partial(ReduceOp.MAX)], [Replicate(), TPartial("max")]),
    ([Partial(ReduceOp.MIN), Partial(ReduceOp.MIN)], [TPartial("min"), TPartial("min")]),
])
def test_placements_map_both_ways(ours: list, theirs: list) -> None:
    layout = Layout.from_placements(M22, tuple(ours), 2)
    assert torch_placements(layout) == theirs
    assert layout_of(M22, theirs, 2) == layout


def test_prod_and_strided_shards_have_no_counterpart() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(sw.ConversionError, match=r"Partial\(prod\).*all_reduce"):
        torch_placements(Layout.from_placements(M22, (Partial(ReduceOp.PROD), Replicated()), 1))
    with pytest.raises(sw.ConversionError, match="no shardwise form"):
        layout_of(M22, [_StridedShard(0, split_factor=2), Replicate()], 1)


@pytest.mark.parametrize("mesh, shape, placements, bad", [
    (M22, (8, 6), [Sharded(0), Sharded(1)], ()),
    (M22, (5, 6), [Sharded(0), Replicated()], ()),    # 3,2 both ways
    (M22, (7, 5), [Sharded(0), Sharded(0)], ()),      # 2,2,2,1 both ways
    (M22, (10, 3), [Sharded(0), Sharded(0)], (0,)),   # ours 3,3,2,2; nested chunks 3,2,3,2
    (M4, (5, 3), [Sharded(0)], (0,)),                 # ours 2,1,1,1; torch.chunk 2,2,1,0
    (M4, (6, 6), [Sharded(1)], (1,)),                 # 2,2,1,1 against 2,2,2,0
    (M4, (3, 2), [Sharded(0)], ()),                   # 1,1,1,0 both ways
    (M4, (0, 4), [Sharded(0)], ()),
])
def test_differing_dims_follow_the_two_split_rules(mesh: DeviceMesh, shape: tuple,
                                                   placements: list, bad: tuple) -> None:
    layout = Layout.from_placements(mesh, tuple(placements), len(shape))
    assert differing_dims(layout, shape) == bad


def test_simulated_mesh_names_the_fix() -> None:
    x = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(M22, [Sharded(0), Replicated()]))
    with pytest.raises(sw.ShardingError, match=r"needs a mesh of processes.*torchrun"):
        x.to_dtensor()
    with pytest.raises(sw.ShardingError, match=r"takes a torch\.distributed\.tensor\.DTensor"):
        sw.from_dtensor(torch.ones(2))
