"""Placement types and sharding specifications for distributed tensors.

Pure Python: this package never imports torch (a test checks it).

Invariants:
- Meshes, placements, mappings and types are frozen, validated, hashable values.
- Every sharding form converts to a canonical :class:`Layout`; conversions
  between forms are lossless or raise :class:`ConversionError`.
- The split rule: a dim of size ``g`` over ``n`` shards gives shard ``k``
  ``g // n + (1 if k < g % n else 0)`` elements, contiguous and in order.
"""

from shardwise.sharding.errors import ConversionError, ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import (
    DeviceMapping,
    DimSpec,
    NamedMapping,
    PlacementMapping,
    ShardingSpec,
    SpecEntry,
    as_layout,
)
from shardwise.sharding.mesh import DeviceMesh, current_mesh
from shardwise.sharding.placements import Partial, Placement, ReduceOp, Replicated, Sharded
from shardwise.sharding.shapes import (
    global_shape_from_local,
    local_shard_shape_from_global,
    shard_shape,
)
from shardwise.sharding.types import (
    BufferType,
    DistributedBufferType,
    DistributedTensorType,
    DistributedType,
    TensorLayout,
    TensorType,
)

__all__ = [
    "BufferType",
    "ConversionError",
    "DeviceMapping",
    "DeviceMesh",
    "DimSpec",
    "DistributedBufferType",
    "DistributedTensorType",
    "DistributedType",
    "Layout",
    "NamedMapping",
    "Partial",
    "Placement",
    "PlacementMapping",
    "ReduceOp",
    "Replicated",
    "Sharded",
    "ShardingError",
    "ShardingSpec",
    "ShardingTypeError",
    "SpecEntry",
    "TensorLayout",
    "TensorType",
    "as_layout",
    "current_mesh",
    "global_shape_from_local",
    "local_shard_shape_from_global",
    "shard_shape",
]
