"""rehome: a Tensor's value and layout on another mesh of the same shape (a pipeline
stage's activation arriving on the next stage's (dp, tp) submesh)."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded, ShardingError
from shardwise.tensors.tensor import rehome

MESH = DeviceMesh.cpu((2, 2, 2), ("pp", "dp", "tp"))
A, B = MESH.submesh(pp=0), MESH.submesh(pp=1)


@pytest.mark.parametrize("placements", [(Sharded(0), Sharded(1)), (Replicated(), Sharded(0)),
                                        (Sharded(1), Replicated())])
def test_same_layout_same_value(placements: tuple) -> None:
    x = torch.arange(24.0).reshape(4, 6)
    t = sw.tensor(x, sharding=PlacementMapping(A, placements)) * 1.0
    y = rehome(t, B)
    assert y.mesh == B and y.placements == t.placements and y.shape == t.shape
    assert y.dtype == t.dtype and torch.equal(y.to_torch(), x)
    for k in range(B.num_devices):  # device k of B holds device k of A's block
        assert torch.equal(y.local(B.devices[k]), t.local(A.devices[k]))


def test_partial_blocks_and_grad_cut() -> None:
    blocks = [torch.full((2,), float(k)) for k in range(4)]
    t = sw.from_local(blocks, PlacementMapping(A, (Partial(), Replicated())), shape=(2,))
    y = rehome(t, B)
    assert y.placements == (Partial(), Replicated())
    assert torch.equal(y.to_torch(), t.to_torch())
    w = sw.tensor(torch.ones(4), sharding=PlacementMapping(A, (Sharded(0), Replicated())),
                  requires_grad=True)
    z = rehome(w * 2, B)
    assert not z.requires_grad and z.is_leaf  # cut from the sender's graph


def test_other_shape_is_refused() -> None:
    t = sw.tensor(torch.ones(4), sharding=PlacementMapping(A, (Sharded(0), Replicated())))
    with pytest.raises(ShardingError, match="same shape"):
        rehome(t, DeviceMesh.cpu(4, "dp"))
