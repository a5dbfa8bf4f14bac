"""Per-device values of the graph ops: what they accept, the shared checks, and
how outputs are built.

Invariants:
- A per-device value is a single-device :class:`shardwise.Tensor` or, for
  abstract evaluation, a ``TensorType(dtype, shape, device)`` whose device is a
  shardwise :class:`~shardwise.sharding.devices.Device`. Plain torch tensors are refused:
  they cannot say which virtual CPU they are on.
- One call takes values of one kind: all Tensors (outputs are Tensors) or all
  TensorTypes (outputs are TensorTypes and nothing is allocated).
- Every output is a new object, never an input Tensor nor an input's local
  torch tensor; outputs on devices that share a torch device share storage.
- Errors are from the ShardingError family (ValueErrors); a bad axis raises
  :class:`AxisError`, which is also an ``IndexError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

import shardwise.ops  # noqa: F401  (installs the Tensor operators: x + y, x @ w)
from shardwise.graph.signals import participants
from shardwise.sharding.devices import Device, DeviceError
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.types import BufferType, DistributedType, TensorType, dtype_name
from shardwise.tensors.tensor import Tensor

__all__ = [
    "AxisError",
    "Local",
    "PerDevice",
    "check_same_shape",
    "collective_inputs",
    "normalize_axis",
    "on_devices",
    "read",
    "read_all",
    "single_device",
]

PerDevice: TypeAlias = "Tensor | TensorType"


class AxisError(ShardingError, IndexError):
    """An axis out of range for the values' rank: both a ``ValueError`` (the
    ShardingError family) and an ``IndexError`` (like numpy's AxisError)."""


@dataclass(frozen=True, slots=True)
class Local:
    """One per-device input as read: dtype, shape, device, and its local torch
    tensor (``None`` when the input is a TensorType)."""

    dtype: Any
    shape: tuple[int, ...]
    device: Device
    local: torch.Tensor | None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def tensor(self) -> torch.Tensor:
        assert self.local is not None, "abstract values have no local tensor"
        return self.local


def read(value: Any, what: str) -> Local:
    """``value`` as a :class:`Local`, or a ShardingTypeError naming ``what``."""
    if isinstance(value, Tensor):
        mesh = value.mesh
        if not mesh.is_single:
            raise ShardingTypeError(
                f"{what} is {value!r}, which lives on {mesh.num_devices} devices; graph ops "
                "take single-device values (one per device). Split it with "
                "shardwise.graph.from_tensor(x)."
            )
        device = mesh.devices[0]
        if not isinstance(device, Device):
            raise DeviceError(f"{what} lives on {device!r}, which is not a shardwise device.")
        return Local(value.dtype, tuple(value.shape), device, value.shards[0])
    if isinstance(value, TensorType) and not isinstance(value, BufferType):
        if not isinstance(value.device, Device):
            raise DeviceError(
                f"{what} is {value!r}, whose device {value.device!r} is not a shardwise "
                "device. Build it as TensorType(dtype, shape, CPU(i)) or Accelerator(i)."
            )
        return Local(value.dtype, value.shape, value.device, None)
    if isinstance(value, torch.Tensor):
        hint = ("a torch.Tensor cannot say which (virtual) device it is on. Wrap it with "
                "shardwise.tensor(data, device=CPU(i)).")
    elif isinstance(value, DistributedType):
        hint = "a distributed type spans several devices. Use its .local_types."
    else:
        hint = ("pass a single-device shardwise.Tensor (shardwise.tensor(data, device=CPU(i))) "
                "or a TensorType(dtype, shape, device).")
    raise ShardingTypeError(
        f"{what} must be a single-device shardwise.Tensor or a TensorType; got "
        f"{type(value).__name__}: {hint}"
    )


def read_all(values: Iterable[Any], what: str) -> list[Local]:
    """Every value of ``values`` read, all of one kind (Tensors or TensorTypes)."""
    if isinstance(values, (Tensor, TensorType, torch.Tensor)):
        raise ShardingTypeError(
            f"{what} must be a list of per-device values (one per device), got a single "
            f"{type(values).__name__}. Wrap it in a list."
        )
    try:
        items = list(values)
    except TypeError:
        raise ShardingTypeError(
            f"{what} must be a list of per-device values, got {type(values).__name__}."
        ) from None
    out = [read(v, f"{what}[{i}]") for i, v in enumerate(items)]
    kinds = {loc.local is None for loc in out}
    if len(kinds) > 1:
        kinds_seen = [type(v).__name__ for v in items]
        raise ShardingTypeError(
            f"{what} mixes Tensors and TensorTypes ({kinds_seen}): give all Tensors (to run) "
            "or all TensorTypes (to evaluate shapes only)."
        )
    return out


def normalize_axis(axis: Any, rank: int, what: str) -> int:
    """``axis`` in ``[0, rank)`` (negative counts from the end), else AxisError."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ShardingTypeError(f"{what} must be an int. Got {axis!r} ({type(axis).__name__}).")
    if not -rank <= axis < rank:
        allowed = f"use -{rank} <= axis < {rank}" if rank else "rank-0 values have no axis"
        raise AxisError(
            f"{what} {axis} is out of range for values of rank {rank}: {allowed}."
        )
    return axis % rank


def collective_inputs(op: str, inputs: Iterable[Any],
                      signal_buffers: Iterable[Any]) -> tuple[list[Local], tuple[Device, ...]]:
    """The checks shared by every collective: one input per signal buffer, input
    ``i`` on buffer ``i``'s device, one rank and one dtype."""
    devices = participants(signal_buffers, op)
    locs = read_all(inputs, f"{op} inputs")
    if len(locs) != len(devices):
        raise ShardingError(
            f"{op} got {len(locs)} inputs for {len(devices)} signal buffers (devices "
            f"{list(devices)}): give exactly one input per participating device, in the "
            "order of the signal buffers."
        )
    for i, (loc, dev) in enumerate(zip(locs, devices, strict=True)):
        if loc.device != dev:
            raise ShardingError(
                f"{op} inputs[{i}] is on {loc.device!r} but signal buffer {i} is on {dev!r}: "
                f"input i must live on buffer i's device. Order the inputs like the signal "
                f"buffers {list(devices)}, or move it with transfer_to(x, {dev!r})."
            )
    first = locs[0]
    for i, loc in enumerate(locs[1:], start=1):
        if loc.rank != first.rank:
            raise ShardingError(
                f"{op} inputs[{i}] has rank {loc.rank} (shape {loc.shape}) but inputs[0] has "
                f"rank {first.rank} (shape {first.shape}): every input must have the same rank."
            )
        if loc.dtype_name != first.dtype_name:
            raise ShardingError(
                f"{op} inputs[{i}] has dtype {loc.dtype_name} but inputs[0] has "
                f"{first.dtype_name}: every input must have the same dtype. Cast them first."
            )
    return locs, devices


def check_same_shape(op: str, locs: Sequence[Local], skip_axis: int | None = None) -> None:
    """Every input has inputs[0]'s shape (except along ``skip_axis``)."""
    first = locs[0]
    for i, loc in enumerate(locs[1:], start=1):
        for d, (a, b) in enumerate(zip(loc.shape, first.shape, strict=True)):
            if d != skip_axis and a != b:
                rule = ("they may differ only along the gather axis "
                        f"{skip_axis}" if skip_axis is not None else "they must be equal")
                raise ShardingError(
                    f"{op} inputs[{i}] has shape {loc.shape} but inputs[0] has shape "
                    f"{first.shape}: dim {d} differs ({a} vs {b}), and {rule}."
                )


def single_device(local: torch.Tensor, device: Device) -> Tensor:
    """``local`` as a new single-device Tensor on ``device``."""
    mesh = DeviceMesh.single(device)
    return Tensor([local], Layout.replicated(mesh, local.ndim), tuple(local.shape))


def on_devices(devices: Sequence[Device],
               compute: Callable[[torch.device], torch.Tensor]) -> list[Tensor]:
    """One output per device: ``compute(torch_device)`` runs once per distinct
    torch device; each output gets its own (view) object of that result."""
    done: dict[torch.device, torch.Tensor] = {}
    out = []
    for dev in devices:
        target = dev.to_torch()
        res = done.get(target)
        if res is None:
            res = done[target] = compute(target)
        out.append(single_device(res.view(res.shape), dev))
    return out
