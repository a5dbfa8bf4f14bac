"""DTensor interop: shardwise layouts <-> DTensor placements, and ``Tensor.to_dtensor``.

Invariants:
- Placements map one to one: ``Sharded(d)`` <-> ``Shard(d)``, ``Replicated()`` <->
  ``Replicate()``, ``Partial(sum|avg|max|min)`` <-> ``Partial("sum"|"avg"|"max"|"min")``
  (PROD has no DTensor form and raises); a dim sharded over several mesh axes (in
  mesh order) is ``Shard(d)`` on each of them, as DTensor nests it.
- Uneven splits differ: shardwise gives the first ``g % n`` pieces one extra row
  (``array_split``), DTensor gives every piece ``ceil(g / n)`` rows until the rows
  run out (``torch.chunk``): 5 rows over 4 are 2,1,1,1 against 2,2,1,0.
  :func:`differing_dims` lists the dims whose per-device blocks differ for some
  device; those dims are gathered on one side and re-cut locally on the other
  (data moves), every other dim is handed over without a copy.
- Only meshes of processes convert (DTensor needs a process group per mesh axis); a
  simulated mesh raises naming the fix. Mesh device ``CPU(i)``/``Accelerator(i)`` is
  process ``i``, as everywhere in the multi-process runtime.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.runtime import backend_for
from shardwise.sharding.errors import ConversionError, ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Partial, Placement, ReduceOp, Replicated, Sharded
from shardwise.sharding.shapes import local_bounds

__all__ = ["differing_dims", "layout_of", "our_placement", "to_dtensor", "torch_mesh",
           "torch_placements"]

_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
_MESHES: dict[tuple[DeviceMesh, int], Any] = {}


def torch_placements(layout: Layout) -> list[Any]:
    """DTensor's placements for ``layout``, one per mesh axis.

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> torch_placements(Layout(mesh, ((1,), ()), (ReduceOp.AVG, None)))
    [Partial(avg), Shard(dim=0)]
    """
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for p in layout.to_placements():
        if isinstance(p, Sharded):
            out.append(Shard(p.axis))
        elif isinstance(p, Partial):
            op = _OPS.get(p.reduce_op)
            if op is None:
                raise ConversionError(
                    f"{layout} has Partial({p.reduce_op.value}), which DTensor cannot hold "
                    "(it has sum, avg, max, min). Reduce it first: shardwise.all_reduce(x)."
                )
            out.append(TPartial(op))
        else:
            out.append(Replicate())
    return out


def our_placement(p: Any) -> Placement:
    """shardwise's placement for DTensor placement ``p``.

    >>> from torch.distributed.tensor import Shard
    >>> our_placement(Shard(1))
    Sharded(axis=1)
    """
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate, Shard

    if type(p) is Shard:
        return Sharded(p.dim)
    if isinstance(p, Replicate):
        return Replicated()
    if isinstance(p, TPartial) and p.reduce_op in _OPS.values():
        return Partial({v: k for k, v in _OPS.items()}[p.reduce_op])
    raise ConversionError(
        f"Placement {p!r} has no shardwise form (shardwise has Sharded/Shard, "
        "Replicated/Replicate and Partial(sum/avg/max/min)). Use one of those (a DTensor's: "
        "redistribute it to those first)."
    )


def layout_of(mesh: DeviceMesh, placements: Any, ndim: int) -> Layout:
    """The shardwise layout of DTensor ``placements`` on ``mesh``."""
    return Layout.from_placements(mesh, tuple(our_placement(p) for p in placements), ndim)


def differing_dims(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tensor dims whose block bounds differ between shardwise's split rule and
    DTensor's (torch.chunk) for some device: those cannot be handed over as they are.

    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> differing_dims(Layout(mesh, ((0,), ()), (None,)), (5, 3))   # 2,1,1,1 vs 2,2,1,0
    (0,)
    >>> differing_dims(Layout(mesh, ((0,), ()), (None,)), (8, 3))
    ()
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = layout.mesh
    placements = torch_placements(layout.without_partial())
    bad: set[int] = set()
    for k in range(mesh.num_devices):
        coord = mesh.coord_of(k)
        ours = local_bounds(shape, layout, coord)
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh.mesh_shape, list(coord), placements)
        for d, (a, b) in enumerate(ours):
            # an empty block has no place: only its size must agree
            if b - a != sizes[d] or (b > a and a != offsets[d]):
                bad.add(d)
    return tuple(sorted(bad))


def _replicate_dims(layout: Layout, dims: tuple[int, ...]) -> Layout:
    return layout.with_dims(tuple(() if d in dims else axes
                                  for d, axes in enumerate(layout.dims)))


def _process_mesh(mesh: DeviceMesh, what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or len(
            backend_for(mesh).owned(mesh)) > 1:
        raise ShardingError(
            f"{what} needs a mesh of processes (one per device), but {mesh!r} is simulated "
            "in this process, and DTensor needs a process group per mesh axis. Run under "
            "torchrun with shardwise.distributed.initialize(); on a simulated mesh use "
            "x.to_torch() and torch.distributed.tensor.distribute_tensor instead."
        )


def torch_mesh(mesh: DeviceMesh) -> Any:
    """torch's DeviceMesh over the same processes (created once per mesh and world;
    every process must call this in the same order, as for any process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    _process_mesh(mesh, "A torch DeviceMesh")
    key = (mesh, id(dist.group.WORLD))
    hit = _MESHES.get(key)
    if hit is None:
        kind = mesh.devices[0].kind
        device_type = "cpu" if kind == "cpu" else backend_for(mesh).device_of(mesh, 0).type
        ranks = torch.tensor([d.id for d in mesh.devices]).reshape(mesh.mesh_shape)
        hit = _MESHES[key] = TorchMesh(device_type, ranks, mesh_dim_names=mesh.axis_names)
    return hit


def to_dtensor(x: Any) -> Any:
    """The DTensor of shardwise Tensor ``x`` (same global value, same placements):
    its local tensor is this process's block itself where the split conventions agree;
    dims they split differently are gathered, then cut by DTensor locally."""
    from torch.distributed.tensor import DTensor

    layout: Layout = x.dist_layout
    _process_mesh(layout.mesh, "to_dtensor()")
    shape = tuple(x.shape)
    bad = differing_dims(layout, shape)
    handed = x.relayout(_replicate_dims(layout, bad)) if bad else x
    mesh = torch_mesh(layout.mesh)
    local = next(iter(handed.addressable_shards.values()), None)
    if local is None:  # this process is outside the mesh: DTensor holds an empty local
        local = torch.empty(0, dtype=x.dtype)
    stride = torch.empty(shape, device="meta").stride()
    out = DTensor.from_local(local, mesh, torch_placements(handed.dist_layout),
                             run_check=False, shape=torch.Size(shape), stride=stride)
    return out.redistribute(mesh, torch_placements(layout)) if bad else out
