"""Placing module inputs, outputs and parameters on one mesh axis (the styles' tools).

Invariants:
- A layout is changed on the plan's mesh axis only: every other mesh axis keeps
  what the value has (a batch Sharded over ``dp`` stays so through a tp plan).
- A plain ``torch.Tensor`` given to a planned module is the *global* value (every
  process holds it, as everywhere in shardwise): it is placed, never assumed to be
  a local shard, so placing it costs no communication.
- A shardwise Tensor is laid out by the planner (differentiable, counted by
  ``CommCounter``); one already in the wanted layout is returned as it is. One that
  holds its whole value (a mesh this process holds wholly) keeps it: the layout
  change is metadata there, its collectives counted as if they ran, so the module's
  ops run once on the whole value rather than block by block.
- Parameters become ``nn.Parameter`` over shardwise Tensors with the same value
  and ``requires_grad``; every process must hold the same initial value (seed
  every rank alike), as for ``shardwise.tensor``. A process keeps its own blocks
  (contiguous copies), not the global value they were cut from.
- A module planned on a mesh whose parameters were moved onto a slice of it (a
  pipeline stage's, by ``pipeline()``) lays values out on that slice (:func:`home_of`):
  the plan's axis is found there by name (:func:`slice_axis`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from shardwise.runtime import holds_whole
from shardwise.runtime.position import issuing
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Partial, Placement, Replicated, Sharded
from shardwise.tensors.tensor import Tensor, place

__all__ = ["axis_of", "check_placement", "home_of", "keeping_ties", "layout_on", "place_on",
           "relayout", "shard_parameter", "slice_axis"]


def axis_of(mesh: Any, axis: str | None) -> int:
    """The index of the plan's mesh axis: ``axis``, else the only axis of a 1-D mesh,
    else ``"tp"``."""
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(
            f"parallelize_module needs a shardwise DeviceMesh. Got {type(mesh).__name__}; "
            "build one with DeviceMesh.cpu((2, 4), ('dp', 'tp')).")
    if axis is None:
        if mesh.ndim == 1:
            return 0
        axis = "tp"
    if not isinstance(axis, str):
        raise ShardingTypeError(f"axis names a mesh axis by its str name. Got {axis!r}; "
                                f"use one of {list(mesh.axis_names)}.")
    if axis not in mesh.axis_names:
        raise ShardingError(
            f"Mesh axis {axis!r} is not in {mesh!r} (axes {list(mesh.axis_names)}): "
            "tensor parallelism runs over one mesh axis. Pass axis=<one of those names>.")
    return mesh.axis_names.index(axis)


def check_placement(value: Any, what: str) -> Placement | None:
    """``value`` if it is a placement (or None), else a ShardingTypeError naming ``what``."""
    if value is None or isinstance(value, (Replicated, Sharded, Partial)):
        return value
    raise ShardingTypeError(
        f"{what} takes a placement for the plan's mesh axis: Replicated(), Sharded(dim) "
        f"or Partial(). Got {value!r}.")


@functools.lru_cache(maxsize=4096)
def layout_on(base: Layout, ndim: int, axis: int, placement: Placement) -> Layout:
    """``base`` with mesh axis ``axis`` holding ``placement`` (other axes unchanged)."""
    dims = [tuple(a for a in axes if a != axis) for axes in base.dims]
    partial = list(base.partial)
    partial[axis] = None
    match placement:
        case Sharded(axis=d):
            dim = normalize_dim(d, ndim, "Sharded dim")
            dims[dim] = tuple(sorted((*dims[dim], axis)))
        case Partial(reduce_op=op):
            partial[axis] = op
        case Replicated():
            pass
    return Layout(base.mesh, tuple(dims), tuple(partial), base.orders)  # (the order stays)


@functools.lru_cache(maxsize=256)
def slice_axis(mesh: DeviceMesh, axis: int, part: DeviceMesh) -> int | None:
    """The index in ``part`` of ``mesh``'s axis ``axis`` when ``part`` is a slice of
    ``mesh`` (``mesh.submesh(...)``: a pipeline stage's) that keeps that axis; else None.

    >>> mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    >>> slice_axis(mesh, 1, mesh.submesh(pp=1)), slice_axis(mesh, 1, mesh.submesh(tp=0))
    (0, None)
    """
    name = mesh.axis_names[axis]
    if part == mesh or name not in part.axis_names or part.ndim >= mesh.ndim or \
            not set(part.axis_names) <= set(mesh.axis_names) or part.devices[0] not in \
            mesh.devices:
        return None
    first = mesh.coord_of(mesh.device_index(part.devices[0]))
    fixed = {n: first[a] for a, n in enumerate(mesh.axis_names) if n not in part.axis_names}
    return part.axis_names.index(name) if mesh.submesh(**fixed) == part else None


def home_of(module: nn.Module, mesh: DeviceMesh, axis: int) -> tuple[DeviceMesh, int]:
    """Where ``module`` (planned on ``mesh``, axis ``axis``) lays values out: the slice
    its parameters were restricted to (a pipeline stage's), else the plan's mesh."""
    p = next(iter(module._parameters.values()), None)  # its own: no walk per call
    if p is None:  # a container (PrepareModuleInput on a block): its first one
        p = next(module.parameters(), None)
    if isinstance(p, Tensor) and p.mesh is not mesh and p.mesh != mesh:
        a = slice_axis(mesh, axis, p.mesh)
        if a is not None:
            return p.mesh, a
    return mesh, axis


def place_on(x: Any, mesh: DeviceMesh, axis: int, placement: Placement | None,
             plain: Placement | None = None, *, where: str = "input") -> Any:
    """``x`` with ``placement`` on mesh axis ``axis``: a shardwise Tensor is laid out
    (no-op if it already is); a plain tensor (the global value) is placed as
    ``placement`` (or ``plain`` when ``placement`` is None; Replicated elsewhere);
    anything else passes unchanged."""
    if isinstance(x, Tensor):
        if x.mesh is not mesh and x.mesh != mesh:
            raise ShardingError(
                f"The {where} lives on {x.mesh!r} but the module is planned on {mesh!r}: "
                "a plan lays values out on its own mesh. Move it first with "
                "shardwise.to_device(x, sharding=PlacementMapping(mesh, ...)); in a "
                "pipeline, parallelize each stage on its slice: for stage in "
                "pipe.local_stages: parallelize_module(stage.module, stage.mesh, plan).")
        if placement is None:
            return x
        target = layout_on(x.dist_layout, x.ndim, axis, placement)
        if target == x.dist_layout:
            return x
        with issuing(where):  # the op of the program position its collectives carry
            return relayout(x, target)
    if isinstance(x, torch.Tensor):
        want = placement if placement is not None else plain
        if want is None:
            return x
        if x.ndim == 0 and isinstance(want, Sharded):
            raise ShardingError(f"The {where} is a 0-d tensor; it cannot be {want!r}. "
                                "Give Replicated() for scalars.")
        return place(x, layout_on(Layout.replicated(mesh, x.ndim), x.ndim, axis, want))
    return x


def relayout(x: Tensor, target: Layout) -> Tensor:
    """``x.relayout(target)``; a Tensor holding its whole value keeps it (module doc).

    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> x = shardwise.tensor(torch.arange(4.), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> y = relayout(x, Layout.replicated(mesh, 1))
    >>> y.placements, y.to_torch().tolist()
    ((Replicated(),), [0.0, 1.0, 2.0, 3.0])
    """
    return x.relayout(target, keep_whole=True)


def shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, axis: int,
                    placement: Placement) -> None:
    """Replace ``module.<name>`` by an ``nn.Parameter`` over a shardwise Tensor holding
    ``placement`` on ``axis`` (Replicated on the other axes, or what it had)."""
    p = module._parameters.get(name)
    if p is None:
        return
    if isinstance(placement, Partial):
        raise ShardingError(f"Parameter {name!r} cannot be Partial: a parameter is one "
                            "value every optimizer step updates. Use Replicated or Sharded.")
    if isinstance(placement, Sharded):
        dim = normalize_dim(placement.axis, p.ndim, "Sharded dim")
        if p.shape[dim] < mesh.mesh_shape[axis]:
            raise ShardingError(
                f"Cannot shard parameter {name!r} with shape {list(p.shape)} across "
                f"{mesh.mesh_shape[axis]} devices of mesh axis {mesh.axis_names[axis]!r}: "
                f"dim {dim} has fewer entries than devices. Use a smaller axis or leave "
                "this module out of the plan.")
    tied = _TIED[-1] if _TIED else {}
    if id(p) in tied:  # one parameter of several modules (tied weights) stays one
        _, new, first = tied[id(p)]
        want = layout_on(new.dist_layout, p.ndim, axis, placement)
        if want != new.dist_layout:
            raise ShardingError(
                f"Parameter {name!r} is shared with {first!r}, which the plan lays out as "
                f"{new.dist_layout}; here it would be {want}. A tied parameter has one "
                "layout: give both modules styles that agree (e.g. both Sharded(0) on "
                "the vocabulary), or untie the weights.")
        module.register_parameter(name, new)  # type: ignore[arg-type]  # a Parameter
        return
    value = place_on(p.detach(), mesh, axis, placement, Replicated(),
                     where=f"parameter {name!r}")
    home = value.mesh
    if not holds_whole(home):
        # blocks cut from the global value are views of it: a copy of each (contiguous)
        # lets the global value go, so a process keeps its blocks only (as DTensor's
        # distribute_tensor does); a mesh held wholly keeps the one global value
        value = value.map_blocks(lambda s: s.clone(memory_format=torch.contiguous_format))
    param = nn.Parameter(value, requires_grad=p.requires_grad)
    assert isinstance(param, Tensor)  # nn.Parameter keeps a tensor subclass's type
    module.register_parameter(name, param)
    if _TIED:
        tied[id(p)] = (p, param, f"{type(module).__name__}.{name}")


# The parameters replaced by the running parallelize_module call: id -> (the original,
# kept alive so its id stays unique; its replacement; where it was first met).
_TIED: list[dict[int, tuple[torch.Tensor, Tensor, str]]] = []


@contextlib.contextmanager
def keeping_ties() -> Iterator[None]:
    """Within the block, a parameter met again (tied weights) gets the replacement it
    got the first time, so the modules keep sharing one parameter."""
    _TIED.append({})
    try:
        yield
    finally:
        _TIED.pop()
