"""Abstract evaluation: the output types of a function, without computing or allocating.

Invariants:
- ``eval_shape(fn, *args)`` runs ``fn`` once with every ``TensorType`` and
  ``DistributedTensorType`` argument replaced by a Tensor whose shards are
  torch *fake* tensors (``FakeTensorMode``): they carry shape, dtype and torch
  device but no data, so a 256 GiB input costs nothing.
- Fake shards keep the runtime's sharing pattern (replicas are one object) and
  report their real torch device, so every op runs its usual code path,
  including ``.to(device)`` and device comparisons.
- Results map back to types: a Tensor on a one-device mesh -> ``TensorType``,
  any other Tensor -> ``DistributedTensorType``; lists, tuples and dicts are
  mapped element-wise; anything else is returned as is.
- The same validation as a real run happens, with the same errors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import shardwise.ops  # noqa: F401  (installs the Tensor operators: x + y, x @ w)
from shardwise.sharding.devices import Device, DeviceError, from_torch
from shardwise.sharding.errors import ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.types import (
    BufferType,
    DistributedBufferType,
    DistributedTensorType,
    TensorType,
    dtype_name,
)
from shardwise.tensors.tensor import Tensor

__all__ = ["eval_shape"]


def _torch_dtype(dtype: Any, owner: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype_name(dtype), None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise ShardingTypeError(
            f"eval_shape: {owner!r} has dtype {dtype!r}, which is not a torch dtype. Use e.g. "
            "torch.float32 or 'float32'."
        )
    return found


def _fake_tensor(t: DistributedTensorType) -> Tensor:
    """A Tensor of type ``t`` whose shards are fake (no data)."""
    dtype = _torch_dtype(t.dtype, t)
    layout = t.layout
    reps = layout.representatives()
    made: dict[int, torch.Tensor] = {}
    shards = []
    for k, local in enumerate(t.local_types):
        r = reps[k]
        if r not in made:
            device = local.device
            if not isinstance(device, Device):
                raise DeviceError(f"eval_shape: {t!r} has {device!r}, not a shardwise device.")
            made[r] = torch.empty(local.shape, dtype=dtype, device=device.to_torch())
        shards.append(made[r])
    return Tensor(shards, layout, t.shape)


def _fake_single(t: TensorType) -> Tensor:
    if not isinstance(t.device, Device):
        raise DeviceError(
            f"eval_shape: {t!r} has device {t.device!r}, not a shardwise device such as CPU(0)."
        )
    dtype = _torch_dtype(t.dtype, t)
    mesh = DeviceMesh.single(t.device)
    local = torch.empty(t.shape, dtype=dtype, device=t.device.to_torch())
    return Tensor([local], Layout.replicated(mesh, len(t.shape)), t.shape)


def _to_fake(x: Any) -> Any:
    if isinstance(x, DistributedTensorType) and not isinstance(x, DistributedBufferType):
        return _fake_tensor(x)
    if isinstance(x, TensorType) and not isinstance(x, BufferType):
        return _fake_single(x)
    return x


def _to_type(x: Any) -> Any:
    if isinstance(x, Tensor):
        mesh = x.mesh
        if mesh.is_single and mesh == DeviceMesh.single(mesh.devices[0]):
            return TensorType(x.dtype, x.shape, mesh.devices[0])
        return x.dist_type
    if isinstance(x, torch.Tensor):
        return TensorType(x.dtype, tuple(x.shape), from_torch(x.device))
    return x


def _tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, list):
        return [_tree_map(fn, v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_tree_map(fn, v) for v in x)
    if isinstance(x, tuple):  # a NamedTuple
        return type(x)(*(_tree_map(fn, v) for v in x))
    if isinstance(x, dict):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The type(s) ``fn(*args, **kwargs)`` would return, computed without data.

    Args:
        fn: a function of Tensors (shardwise.ops, shardwise.graph.ops, ...).
        *args, **kwargs: its arguments; ``DistributedTensorType`` and
            ``TensorType`` values (also inside lists, tuples and dicts) stand
            for Tensors of that type. Other values are passed as they are.

    Returns:
        ``fn``'s result with each Tensor replaced by its type:
        ``DistributedTensorType`` for a multi-device Tensor, ``TensorType``
        for a single-device one.

    Raises:
        Whatever ``fn`` raises on Tensors of these types (e.g. ShardingError).

    On ``DeviceMesh.cpu(2, "x")``, 256 GiB gathered without allocating::

        >>> mesh = DeviceMesh.cpu(2, "x")
        >>> t = DistributedTensorType(torch.float32, (2**20, 2**16), mesh, [Sharded(0)])
        >>> eval_shape(shardwise.all_gather, t, 0)
        DistributedTensorType(float32, [1048576, 65536], DeviceMesh(x=2), [Replicated()])

        device      CPU(0)              CPU(1)
        input       [2**19, 2**16]      [2**19, 2**16]
        output      [2**20, 2**16]      [2**20, 2**16]   (types only)
    """
    if not callable(fn):
        raise ShardingTypeError(f"eval_shape needs a function fn. Got {fn!r} "
                                f"({type(fn).__name__}).")
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        # Tensor.to_torch compares storage pointers, which fake tensors warn about.
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        fake_args = _tree_map(_to_fake, list(args))
        fake_kwargs = {k: _tree_map(_to_fake, v) for k, v in kwargs.items()}
        out = fn(*fake_args, **fake_kwargs)
        return _tree_map(_to_type, out)
