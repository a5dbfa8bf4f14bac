"""``allreduce.sum``: every participating device gets the elementwise sum.

Invariants:
- The sum is taken in device order, ``((x0 + x1) + x2) + ...``, so every device
  gets bit-identical values, equal to that torch expression (computed by the
  collectives of values held in this process, :mod:`shardwise.runtime.collectives`).
- Outputs are new values; inputs are never modified. Differentiable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardwise.graph.values import (
    Local,
    PerDevice,
    check_same_shape,
    collective_inputs,
    on_devices,
)
from shardwise.runtime import collectives
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.types import TensorType

__all__ = ["sum", "sum_in_device_order"]


def sum_in_device_order(locs: Sequence[Local], target: torch.device) -> torch.Tensor:
    """``((x0 + x1) + x2) + ...`` computed on ``target`` by the runtime's in-process collectives
    (a copy for one input)."""
    parts = [loc.tensor().to(target) for loc in locs]
    if len(parts) == 1:
        return parts[0].clone()  # a fresh output, as with more inputs
    return collectives.reduce(parts, ReduceOp.SUM, exact=True)


def sum(inputs: Iterable[Any], signal_buffers: Iterable[Any]) -> list[PerDevice]:
    """All-reduce by sum: output ``i`` on device ``i`` holds ``x0 + x1 + ...``.

    Args:
        inputs: one single-device Tensor (or TensorType) per participating
            device, in the order of ``signal_buffers``; all of one shape and dtype.
        signal_buffers: one signal buffer per participating device (e.g.
            ``Signals(devices)``); at least 1 (a no-op), on distinct devices.

    Returns:
        One output per device (in buffer order), each the sum in device order.

    Raises:
        ShardingError (ValueError): counts differ, no or repeated
            devices, an input off its buffer's device, shapes or dtypes differ.

    With ``signals = Signals([CPU(0), CPU(1)])``::

        device      CPU(0)      CPU(1)
        input       [1, 2]      [10, 20]
        output      [11, 22]    [11, 22]
    """
    locs, devices = collective_inputs("allreduce.sum", inputs, signal_buffers)
    check_same_shape("allreduce.sum", locs)
    first = locs[0]
    if first.local is None:
        return [TensorType(first.dtype, first.shape, d) for d in devices]
    return list(on_devices(devices, lambda target: sum_in_device_order(locs, target)))
