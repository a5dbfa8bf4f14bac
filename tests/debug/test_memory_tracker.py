"""MemoryTracker's default state ("every live value") on edge cases: values that only a
later garbage-collector pass frees, and a step that holds nothing on a mesh."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from shardwise.debug import MemoryTracker
from shardwise.parallel import fully_shard
from shardwise.sharding.mesh import DeviceMesh


class _Box:
    pass


def test_default_state_skips_values_freed_by_a_later_gc_pass() -> None:
    mesh = DeviceMesh.cpu(2, "dp")
    dead = fully_shard(nn.Linear(8, 8, bias=False), mesh)
    # a cycle held only by autograd's graph (C++), itself held by another dead cycle: the
    # first pass frees the graph, and only then is the model's cycle garbage
    dead.weight.owner = dead  # type: ignore[attr-defined]
    box = _Box()
    box.me = box  # type: ignore[attr-defined]
    box.out = dead(torch.ones(2, 8)).sum()  # type: ignore[attr-defined]
    gone = weakref.ref(dead)
    del dead, box
    with MemoryTracker():
        pass
    # the tracker's own collection freed it, so it is not counted (the peak itself
    # depends on what else the process keeps alive)
    assert gone() is None


def test_nothing_held_on_a_mesh_is_a_zero_peak() -> None:
    with MemoryTracker(state=[]) as mt:
        torch.ones(3) + 1
    assert mt.peak == 0 and mt.device is None and mt.per_device == {}
    assert mt.final == {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}
    assert "peak 0 B" in repr(mt)
