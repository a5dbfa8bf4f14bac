"""DTensor -> shardwise Tensor (``shardwise.from_dtensor``) and the function form of
``Tensor.to_dtensor()``.

Invariants:
- The global value, dtype and placements are kept (``Shard``/``Replicate``/
  ``Partial(sum|avg|max|min)``); the shardwise mesh has the same processes (rank
  ``r`` is device ``CPU(r)`` or ``Accelerator(r)``) and axis names.
- Zero copy where DTensor's uneven split (torch.chunk) and shardwise's agree: the
  local tensor becomes this process's block. Dims they split differently are
  gathered by DTensor and cut by shardwise locally (see ``shardwise.tensors.dtensor``).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.api.creation import from_local
from shardwise.sharding.devices import CPU, Accelerator
from shardwise.sharding.errors import ShardingTypeError
from shardwise.sharding.mappings import PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.dtensor import differing_dims, layout_of
from shardwise.tensors.tensor import Tensor

__all__ = ["from_dtensor", "to_dtensor"]


def to_dtensor(x: Tensor) -> Any:
    """``x.to_dtensor()``: the DTensor of ``x`` on the same processes (process meshes
    only; a simulated mesh raises naming the fix)."""
    return x.to_dtensor()


def from_dtensor(dt: Any) -> Tensor:
    """The shardwise Tensor of DTensor ``dt`` (same processes, value and placements).

    Under torchrun with 2 processes::

        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
        dt = torch.distributed.tensor.distribute_tensor(torch.arange(6.), mesh, [Shard(0)])
        t = shardwise.from_dtensor(dt)        # Sharded(0) over DeviceMesh(x=2), no copy
        assert torch.equal(t.to_torch(), dt.full_tensor())
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(dt, DTensor):
        raise ShardingTypeError(
            f"from_dtensor takes a torch.distributed.tensor.DTensor; got "
            f"{type(dt).__name__}. For a plain tensor use shardwise.tensor(x, sharding=...)."
        )
    tmesh = dt.device_mesh
    names = tmesh.mesh_dim_names or tuple(f"dim{i}" for i in range(tmesh.ndim))
    kind = CPU if tmesh.device_type == "cpu" else Accelerator
    ranks = tmesh.mesh.flatten().tolist()
    mesh = DeviceMesh(tuple(kind(r) for r in ranks), tuple(tmesh.shape), tuple(names))
    shape = tuple(dt.shape)
    layout = layout_of(mesh, dt.placements, dt.ndim)
    bad = differing_dims(layout, shape)
    if bad:  # DTensor gathers the dims it splits differently; we cut them below
        handed = [Replicate() if getattr(p, "dim", None) in bad and p.is_shard() else p
                  for p in dt.placements]
        dt = dt.redistribute(tmesh, handed)
    mine = layout_of(mesh, dt.placements, dt.ndim)
    me = torch.distributed.get_rank()
    shards = [dt.to_local() if r == me else None for r in ranks]
    t = from_local(shards, PlacementMapping(mesh, mine.to_placements()), shape)
    return t.relayout(layout) if bad else t

