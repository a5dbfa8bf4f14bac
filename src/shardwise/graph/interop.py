"""Between per-device values and distributed Tensors.

Invariants:
- ``from_tensor(t)`` gives one single-device value per mesh device, row-major:
  device ``k``'s *local* value (a Partial axis gives its unreduced part).
- ``to_tensor(values, sharding)`` is its inverse: value ``k`` must be on mesh
  device ``k`` and have the local shape the split rule gives it, so
  ``to_tensor(from_tensor(t), t.sharding, t.shape)`` equals ``t``.
- Both work on types too: TensorTypes <-> a DistributedTensorType.
- Nothing is copied between virtual CPU devices; values are read-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from shardwise.graph.values import PerDevice, read_all, single_device
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import as_layout
from shardwise.sharding.types import DistributedTensorType, TensorType
from shardwise.tensors.tensor import Tensor

__all__ = ["from_tensor", "to_tensor"]


def to_tensor(values: Iterable[Any], sharding: Any,
              shape: Sequence[int] | None = None) -> Tensor | DistributedTensorType:
    """A distributed Tensor from one single-device value per mesh device.

    Args:
        values: single-device Tensors (or TensorTypes), one per device of the
            sharding's mesh, row-major; value ``k`` must be on mesh device ``k``.
        sharding: any sharding form (PlacementMapping, NamedMapping, ShardingSpec).
        shape: the global shape; if omitted it is derived assuming an even split.

    Returns:
        The Tensor (a DistributedTensorType for TensorType values).

    Raises:
        ShardingError: wrong count, a value on the wrong device, or local shapes
            that do not follow the split rule for ``shape``.

    ``to_tensor([x0, x1], PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)]))``::

        device      CPU(0)      CPU(1)
        value       x0          x1          -> Tensor cat([x0, x1]), Sharded(0)
    """
    locs = read_all(values, "to_tensor values")
    if not locs:
        raise ShardingError("to_tensor needs one value per mesh device; got none.")
    layout = as_layout(sharding, locs[0].rank)
    mesh = layout.mesh
    if len(locs) != mesh.num_devices:
        raise ShardingError(
            f"to_tensor got {len(locs)} values for {mesh!r} with {mesh.num_devices} devices "
            f"{list(mesh.devices)}: give one value per mesh device, row-major."
        )
    for k, (loc, dev) in enumerate(zip(locs, mesh.devices, strict=True)):
        if loc.device != dev:
            raise ShardingError(
                f"to_tensor values[{k}] is on {loc.device!r} but mesh device {k} is {dev!r}: "
                f"value k must live on mesh device k ({list(mesh.devices)}). Reorder the "
                "values or transfer_to() them."
            )
    if locs[0].local is not None:
        from shardwise.api.creation import from_local

        return from_local([loc.tensor() for loc in locs], sharding, shape)
    return _to_type(locs[0].dtype, [loc.shape for loc in locs],
                    [loc.dtype_name for loc in locs], layout, shape)


def _to_type(dtype: Any, shapes: list[tuple[int, ...]], dtypes: list[str], layout: Layout,
             shape: Sequence[int] | None) -> DistributedTensorType:
    mesh = layout.mesh
    if shape is None:
        full = list(shapes[0])
        for d, axes in enumerate(layout.dims):
            for a in axes:
                full[d] *= mesh.mesh_shape[a]
        shape = tuple(full)
    out = DistributedTensorType(dtype, tuple(shape), mesh, layout.to_placements())
    for k, (want, got, name) in enumerate(zip(out.local_shapes, shapes, dtypes, strict=True)):
        if got != want or name != dtypes[0]:
            raise ShardingError(
                f"to_tensor: values[{k}] on {mesh.devices[k]!r} has shape {got} dtype {name}, "
                f"but global shape {out.shape} laid out as {layout} puts shape {want} dtype "
                f"{dtypes[0]} there (split rule: g // n + (1 if k < g % n else 0))."
            )
    return out


def from_tensor(t: Tensor | DistributedTensorType) -> list[PerDevice]:
    """One single-device value per mesh device (row-major): each device's local value.

    Args:
        t: a Tensor (or a DistributedTensorType).

    Returns:
        Single-device Tensors (TensorTypes for a type), value ``k`` on mesh
        device ``k``. For a Partial layout these are the unreduced parts.

    ``from_tensor(t)`` for ``t`` of 3 rows Sharded(0) on ``DeviceMesh.cpu(2, "x")``::

        device      CPU(0)      CPU(1)
        value       t[0:2]      t[2:3]
    """
    if isinstance(t, Tensor):
        return [single_device(s.view(s.shape), dev)
                for s, dev in zip(t.shards, t.mesh.devices, strict=True)]
    if isinstance(t, DistributedTensorType):
        return [TensorType(lt.dtype, lt.shape, lt.device) for lt in t.local_types]
    raise ShardingTypeError(
        f"from_tensor needs a shardwise.Tensor or DistributedTensorType, got "
        f"{type(t).__name__}. Make one with shardwise.tensor(data, sharding=...)."
    )
