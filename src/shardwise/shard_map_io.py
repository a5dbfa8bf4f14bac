"""shard_map's specs and outputs: specs to layouts, per-device blocks to Tensors.

Invariants:
- A spec is a tuple of per-dim entries (None, an axis name or a tuple of names),
  None or () for replicated, or any sharding form; ``layout_of`` turns it into
  the Layout of a tensor of known rank, with the spec's position in the message
  of any error.
- ``outputs`` builds one Tensor per output from every device's block (simulated)
  or this process's block plus one small all_gather of the block shapes
  (multi-process, only when a dim is sharded or equality is checked). The global
  shape concatenates sharded dims; every block must be exactly where the split
  rule puts it, or ShardingError.
- Replicated mesh axes take coordinate 0's block (same object on every replica,
  simulated; a zero-gradient boundary off coordinate 0, multi-process).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.runtime.process import collectives as D
from shardwise.runtime.process import spmd as dist_rt
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, NamedMapping, as_layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.shapes import local_shape
from shardwise.tensors import Tensor

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
        from shardwise.runtime import backend_for

        return torch.as_tensor(v, device=backend_for(mesh).device_of(mesh, k))
    raise ShardingTypeError(
        f"shard_map: fn returned a {type(v).__name__} as output {j} on "
        f"{mesh.devices[k]!r}; fn returns torch tensors (one, or a tuple/list of them)."
    )


def outputs(results: list[Any], me: int | None, mesh: DeviceMesh, out_specs: Any,
            check: bool) -> Any:
    """Blocks -> Tensors. ``me`` is this process's device (multi-process) or None
    (simulated: every device's results are present)."""
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
    if me is None:
        tensors = [_assemble_simulated([blocks[k][j] for k in present], layouts[j], where[j],
                                       check) for j in range(count)]
    else:
        tensors = _assemble_process(first, me, layouts, where, check)
    if kind is None:
        return tensors[0]
    return kind(tensors)


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


def _assemble_simulated(vals: Sequence[torch.Tensor], layout: Layout, where: str,
                        check: bool) -> Tensor:
    shape = _global_shape(layout, [tuple(v.shape) for v in vals], [v.dtype for v in vals],
                          where)
    reps = layout.representatives()
    if check:
        for k, r in enumerate(reps):
            if r != k and not torch.allclose(vals[k], vals[r], equal_nan=True):
                mesh = layout.mesh
                raise ShardingError(
                    f"shard_map {where}: the blocks of {mesh.devices[k]!r} and "
                    f"{mesh.devices[r]!r} differ, but the out_spec leaves mesh axes "
                    f"{[mesh.axis_names[a] for a in replicated_axes(layout)]} replicated, "
                    "which needs equal values. Reduce them (lax.psum/pmean) or name the "
                    "axes in the out_spec."
                )
    return Tensor([vals[r] for r in reps], layout, shape, vals[0].dtype)


def _assemble_process(blocks: Sequence[torch.Tensor], me: int, layouts: Sequence[Layout],
                      where: Sequence[str], check: bool) -> list[Tensor]:
    mesh = layouts[0].mesh if layouts else None
    out: list[Tensor] = []
    if mesh is None:
        return out
    every = tuple(range(mesh.ndim))
    needs = [j for j, lay in enumerate(layouts) if check or any(lay.dims)]
    shapes: dict[int, list[tuple[int, ...]]] = {}
    if needs:
        # One small all_gather tells every process every block's shape.
        flat = [s for j in needs for s in blocks[j].shape]
        grp = D.group(mesh, every)
        t = torch.tensor(flat, dtype=torch.int64, device=blocks[needs[0]].device)
        rows = D.all_gather(t, 0, grp, [len(flat)] * grp.size).view(grp.size, -1).tolist()
        off = 0
        for j in needs:
            nd = blocks[j].ndim
            shapes[j] = [tuple(int(v) for v in row[off:off + nd]) for row in rows]
            off += nd
    if check:
        _check_replicated_process(blocks, layouts, where)
    for j, (v, lay) in enumerate(zip(blocks, layouts)):
        shape = (_global_shape(lay, shapes[j], [v.dtype] * mesh.num_devices, where[j])
                 if j in shapes else tuple(v.shape))
        v = dist_rt.take_first(v, mesh, me, replicated_axes(lay))
        shards: list[torch.Tensor | None] = [None] * mesh.num_devices
        shards[me] = v
        out.append(Tensor(shards, lay, shape, v.dtype))
    return out


def _check_replicated_process(blocks: Sequence[torch.Tensor], layouts: Sequence[Layout],
                              where: Sequence[str]) -> None:
    from shardwise.sharding.placements import ReduceOp

    mesh = layouts[0].mesh
    bad = []
    for v, lay in zip(blocks, layouts):
        axes = replicated_axes(lay)
        if not axes:
            bad.append(0.0)
            continue
        grp = D.group(mesh, axes)
        x = v.detach().to(torch.float64)
        hi, lo = D.all_reduce(x, grp, ReduceOp.MAX), D.all_reduce(x, grp, ReduceOp.MIN)
        bad.append(0.0 if torch.allclose(hi, lo, equal_nan=True) else 1.0)
    flags = torch.tensor(bad, dtype=torch.float64, device=blocks[0].device)
    flags = D.all_reduce(flags, D.group(mesh, tuple(range(mesh.ndim))), ReduceOp.MAX)
    for j, f in enumerate(flags.tolist()):
        if f:
            raise ShardingError(
                f"shard_map {where[j]}: the blocks differ along mesh axes "
                f"{[mesh.axis_names[a] for a in replicated_axes(layouts[j])]}, which the "
                "out_spec leaves replicated (equal values needed). Reduce them "
                "(lax.psum/pmean) or name the axes in the out_spec."
            )
