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

from shardwise.devices import CPU, Accelerator, Device, DeviceError
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

__version__ = "0.1.0"

# name -> module that defines it; imported on first access.
_LAZY: dict[str, str] = {
    "Tensor": "shardwise.creation",  # with the op registry filled
    "ShardwiseFallbackWarning": "shardwise.ops.torch_api",
    "tensor": "shardwise.creation",
    "from_local": "shardwise.creation",
    "zeros": "shardwise.creation",
    "ones": "shardwise.creation",
    "full": "shardwise.creation",
    "arange": "shardwise.creation",
    "randn": "shardwise.creation",
    "zeros_like": "shardwise.creation",
    "Plan": "shardwise.ops",
    "Step": "shardwise.ops",
    "accelerator": "shardwise.ops",
    "all_gather": "shardwise.ops",
    "all_reduce": "shardwise.ops",
    "all_to_all": "shardwise.ops",
    "cpu": "shardwise.ops",
    "distributed_broadcast": "shardwise.ops",
    "gpu": "shardwise.ops",
    "plan": "shardwise.ops",
    "ppermute": "shardwise.ops",
    "reduce_scatter": "shardwise.ops",
    "reshard": "shardwise.ops",
    "shard": "shardwise.ops",
    "to_device": "shardwise.ops",
    "transfer_to": "shardwise.ops",
    "add": "shardwise.ops",
    "sub": "shardwise.ops",
    "mul": "shardwise.ops",
    "div": "shardwise.ops",
    "neg": "shardwise.ops",
    "pow": "shardwise.ops",
    "matmul": "shardwise.ops",
    "einsum": "shardwise.ops",
    "sum": "shardwise.ops",
    "mean": "shardwise.ops",
    "amax": "shardwise.ops",
    "amin": "shardwise.ops",
    "transpose": "shardwise.ops",
    "permute": "shardwise.ops",
    "reshape": "shardwise.ops",
    "cat": "shardwise.ops",
    "softmax": "shardwise.ops",
    "relu": "shardwise.ops",
    "gelu": "shardwise.ops",
    "silu": "shardwise.ops",
    "sigmoid": "shardwise.ops",
    "tanh": "shardwise.ops",
    "exp": "shardwise.ops",
    "log": "shardwise.ops",
    "sqrt": "shardwise.ops",
    "maximum": "shardwise.ops",
    "minimum": "shardwise.ops",
    "eq": "shardwise.ops",
    "ne": "shardwise.ops",
    "lt": "shardwise.ops",
    "le": "shardwise.ops",
    "gt": "shardwise.ops",
    "ge": "shardwise.ops",
    "where": "shardwise.ops",
    "getitem": "shardwise.ops",
    "grad": "shardwise.autodiff",
    "jvp": "shardwise.autodiff",
    "value_and_grad": "shardwise.autodiff",
    "vjp": "shardwise.autodiff",
    "eval_shape": "shardwise.abstract",
    "visualize": "shardwise.debug",
    "CommCounter": "shardwise.debug",
    "shard_map": "shardwise.shard_map",
    "lax": "shardwise.lax",  # a module: ``from shardwise import lax``
    "distributed": "shardwise.distributed",  # a module: ``shardwise.distributed.initialize()``
    "debug": "shardwise.debug",  # a module: ``shardwise.debug.CommCounter``
    "parallel": "shardwise.parallel",  # a module: ``shardwise.parallel.parallelize_module``
    "checkpoint": "shardwise.checkpoint",  # a module: ``shardwise.checkpoint.save``
    "from_dtensor": "shardwise.checkpoint",
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
