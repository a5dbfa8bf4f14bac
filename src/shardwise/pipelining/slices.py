"""A model planned on the whole mesh, its values restricted to each stage's slice.

``parallelize_module(model, mesh, plan)`` before ``pipeline(model, mesh, ...)`` (the
natural order) leaves parameters on the whole mesh, Replicated over the pipeline
axis. ``pipeline()`` then restricts each stage's parameters and buffers to the
stage's slice (``mesh.submesh(pp=rank)``): the same value, the same layout on the
other axes, the blocks of the slice's devices; the plan's hooks follow (they lay
values out where the module's parameters live). Either order gives the same stages.

Invariants:
- Only a value Replicated over the pipeline axis restricts (every stage holds it
  whole); one sharded or Partial over it, and a ``fully_shard`` unit built on the
  whole mesh, raise naming the fix: parallelize ``pipe.local_stages`` after
  ``pipeline()``.
- A parameter shared by several modules of a stage stays one parameter.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from shardwise.parallel.fsdp_unit import UNIT
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.tensor import Tensor, place

__all__ = ["restrict", "restrict_stage"]

FIX = ("Parallelize the stages after pipeline(), each on its slice: pipe = pipeline(model, "
       "mesh, ...); for stage in pipe.local_stages: parallelize_module(stage.module, "
       "stage.mesh, plan); fully_shard(stage.module, stage.mesh).")


def restrict(x: Tensor, part: DeviceMesh, axis: str, what: str) -> Tensor:
    """``x`` (on a mesh ``part`` is a slice of, Replicated over ``axis``) on ``part``:
    its value and its layout on the other axes, detached.

    >>> mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    >>> w = place(torch.arange(4.), Layout(mesh, ((1,),), (None, None)))
    >>> y = restrict(w, mesh.submesh(pp=1), "pp", "w")
    >>> y.mesh, y.placements, y.to_torch().tolist()
    (DeviceMesh(tp=2; devices 2..3), (Sharded(axis=0),), [0.0, 1.0, 2.0, 3.0])
    """
    mesh, layout = x.mesh, x.dist_layout
    if axis not in mesh.axis_names or not set(part.devices) <= set(mesh.devices) or \
            any(n not in mesh.axis_names for n in part.axis_names):
        raise ShardingError(
            f"pipeline(): {what} lives on {mesh!r}, neither the pipeline's mesh nor the "
            f"stage's slice {part!r}. {FIX}")
    a = mesh.axis_names.index(axis)
    if a in layout.sharded_axes or layout.partial[a] is not None:
        raise ShardingError(
            f"pipeline(): {what} is {layout}, split over the pipeline axis {axis!r}; a "
            f"stage holds a value whole, so only a value Replicated over {axis!r} moves "
            f"onto a stage's slice ({part!r}). {FIX}")
    to_part = {mesh.axis_names.index(n): i for i, n in enumerate(part.axis_names)}
    dims = tuple(tuple(to_part[ax] for ax in axes) for axes in layout.dims)
    partial = tuple(layout.partial[mesh.axis_names.index(n)] for n in part.axis_names)
    target = Layout(part, dims, partial)
    whole = x.held.whole_of(layout, tuple(x.shape), x.dtype.itemsize, copy=False)
    if whole is not None:
        return place(whole.detach(), target)
    shards = x.shards
    blocks = [shards[mesh.device_index(d)] for d in part.devices]
    return Tensor([None if b is None else b.detach() for b in blocks], target,
                  tuple(x.shape), x.dtype)


def restrict_stage(module: nn.Module, part: DeviceMesh, axis: str, index: int) -> None:
    """Restrict the parameters and buffers of stage ``index``'s ``module`` that live on
    another mesh to ``part`` (in place); see the module doc."""
    done: dict[int, Any] = {}
    for name, mod in module.named_modules():
        values = [("parameter", k, v) for k, v in mod._parameters.items()] + \
            [("buffer", k, v) for k, v in mod._buffers.items()]
        for kind, key, value in values:
            if not isinstance(value, Tensor) or value.mesh == part:
                continue
            where = f"stage {index}'s {kind} {(name + '.' if name else '') + key!r}"
            if getattr(mod, UNIT, None) is not None or (
                    kind == "parameter" and _in_unit(module, name)):
                raise ShardingError(
                    f"pipeline(): {where} belongs to a fully_shard unit built on "
                    f"{value.mesh!r}, the whole mesh; stage {index} runs on {part!r}. {FIX}")
            if id(value) not in done:
                new = restrict(value, part, axis, where)
                done[id(value)] = (nn.Parameter(new, requires_grad=value.requires_grad)
                                   if kind == "parameter" else new)
            if kind == "parameter":
                mod._parameters[key] = done[id(value)]
            else:
                mod._buffers[key] = done[id(value)]


def _in_unit(root: nn.Module, name: str) -> bool:
    """Whether a module on the path to ``name`` (``root`` included) is a fully_shard unit."""
    mod, parts = root, name.split(".") if name else []
    if getattr(mod, UNIT, None) is not None:
        return True
    for part in parts:
        mod = getattr(mod, part)
        if getattr(mod, UNIT, None) is not None:
            return True
    return False
