"""Per-device graph ops: lists of single-device values in, lists out.

These mirror the reference graph API (``allgather``, ``distributed_broadcast``,
``transfer_to``, ``shard_and_stack``, ``allreduce.sum``, ``reducescatter.sum``):
a collective takes one value per participating device and gives one per
device, with the participants named by signal buffers (:class:`Signals`).

Invariants:
- Inputs are single-device :class:`shardwise.Tensor` values (one per device),
  or ``TensorType`` values for abstract evaluation: then the outputs are
  ``TensorType`` values, the same checks run, and nothing is allocated.
- Input ``i`` of a collective lives on signal buffer ``i``'s device; output
  ``i`` is placed there. At least 1 participant (one is a no-op), on distinct
  devices.
- Validation is stricter than the reference where it is silent (DESIGN.md §5):
  counts match, devices unique, ranks / dtypes / non-axis dims equal; a bad
  axis raises :class:`AxisError` (an ``IndexError`` and a ``ValueError``).
- Every output is a new value; no input is modified. Values are bit-identical
  to the torch expressions (``cat``, ``stack``, sum in device order), and
  torch autograd flows through them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardwise.graph import allreduce, reducescatter
from shardwise.graph.signals import participants
from shardwise.graph.values import (
    AxisError,
    PerDevice,
    check_same_shape,
    collective_inputs,
    normalize_axis,
    on_devices,
    read,
    read_all,
    single_device,
)
from shardwise.runtime import collectives
from shardwise.sharding.devices import Device, DeviceError
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.types import TensorType

__all__ = [
    "AxisError",
    "allgather",
    "allreduce",
    "distributed_broadcast",
    "reducescatter",
    "shard_and_stack",
    "transfer_to",
]


def allgather(inputs: Iterable[Any], signal_buffers: Iterable[Any],
              axis: int = 0) -> list[PerDevice]:
    """Gather every device's input and give each device their concatenation.

    Args:
        inputs: one single-device Tensor (or TensorType) per participating
            device, in the order of ``signal_buffers``. Same rank and dtype; the
            sizes may differ along ``axis`` only (uneven gathers are allowed).
        signal_buffers: one signal buffer per participating device (e.g.
            ``Signals(devices)``); at least 1 (a no-op), on distinct devices.
        axis: the axis to concatenate along (negative counts from the end).

    Returns:
        One output per device (in buffer order), each
        ``torch.cat([x0, x1, ...], axis)``, placed on that device.

    Raises:
        ShardingError (ValueError): counts differ, no or repeated
            devices, an input off its buffer's device, ranks / dtypes / non-axis
            dims differ.
        AxisError (IndexError): ``axis`` out of range.

    With ``signals = Signals([CPU(0), CPU(1)])``::

        device      CPU(0)          CPU(1)
        input       [[1, 2]]        [[3, 4], [5, 6]]
        output      [[1, 2], [3, 4], [5, 6]]  (on each device)
    """
    locs, devices = collective_inputs("allgather", inputs, signal_buffers)
    first = locs[0]
    d = normalize_axis(axis, first.rank, "allgather axis")
    check_same_shape("allgather", locs, skip_axis=d)
    if first.local is None:
        shape = list(first.shape)
        shape[d] = sum(loc.shape[d] for loc in locs)
        return [TensorType(first.dtype, tuple(shape), dev) for dev in devices]
    return list(on_devices(
        devices, lambda target: collectives.all_gather([loc.tensor().to(target) for loc in locs],
                                                       d)
    ))


def distributed_broadcast(input: Any, signal_buffers: Iterable[Any]) -> list[PerDevice]:
    """Broadcast ``input`` from its device (the root) to every participating device.

    Args:
        input: a single-device Tensor (or TensorType); its device is the root
            and must be one of the signal buffers' devices.
        signal_buffers: one signal buffer per participating device; at least 1,
            on distinct devices. Their count is the number of outputs.

    Returns:
        One output per signal buffer (in buffer order): a copy of ``input``
        (same shape and dtype) on that buffer's device.

    Raises:
        ShardingError (ValueError): the root is not among the buffers' devices,
            repeated devices, or no signal buffers.

    With ``x`` on ``CPU(1)`` and ``Signals([CPU(0), CPU(1)])``::

        device      CPU(0)      CPU(1)
        input                   x   (root)
        output      x           x
    """
    devices = participants(signal_buffers, "distributed_broadcast")
    loc = read(input, "distributed_broadcast input")
    if loc.device not in devices:
        raise ShardingError(
            f"distributed_broadcast input is on {loc.device!r}, which is not among the signal "
            f"buffers' devices {list(devices)}: the input's device is the root and must take "
            f"part. Add a signal buffer for {loc.device!r}, or transfer_to() the input onto "
            "one of those devices first."
        )
    if loc.local is None:
        return [TensorType(loc.dtype, loc.shape, dev) for dev in devices]
    return list(on_devices(devices, lambda target: loc.tensor().to(target)))


def transfer_to(x: Any, device: Device) -> PerDevice:
    """Move the single-device value ``x`` to ``device``.

    Args:
        x: a single-device Tensor (or TensorType).
        device: a shardwise device, e.g. ``CPU(1)`` or ``Accelerator(0)``.

    Returns:
        A new single-device value on ``device`` with ``x``'s value (the
        gradient is transferred back to ``x``'s device).

    Raises:
        DeviceError: ``device`` is not a shardwise device (or does not exist).

    ``transfer_to(x, CPU(1))`` with ``x`` on ``CPU(0)``::

        device      CPU(0)      CPU(1)
        input       x
        output                  x
    """
    if not isinstance(device, Device):
        raise DeviceError(
            f"transfer_to needs a shardwise device such as CPU(0) or Accelerator(0). "
            f"Got {device!r} ({type(device).__name__})."
        )
    loc = read(x, "transfer_to x")
    if loc.local is None:
        return TensorType(loc.dtype, loc.shape, device)
    return on_devices([device], lambda target: loc.tensor().to(target))[0]


def _check_devices(devices: Any) -> tuple[Device, ...]:
    try:
        out = tuple(devices)
    except TypeError:
        raise ShardingTypeError(
            f"shard_and_stack devices must be a list of devices, got {devices!r}."
        ) from None
    if not out:
        raise ShardingError(
            "shard_and_stack needs at least one target device; got devices=[]. "
            "Pass e.g. [CPU(0), CPU(1)]."
        )
    for i, dev in enumerate(out):
        if not isinstance(dev, Device):
            raise DeviceError(
                f"shard_and_stack devices[{i}] is {dev!r} ({type(dev).__name__}), not a "
                "shardwise device. Use CPU(i) or Accelerator(i)."
            )
        if dev in out[:i]:
            raise ShardingError(
                f"shard_and_stack devices lists {dev!r} {out.count(dev)} times in {list(out)}: "
                "each output needs its own device. Remove the repeats."
            )
    return out


def shard_and_stack(inputs: Sequence[Any], devices: Sequence[Device],
                    axis: int = 0) -> list[PerDevice]:
    """Split each input along ``axis`` into ``len(devices)`` equal chunks and give
    device ``i`` the chunks ``i`` of all inputs, stacked along a new dim 0.

    Args:
        inputs: single-device Tensors (or TensorTypes), all of one shape, dtype
            and device (e.g. the host).
        devices: the target devices, one per chunk; non-empty and distinct.
        axis: the axis to split (negative counts from the end); its size must
            be divisible by ``len(devices)``.

    Returns:
        ``len(devices)`` values; output ``i`` is
        ``torch.stack([x[..., i*c:(i+1)*c, ...] for x in inputs])`` with
        ``c = shape[axis] // len(devices)``, of shape
        ``[len(inputs), D0, ..., c, ..., Dn-1]``, placed on ``devices[i]``.

    Raises:
        ShardingError (ValueError): inputs or devices empty, inputs differ in
            shape / dtype / device, repeated devices, axis size not divisible.
        AxisError (IndexError, also a ValueError): ``axis`` out of range.

    Inputs ``A``, ``B`` of shape ``[10, D]``, ``axis=0``, 2 devices::

        device      CPU(0)                          CPU(1)
        output      stack([A[0:5], B[0:5]])         stack([A[5:10], B[5:10]])
        shape       [2, 5, D]                       [2, 5, D]
    """
    locs = read_all(inputs, "shard_and_stack inputs")
    if not locs:
        raise ShardingError(
            "shard_and_stack needs at least one input; got inputs=[]. Pass the tensors to "
            "shard, e.g. [A, B]."
        )
    first = locs[0]
    for i, loc in enumerate(locs[1:], start=1):
        for what, mine, theirs in (("shape", loc.shape, first.shape),
                                   ("dtype", loc.dtype_name, first.dtype_name),
                                   ("device", loc.device, first.device)):
            if mine != theirs:
                raise ShardingError(
                    f"shard_and_stack inputs[{i}] has {what} {mine!r} but inputs[0] has "
                    f"{theirs!r}: all inputs must have the same shape, dtype and device."
                )
    targets = _check_devices(devices)
    d = normalize_axis(axis, first.rank, "shard_and_stack axis")
    n, size = len(targets), first.shape[d]
    if size % n:
        raise ShardingError(
            f"Cannot shard inputs with shape {first.shape} across {n} devices: axis {d} "
            f"(size {size}) must be divisible by {n}. Pad axis {d} to a multiple of {n}, or "
            "use a number of devices that divides it."
        )
    chunk = size // n
    if first.local is None:
        shape = list(first.shape)
        shape[d] = chunk
        return [TensorType(first.dtype, (len(locs), *shape), dev) for dev in targets]
    outs: list[PerDevice] = []
    for i, dev in enumerate(targets):
        stacked = torch.stack([loc.tensor().narrow(d, i * chunk, chunk) for loc in locs])
        outs.append(single_device(stacked.to(dev.to_torch()), dev))
    return outs
