"""The executor's cached backend follows torch's process world (runtime/world.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated
from shardwise.ops import execute
from shardwise.runtime import backend_for, world_started
from shardwise.runtime.world import C10D
from shardwise.tensors.keys import decision_key


def test_the_cached_backend_follows_the_process_world() -> None:
    mesh = DeviceMesh.cpu(1, "x")
    x = sw.tensor(torch.arange(3.0), sharding=PlacementMapping(mesh, (Replicated(),)))
    key = decision_key("neg", False, (), (x,))
    assert C10D._default_pg is None and not world_started()
    simulated = backend_for(mesh)
    assert torch.equal((-x).to_torch(), -torch.arange(3.0))
    assert execute._DECISIONS[key].backend is simulated
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert C10D._default_pg is dist.group.WORLD and world_started()
        process = backend_for(mesh)
        assert process is not simulated
        # the same decision, now run by the process backend: asked again, not stale
        assert torch.equal((-x).to_torch(), -torch.arange(3.0))
        assert execute._DECISIONS[key].backend is process
    finally:
        dist.destroy_process_group()
    assert C10D._default_pg is None and backend_for(mesh) is simulated
    assert torch.equal((-x).to_torch(), -torch.arange(3.0))
    assert execute._DECISIONS[key].backend is simulated
