"""shardwise: distributed tensors on PyTorch.

Describe a device mesh and a sharding, move and reshard tensors, run
collectives, compute on sharded tensors and differentiate through it all, on
a simulated mesh in one process or one process per device via torchrun.

The facade resolves torch-dependent names lazily so that
``import shardwise.sharding`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardwise.sharding import (
    ConversionError,
    DeviceMesh,
    DimSpec,
    DistributedTensorType,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingError,
    ShardingSpec,
)
from shardwise.sharding.devices import CPU, Accelerator, Device, DeviceError, VirtualDevice

__version__ = "0.1.0"

# name -> module that defines it; imported on first access.
_LAZY: dict[str, str] = {
    "Tensor": "shardwise.api.creation",  # with the op registry filled
    "ShardwiseFallbackWarning": "shardwise.ops.registry",
    "strict": "shardwise.ops.fallbacks",
    "tensor": "shardwise.api.creation",
    "from_local": "shardwise.api.creation",
    "zeros": "shardwise.api.creation",
    "ones": "shardwise.api.creation",
    "full": "shardwise.api.creation",
    "arange": "shardwise.api.creation",
    "randn": "shardwise.api.creation",
    "zeros_like": "shardwise.api.creation",
    "init_device_mesh": "shardwise.api.meshes",
    "compile_backend": "shardwise.api.compiling",
    "Plan": "shardwise.planner",
    "Step": "shardwise.planner",
    "accelerator": "shardwise.api.communication",
    "all_gather": "shardwise.api.communication",
    "all_reduce": "shardwise.api.reducing",
    "all_to_all": "shardwise.api.communication",
    "cpu": "shardwise.api.communication",
    "distributed_broadcast": "shardwise.api.communication",
    "gpu": "shardwise.api.communication",
    "plan": "shardwise.api.communication",
    "ppermute": "shardwise.api.point_to_point",
    "reduce_scatter": "shardwise.api.reducing",
    "reshard": "shardwise.api.communication",
    "shard": "shardwise.api.communication",
    "to_device": "shardwise.api.communication",
    "transfer_to": "shardwise.api.communication",
    "add": "shardwise.ops.compute",
    "sub": "shardwise.ops.compute",
    "mul": "shardwise.ops.compute",
    "div": "shardwise.ops.compute",
    "neg": "shardwise.ops.compute",
    "pow": "shardwise.ops.compute",
    "matmul": "shardwise.ops.compute",
    "einsum": "shardwise.ops.compute",
    "sum": "shardwise.ops.compute",
    "mean": "shardwise.ops.compute",
    "amax": "shardwise.ops.compute",
    "amin": "shardwise.ops.compute",
    "transpose": "shardwise.ops.compute",
    "permute": "shardwise.ops.compute",
    "reshape": "shardwise.ops.compute",
    "cat": "shardwise.ops.compute",
    "softmax": "shardwise.ops.compute",
    "relu": "shardwise.ops.compute",
    "gelu": "shardwise.ops.compute",
    "silu": "shardwise.ops.compute",
    "sigmoid": "shardwise.ops.compute",
    "tanh": "shardwise.ops.compute",
    "exp": "shardwise.ops.compute",
    "log": "shardwise.ops.compute",
    "sqrt": "shardwise.ops.compute",
    "maximum": "shardwise.ops.compute",
    "minimum": "shardwise.ops.compute",
    "eq": "shardwise.ops.compute",
    "ne": "shardwise.ops.compute",
    "lt": "shardwise.ops.compute",
    "le": "shardwise.ops.compute",
    "gt": "shardwise.ops.compute",
    "ge": "shardwise.ops.compute",
    "where": "shardwise.ops.compute",
    "getitem": "shardwise.ops.compute",
    "grad": "shardwise.api.autodiff",
    "jvp": "shardwise.api.autodiff",
    "value_and_grad": "shardwise.api.autodiff",
    "vjp": "shardwise.api.autodiff",
    "eval_shape": "shardwise.api.abstract",
    "visualize": "shardwise.debug",
    "CommCounter": "shardwise.debug",
    "FallbackCounter": "shardwise.debug",
    "shard_map": "shardwise.spmd.shard_map",
    "lax": "shardwise.lax",  # a module: ``from shardwise import lax``
    "distributed": "shardwise.distributed",  # a module: ``shardwise.distributed.initialize()``
    "debug": "shardwise.debug",  # a module: ``shardwise.debug.CommCounter``
    "parallel": "shardwise.parallel",  # a module: ``shardwise.parallel.parallelize_module``
    "checkpoint": "shardwise.checkpoint",  # a module: ``shardwise.checkpoint.save``
    "from_dtensor": "shardwise.checkpoint",
    "check_replicas": "shardwise.parallel.replicas",
    "estimate": "shardwise.planning",
    "calibrate": "shardwise.planning",
    "auto_plan": "shardwise.planning",
    "planning": "shardwise.planning",  # a module: ``shardwise.planning.ModelConfig``
}

__all__ = [
    "CPU",
    "Accelerator",
    "ConversionError",
    "Device",
    "DeviceError",
    "DeviceMesh",
    "DimSpec",
    "DistributedTensorType",
    "NamedMapping",
    "Partial",
    "PlacementMapping",
    "ReduceOp",
    "Replicated",
    "Sharded",
    "ShardingError",
    "ShardingSpec",
    "VirtualDevice",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    mod = importlib.import_module(module)
    # An entry naming a submodule itself (``lax``) resolves to that module.
    value = mod if module == f"{__name__}.{name}" and not hasattr(mod, name) else getattr(
        mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
