"""shard_map's specs and outputs: specs to layouts, per-device blocks to Tensors.

Invariants:
- A spec is a tuple of per-dim entries (None, an axis name or a tuple of names),
  None or () for replicated, or any sharding form; ``layout_of`` turns it into
  the Layout of a tensor of known rank, with the spec's position in the message
  of any error.
- ``outputs`` builds one Tensor per output from the blocks ``run_spmd`` returned,
  through the backend's ``spmd_outputs`` (the Backend protocol: the simulated one
  reads every device's block; the process one this process's block plus one small
  all_gather of the block shapes, only when a dim is sharded or equality is
  checked). The global shape concatenates sharded dims; every block must be
  exactly where the split rule puts it, or ShardingError.
- Replicated mesh axes take coordinate 0's block (same object on every replica,
  simulated; a zero-gradient boundary off coordinate 0, multi-process).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.runtime import backend_for
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, NamedMapping, as_layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor

__all__ = ["HINT", "check_names", "is_leaf", "layout_of", "outputs", "replicated_axes"]

HINT = ("A spec is a tuple of per-dim entries such as ('x', None) (each None, a mesh axis "
        "name, or a tuple of names), None or () for replicated, or a PlacementMapping / "
        "NamedMapping.")


# --- specs ----------------------------------------------------------------------------------
def check_names(specs: Any, mesh: DeviceMesh, where: str) -> None:
    """Unknown axis names and foreign meshes raise now, whatever the nesting means."""
    if isinstance(specs, (DeviceMapping, Layout)):
        if specs.mesh != mesh:
            raise ShardingError(
                f"{where}: {specs!r} is on {specs.mesh!r} but shard_map runs on {mesh!r}. "
                "Give specs on the shard_map's mesh (or plain tuples of axis names)."
            )
    elif isinstance(specs, (tuple, list)):
        for item in specs:
            check_names(item, mesh, where)
    elif isinstance(specs, str) and specs not in mesh.axis_names:
        raise ShardingError(
            f"{where} names unknown mesh axis {specs!r}: {mesh!r} has axes "
            f"{list(mesh.axis_names)}."
        )


def is_leaf(spec: Any) -> bool:
    return spec is None or isinstance(spec, (DeviceMapping, Layout))


def layout_of(spec: Any, ndim: int, mesh: DeviceMesh, where: str) -> Layout:
    if spec is None:
        return Layout.replicated(mesh, ndim)
    if isinstance(spec, (DeviceMapping, Layout)):
        return as_layout(spec, ndim)
    if isinstance(spec, (tuple, list)):
        try:
            return NamedMapping(mesh, tuple(spec)).to_layout(ndim)
        except ShardingError as err:
            raise ShardingError(f"{where} = {spec!r} does not fit: {err}") from None
    hint = f" For dim 0 split over {spec!r} write ({spec!r},)." if isinstance(spec, str) else ""
    raise ShardingTypeError(f"{where} is {spec!r} ({type(spec).__name__}), not a spec. "
                            f"{HINT}{hint}")


def replicated_axes(layout: Layout) -> tuple[int, ...]:
    return layout.replicated_axes()


# --- outputs --------------------------------------------------------------------------------
def _flatten(out: Any) -> tuple[list[Any], type | None]:
    if isinstance(out, (tuple, list)):
        return list(out), type(out)
    return [out], None


def _block(v: Any, j: int, mesh: DeviceMesh, k: int) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (bool, int, float)):
        return torch.as_tensor(v, device=backend_for(mesh).device_of(mesh, k))
    raise ShardingTypeError(
        f"shard_map: fn returned a {type(v).__name__} as output {j} on "
        f"{mesh.devices[k]!r}; fn returns torch tensors (one, or a tuple/list of them)."
    )


def outputs(results: list[Any], me: int | None, mesh: DeviceMesh, out_specs: Any,
            check: bool, out_shapes: Any = None) -> Any:
    """Blocks -> Tensors. ``me`` is this process's device (multi-process) or None
    (simulated: every device's results are present); ``out_shapes``: the outputs' global
    shapes when the caller knows them (one, or one per output), so none are exchanged."""
    present = range(mesh.num_devices) if me is None else [me]
    flat: dict[int, list[Any]] = {}
    kind: type | None = None
    for k in present:
        flat[k], kind_k = _flatten(results[k])
        if k == present[0]:
            kind = kind_k
        elif kind_k is not kind or len(flat[k]) != len(flat[present[0]]):
            raise ShardingError(
                f"shard_map: fn returned {len(flat[k])} output(s) on {mesh.devices[k]!r} but "
                f"{len(flat[present[0]])} on {mesh.devices[present[0]]!r}: every device "
                "must return the same structure."
            )
    count = len(flat[present[0]])
    if kind is None:
        specs = [out_specs]
    elif is_leaf(out_specs):
        specs = [out_specs] * count
    elif isinstance(out_specs, (tuple, list)) and len(out_specs) == count:
        specs = list(out_specs)
    else:
        raise ShardingError(
            f"shard_map: fn returned a {kind.__name__} of {count} outputs but out_specs is "
            f"{out_specs!r}: give one spec per output (or return a single tensor for one "
            f"spec). {HINT}"
        )
    blocks = {k: [_block(v, j, mesh, k) for j, v in enumerate(vs)] for k, vs in flat.items()}
    where = ["out_specs" if kind is None else f"out_specs[{j}]" for j in range(count)]
    first = blocks[present[0]]
    try:
        layouts = [layout_of(spec, first[j].ndim, mesh, where[j])
                   for j, spec in enumerate(specs)]
    except ShardingError as err:
        if kind is not None:
            raise
        raise ShardingError(f"{err} (fn returned one tensor, so out_specs is read as its "
                            "one spec; return a tuple to give one spec per output)") from None
    per_output = [[blocks[k][j] if k in blocks else None for k in range(mesh.num_devices)]
                  for j in range(count)]
    shapes = _shapes(out_shapes, count, kind is None)
    metas, shards, differ = backend_for(mesh).spmd_outputs(mesh, me, per_output, layouts, check,
                                                           shapes)
    tensors = []
    for j, lay in enumerate(layouts):
        meta = metas[j]
        shape = (tuple(first[j].shape) if meta is None else
                 _global_shape(lay, [m[0] for m in meta], [m[1] for m in meta], where[j]))
        if shapes and shapes[j] is not None and shapes[j] != shape:
            raise ShardingError(
                f"shard_map {where[j]}: out_shapes gives global shape {shapes[j]} but fn's "
                f"blocks make {shape}. Fix out_shapes or the blocks fn returns.")
        bad = differ[j]
        if bad is not None:
            _replicas_differ(lay, where[j], bad)
        tensors.append(Tensor(shards[j], lay, shape, first[j].dtype))
    if kind is None:
        return tensors[0]
    return kind(tensors)


def _shapes(out_shapes: Any, count: int, single: bool) -> list[tuple[int, ...] | None]:
    """``out_shapes`` as one global shape (or None) per output."""
    if out_shapes is None:
        return []
    items = [out_shapes] if single else list(out_shapes)
    try:
        shapes = [None if s is None else tuple(int(d) for d in s) for s in items]
    except (TypeError, ValueError):
        shapes = []
    if len(shapes) != count:
        raise ShardingTypeError(
            f"shard_map out_shapes is one global shape per output ({count}), e.g. (8, 4) for "
            f"one output or ((8, 4), None) for two. Got {out_shapes!r}.")
    return shapes


def _replicas_differ(layout: Layout, where: str, devices: tuple[int, ...]) -> None:
    mesh = layout.mesh
    axes = [mesh.axis_names[a] for a in replicated_axes(layout)]
    if devices:
        k, r = devices
        raise ShardingError(
            f"shard_map {where}: the blocks of {mesh.devices[k]!r} and {mesh.devices[r]!r} "
            f"differ, but the out_spec leaves mesh axes {axes} replicated, which needs equal "
            "values. Reduce them (lax.psum/pmean) or name the axes in the out_spec."
        )
    raise ShardingError(
        f"shard_map {where}: the blocks differ along mesh axes {axes}, which the out_spec "
        "leaves replicated (equal values needed). Reduce them (lax.psum/pmean) or name the "
        "axes in the out_spec."
    )


def _global_shape(layout: Layout, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any],
                  where: str) -> tuple[int, ...]:
    """The global shape the per-device block shapes describe; raises unless every
    block is exactly where the split rule puts it."""
    mesh = layout.mesh
    for k, (s, dt) in enumerate(zip(shapes, dtypes)):
        if len(s) != len(shapes[0]) or dt != dtypes[0]:
            raise ShardingError(
                f"shard_map {where}: {mesh.devices[k]!r} returned a block of shape {s} "
                f"{dt} but {mesh.devices[0]!r} one of shape {shapes[0]} {dtypes[0]}: the "
                "blocks of one output need one rank and one dtype."
            )
    shape = []
    for d, axes in enumerate(layout.dims):
        total = 0
        for p in range(math.prod(mesh.mesh_shape[a] for a in axes)):
            coord = [0] * mesh.ndim
            for a, c in zip(reversed(axes), _digits(p, [mesh.mesh_shape[a] for a in axes])):
                coord[a] = c
            total += shapes[mesh.index_of(coord)][d]
        shape.append(total)
    for k, s in enumerate(shapes):
        want = local_shape(shape, layout, mesh.coord_of(k))
        if tuple(s) != want:
            raise ShardingError(
                f"shard_map {where}: {mesh.devices[k]!r} (mesh coordinate {mesh.coord_of(k)}) "
                f"returned a block of shape {tuple(s)}, but the blocks give global shape "
                f"{tuple(shape)}, which layout {layout} splits so that {want} lands there. "
                "Sharded dims must follow the split rule (piece k of g over n has "
                "g // n + (1 if k < g % n else 0)) and other dims must agree: fix the blocks "
                "fn returns or the out_spec."
            )
    return tuple(shape)


def _digits(p: int, sizes: Sequence[int]) -> list[int]:
    """Row-major digits of ``p`` over ``sizes``, least significant first."""
    out = []
    for s in reversed(sizes):
        p, r = divmod(p, s)
        out.append(r)
    return out
