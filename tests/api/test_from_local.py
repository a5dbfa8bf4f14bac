"""from_local shares the caller's local tensors (documented) and never writes to them."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import M22 as MESH


def test_from_local_shares_the_given_tensors() -> None:
    locals_ = [torch.full((2, 3), float(k)) for k in range(4)]
    t = sw.from_local(locals_, PlacementMapping(MESH, [Sharded(0), Sharded(1)]),
                      shape=(4, 6))
    for k, s in enumerate(t.shards):
        assert s is not None and s.data_ptr() == locals_[k].data_ptr(), k
    before = t.to_torch().clone()
    locals_[3].fill_(9.0)  # the documented consequence of sharing
    assert not torch.equal(t.to_torch(), before)
    assert torch.equal(t.to_torch()[2:, 3:], torch.full((2, 3), 9.0))


def test_ops_never_write_to_from_local_tensors() -> None:
    locals_ = [torch.arange(6.0).reshape(2, 3) * (k + 1) for k in range(4)]
    keep = [s.clone() for s in locals_]
    leaves = [s.clone().requires_grad_(True) for s in locals_]
    for given in (locals_, leaves):
        p = sw.from_local(given, PlacementMapping(MESH, [Partial(), Sharded(0)]), shape=(4, 3))
        r = sw.all_reduce(p)
        s = sw.shard(r, dim_specs=PlacementMapping(MESH, [Replicated(), Sharded(1)]))
        loss = ((s * 2 + 1) ** 2).sum()
        loss.backward() if given is leaves else None
        sw.reduce_scatter(p, 1)
        sw.all_gather(sw.all_to_all(sw.shard(p, dim_specs=PlacementMapping(
            MESH, [Sharded(0), Sharded(1)])), 0, 1))
    for s, k in zip(locals_, keep):
        assert torch.equal(s, k)
    for s, k in zip(leaves, keep):
        assert torch.equal(s.detach(), k)
        assert s.grad is not None  # the gradient reached the caller's leaves
