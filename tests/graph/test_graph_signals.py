"""Signals and signal buffers: validation, values, and how the ops accept them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardwise
from shardwise.graph import SIGNAL_BUFFER_BYTES, SignalBuffer, Signals, ops
from shardwise.sharding import BufferType, DeviceMesh, ShardingError
from shardwise.sharding.devices import CPU, Accelerator, DeviceError
from shardwise.sharding.errors import ShardingTypeError


def test_signals_hold_devices_and_give_one_buffer_per_device() -> None:
    signals = Signals([CPU(0), CPU(1), CPU(2)])
    assert signals.devices == (CPU(0), CPU(1), CPU(2))
    assert len(signals) == 3
    buffers = signals.buffers()
    assert buffers == (SignalBuffer(CPU(0)), SignalBuffer(CPU(1)), SignalBuffer(CPU(2)))
    assert tuple(signals) == buffers
    assert [b.device for b in buffers] == [CPU(0), CPU(1), CPU(2)]
    assert buffers[1].type == BufferType(torch.uint8, (SIGNAL_BUFFER_BYTES,), CPU(1))
    assert repr(signals) == "Signals([CPU(0), CPU(1), CPU(2)])"
    assert repr(buffers[0]) == "SignalBuffer(CPU(0))"


def test_signals_are_frozen_hashable_values() -> None:
    a, b = Signals((CPU(0), CPU(1))), Signals([CPU(0), CPU(1)])
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.devices = (CPU(2), CPU(3))  # type: ignore[misc]


def test_signals_from_a_mesh_and_mixed_device_kinds() -> None:
    assert Signals(DeviceMesh.cpu(2, "x")).devices == (CPU(0), CPU(1))
    # Constructing accelerator devices touches no hardware.
    assert Signals([CPU(0), Accelerator(0)]).devices == (CPU(0), Accelerator(0))


def test_signals_need_a_device() -> None:
    with pytest.raises(ShardingError, match=r"at least 1 participating device, got none"
                       ) as err:
        Signals([])
    assert isinstance(err.value, ValueError)
    assert Signals([CPU(3)]).devices == (CPU(3),)  # one device: collectives are no-ops


def test_signals_reject_repeated_devices() -> None:
    with pytest.raises(ShardingError, match=r"CPU\(1\) 2 times"):
        Signals([CPU(0), CPU(1), CPU(1)])


@pytest.mark.parametrize("bad", ["cpu:0", 0, torch.device("cpu")])
def test_signals_reject_non_devices(bad: object) -> None:
    with pytest.raises(DeviceError, match=r"entry 1 is .*not a shardwise device"):
        Signals([CPU(0), bad])  # type: ignore[list-item]


def test_signals_reject_non_iterables() -> None:
    with pytest.raises(ShardingTypeError, match="iterable of devices"):
        Signals(3)  # type: ignore[arg-type]


def test_signal_buffer_needs_a_device() -> None:
    with pytest.raises(DeviceError, match="'cpu'"):
        SignalBuffer("cpu")  # type: ignore[arg-type]


def _inputs() -> list[shardwise.Tensor]:
    return [shardwise.tensor([float(i)], device=CPU(i)) for i in range(2)]


@pytest.mark.parametrize(
    "make",
    [
        lambda s: s,
        lambda s: s.buffers(),
        lambda s: list(s.buffers()),
        lambda s: (b for b in s.buffers()),
        lambda s: [b.type for b in s.buffers()],
    ],
    ids=["Signals", "tuple", "list", "generator", "BufferTypes"],
)
def test_ops_accept_any_iterable_of_buffers(make: object) -> None:
    signals = Signals([CPU(0), CPU(1)])
    outs = ops.allgather(_inputs(), make(signals))  # type: ignore[operator]
    assert [o.to_torch().tolist() for o in outs] == [[0.0, 1.0], [0.0, 1.0]]


def test_ops_reject_bad_buffers() -> None:
    with pytest.raises(ShardingTypeError, match=r"signal_buffers\[1\] is CPU\(1\)"):
        ops.allgather(_inputs(), [SignalBuffer(CPU(0)), CPU(1)])
    with pytest.raises(ShardingTypeError, match="iterable of signal buffers"):
        ops.allgather(_inputs(), 2)  # type: ignore[arg-type]


def test_one_buffer_makes_every_collective_a_no_op() -> None:
    """Code stays generic across mesh sizes: one participant gives its input back
    (a fresh value on the same device), as a collective over one device does."""
    x = shardwise.tensor([[1.0, 2.0], [3.0, 4.0]], device=CPU(1))
    one = SignalBuffer(CPU(1))
    outs = {
        "allgather": ops.allgather([x], one),
        "allgather axis 1": ops.allgather([x], [one], axis=1),
        "allreduce.sum": ops.allreduce.sum([x], [one]),
        "reducescatter.sum": ops.reducescatter.sum([x], [one]),
        "distributed_broadcast": ops.distributed_broadcast(x, [one]),
    }
    for name, out in outs.items():
        assert len(out) == 1, name
        assert out[0].dist_device == CPU(1), name
        assert torch.equal(out[0].to_torch(), x.to_torch()), name
    with pytest.raises(ShardingError, match=r"at least 1 participating device, got none"):
        ops.allgather([x], [])
