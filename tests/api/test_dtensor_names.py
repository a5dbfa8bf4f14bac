"""DTensor's names on a shardwise Tensor (``device_mesh``, ``full_tensor``,
``to_local``, ``redistribute``) against plain torch and shardwise's own operations."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate, Shard

import shardwise as sw
from shardwise.sharding.errors import ConversionError, ShardingError
from shardwise.sharding.mappings import PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Partial, Replicated, Sharded

MESH = DeviceMesh.cpu((2, 2), ("dp", "tp"))
VALUE = torch.arange(35.).reshape(5, 7)  # uneven over both axes

TARGETS = [
    ([Shard(0), Shard(1)], [Sharded(0), Sharded(1)]),
    ([Replicate(), Shard(0)], [Replicated(), Sharded(0)]),
    ([Shard(1), Replicate()], [Sharded(1), Replicated()]),
    ([Replicate(), Replicate()], [Replicated(), Replicated()]),
    ([Shard(0), Sharded(1)], [Sharded(0), Sharded(1)]),  # mixed spellings
]


@pytest.mark.parametrize(("given", "ours"), TARGETS)
def test_redistribute_is_shard(given: list[object], ours: list[object]) -> None:
    x = sw.tensor(VALUE, sharding=PlacementMapping(MESH, [Sharded(1), Sharded(0)]))
    y = x.redistribute(x.device_mesh, given)
    want = sw.shard(x, dim_specs=PlacementMapping(MESH, ours))
    assert y.dist_layout == want.dist_layout
    assert torch.equal(y.full_tensor(), VALUE)
    assert torch.equal(x.to_torch(), VALUE)  # the input is untouched


def test_redistribute_partial_reduces_like_torch() -> None:
    parts = [torch.full((2, 3), float(k)) for k in range(4)]
    x = sw.from_local(parts, PlacementMapping(MESH, [Partial(), Partial()]), (2, 3))
    assert torch.equal(x.full_tensor(), sum(parts))
    y = x.redistribute(MESH, [Replicate(), Shard(0)])
    assert y.placements == (Replicated(), Sharded(0))
    assert torch.equal(y.full_tensor(), sum(parts))
    z = sw.tensor(VALUE, sharding=PlacementMapping(MESH, [Replicated(), Replicated()]))
    kept = z.redistribute(MESH, [TPartial(), Replicate()])
    assert kept.placements[0] == Partial()
    assert torch.equal(kept.full_tensor(), VALUE)


def test_gradients_through_redistribute_and_full_tensor_equal_torch() -> None:
    w = torch.randn(5, 7)
    ref = VALUE.clone().requires_grad_()
    (ref * w).sum().backward()
    x = sw.tensor(VALUE, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]),
                  requires_grad=True)
    (x.redistribute(MESH, [Replicate(), Shard(1)]).full_tensor() * w).sum().backward()
    assert x.grad is not None
    assert x.grad.dist_layout == x.dist_layout
    assert torch.equal(x.grad.full_tensor(), ref.grad)


def test_to_local_on_a_simulated_mesh_names_the_blocks() -> None:
    x = sw.tensor(VALUE, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]))
    with pytest.raises(ShardingError, match=r"holds 4 of the 4 devices.*x\.local\(device\)"):
        x.to_local()


def test_to_local_of_a_one_device_mesh_is_its_block() -> None:
    one = DeviceMesh.cpu(1, "x")
    x = sw.tensor(VALUE, sharding=PlacementMapping(one, [Sharded(0)]), requires_grad=True)
    local = x.to_local()
    assert torch.equal(local, VALUE)
    (local * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad.full_tensor(), torch.full((5, 7), 3.))


def test_redistribute_bad_inputs_name_the_fix() -> None:
    x = sw.tensor(VALUE, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]))
    with pytest.raises(ShardingError, match=r"keeps the mesh.*to_device"):
        x.redistribute(DeviceMesh.cpu(4, "x"), [Replicate()])
    with pytest.raises(ShardingError, match="needs placements"):
        x.redistribute(MESH)
    with pytest.raises(ShardingError, match="2 axes; give one placement per axis"):
        x.redistribute(MESH, [Replicate()])
    with pytest.raises(ConversionError, match="has no shardwise form"):
        x.redistribute(MESH, ["S(0)", Replicate()])
    with pytest.raises(ShardingError, match="out of range for a tensor of rank 2"):
        x.redistribute(MESH, [Shard(2), Replicate()])  # a dim the value lacks
