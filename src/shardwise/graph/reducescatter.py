"""``reducescatter.sum``: the elementwise sum, split along an axis, one piece per device.

Invariants:
- The sum is that of :func:`shardwise.graph.allreduce.sum` (device order, by the
  runtime's in-process collectives), so concatenating the pieces along ``axis`` gives exactly
  the all-reduce result.
- Split rule: an axis of size ``g`` over ``n`` devices gives device ``k`` the
  contiguous piece of size ``g // n + (1 if k < g % n else 0)``; uneven and
  size-0 pieces are legal.
- Outputs are new values (each device's piece summed on its own); differentiable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.graph.values import (
    PerDevice,
    check_same_shape,
    collective_inputs,
    normalize_axis,
    single_device,
)
from shardwise.runtime import collectives
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_bounds
from shardwise.sharding.types import TensorType

__all__ = ["sum"]


def sum(inputs: Iterable[Any], signal_buffers: Iterable[Any],
        axis: int = 0) -> list[PerDevice]:
    """Reduce-scatter by sum: device ``i`` gets piece ``i`` of ``x0 + x1 + ...``
    along ``axis``.

    Args:
        inputs: one single-device Tensor (or TensorType) per participating
            device, in the order of ``signal_buffers``; all of one shape and dtype.
        signal_buffers: one signal buffer per participating device (e.g.
            ``Signals(devices)``); at least 1 (a no-op), on distinct devices.
        axis: the axis to split the sum along (negative counts from the end).

    Returns:
        One output per device (in buffer order): its piece of the sum, by the
        split rule ``g // n + (1 if k < g % n else 0)``.

    Raises:
        ShardingError (ValueError): as :func:`shardwise.graph.allreduce.sum`.
        AxisError (IndexError): ``axis`` out of range.

    With ``signals = Signals([CPU(0), CPU(1)])`` and 3-element inputs::

        device      CPU(0)          CPU(1)
        input       [1, 2, 3]       [10, 20, 30]
        output      [11, 22]        [33]
    """
    locs, devices = collective_inputs("reducescatter.sum", inputs, signal_buffers)
    check_same_shape("reducescatter.sum", locs)
    first = locs[0]
    d = normalize_axis(axis, first.rank, "reducescatter.sum axis")
    n, size = len(devices), first.shape[d]
    bounds = [split_bounds(size, n, k) for k in range(n)]
    if first.local is None:
        out: list[PerDevice] = []
        for dev, (lo, hi) in zip(devices, bounds, strict=True):
            shape = list(first.shape)
            shape[d] = hi - lo
            out.append(TensorType(first.dtype, tuple(shape), dev))
        return out
    moved: dict[torch.device, list[torch.Tensor]] = {}
    outs: list[PerDevice] = []
    for k, dev in enumerate(devices):
        target = dev.to_torch()
        parts = moved.get(target)
        if parts is None:
            parts = moved[target] = [loc.tensor().to(target) for loc in locs]
        piece = collectives.reduce_scatter(parts, d, k, ReduceOp.SUM, exact=True)
        outs.append(single_device(piece, dev))
    return outs
