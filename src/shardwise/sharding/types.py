"""Symbolic types: the shape, dtype and placement of values without their data.

Invariants:
- Types are frozen values; building one never allocates.
- ``dtype`` is kept as given (a ``torch.dtype`` or a name such as ``"float32"``):
  this layer never imports torch.
- ``DistributedType.local_types`` gives one per-device type, row-major over the
  mesh, with per-device shapes from the split rule (uneven splits allowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, PlacementMapping, as_layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement
from shardwise.sharding.shapes import local_shape

__all__ = [
    "BufferType",
    "DistributedBufferType",
    "DistributedTensorType",
    "DistributedType",
    "TensorLayout",
    "TensorType",
]


def _shape(shape: Sequence[int], owner: str) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    out = tuple(shape)
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ShardingError(f"{owner} shape {out} must hold ints >= 0. Got {s!r}.")
    return out


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32`` or ``"float32"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorType:
    """A single-device tensor's type: dtype, shape, device."""

    dtype: Any
    shape: tuple[int, ...]
    device: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape(self.shape, type(self).__name__))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}({dtype_name(self.dtype)}, {list(self.shape)}, {self.device!r})"


@dataclass(frozen=True, slots=True, repr=False)
class BufferType(TensorType):
    """A single-device mutable buffer's type (signal buffers and the like)."""


@dataclass(frozen=True, slots=True)
class DistributedType:
    """Shared state and shard-shape logic of distributed type descriptors."""

    dtype: Any
    shape: tuple[int, ...]
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    layout: Layout = field(init=False, repr=False, compare=False)

    _local_kind = TensorType

    def __post_init__(self) -> None:
        shape = _shape(self.shape, type(self).__name__)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "placements", tuple(self.placements))
        object.__setattr__(
            self, "layout", Layout.from_placements(self.mesh, self.placements, len(shape))
        )

    @classmethod
    def from_sharding(cls, dtype: Any, shape: Sequence[int], sharding: Any) -> DistributedType:
        """From any sharding form (PlacementMapping, NamedMapping, ShardingSpec, Layout)."""
        shape = _shape(shape, cls.__name__)
        layout = as_layout(sharding, len(shape))
        return cls(dtype, shape, layout.mesh, layout.to_placements())

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def sharding(self) -> PlacementMapping:
        return PlacementMapping(self.mesh, self.placements)

    @property
    def local_shapes(self) -> list[tuple[int, ...]]:
        mesh = self.mesh
        return [local_shape(self.shape, self.layout, mesh.coord_of(k))
                for k in range(mesh.num_devices)]

    @property
    def local_types(self) -> list[TensorType]:
        """One per-device type, row-major over the mesh."""
        return [
            self._local_kind(self.dtype, s, dev)
            for s, dev in zip(self.local_shapes, self.mesh.devices, strict=True)
        ]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({dtype_name(self.dtype)}, {list(self.shape)}, "
            f"{self.mesh!r}, {list(self.placements)!r})"
        )


@dataclass(frozen=True, slots=True, repr=False)
class DistributedTensorType(DistributedType):
    """A symbolic type for a tensor distributed across a device mesh."""


@dataclass(frozen=True, slots=True, repr=False)
class DistributedBufferType(DistributedType):
    """A symbolic type for a mutable buffer distributed across a device mesh."""

    _local_kind = BufferType


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Metadata snapshot of a distributed tensor for rule evaluation."""

    dtype: Any
    shape: tuple[int, ...]
    mapping: DeviceMapping

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape(self.shape, "TensorLayout"))
        if not isinstance(self.mapping, DeviceMapping):
            raise ShardingError(
                f"TensorLayout mapping must be a PlacementMapping, NamedMapping or "
                f"ShardingSpec. Got {self.mapping!r}."
            )

    @property
    def layout(self) -> Layout:
        return self.mapping.to_layout(len(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)
