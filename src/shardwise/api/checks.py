"""Argument checks shared by the communication ops."""

from __future__ import annotations

from typing import Any

from shardwise.sharding.errors import ShardingError, ShardingTypeError, check_items
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.tensor import Tensor

__all__ = ["mesh_axes", "need_tensor"]


def need_tensor(x: Any, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ShardingTypeError(
            f"{op} needs a shardwise.Tensor, got {type(x).__name__}. Make one with "
            "shardwise.tensor(data, sharding=...) first."
        )
    return x


def mesh_axes(mesh: DeviceMesh, axes: Any, what: str) -> tuple[int, ...]:
    if isinstance(axes, (str, int)):
        axes = (axes,)
    axes = check_items(axes, what, "a mesh axis name or index, or a sequence of them")
    out = tuple(mesh.axis_index(a) for a in axes)
    if len(set(out)) != len(out):
        names = [mesh.axis_names[a] for a in out]
        raise ShardingError(f"{what} names a mesh axis twice: {names}. Name each axis once.")
    return out
