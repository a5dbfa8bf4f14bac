"""Signal buffers: which devices take part in a per-device collective.

Invariants:
- ``Signals(devices)`` is a frozen value: at least 1 (one device makes every
  collective a no-op, so code stays generic across mesh sizes), distinct devices.
- It gives one signal buffer per device, in the order given; the number of
  signal buffers passed to a collective *is* its number of participants, and
  their devices fix the order of the inputs and outputs.
- A signal buffer is a frozen :class:`SignalBuffer` (device + a
  ``BufferType(uint8, (SIGNAL_BUFFER_BYTES,), device)``); a bare
  :class:`~shardwise.sharding.BufferType` is accepted in its place. In the
  simulated runtime no memory backs them: they carry the device identity only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.sharding.devices import Device, DeviceError
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.types import BufferType

__all__ = ["SIGNAL_BUFFER_BYTES", "SignalBuffer", "Signals", "participants"]

#: Size of one signal buffer: one byte of flag per peer, for up to 64 peers.
SIGNAL_BUFFER_BYTES = 64


def _check_devices(devices: tuple[Any, ...], what: str) -> None:
    """At least 1 device (one is a no-op collective), all shardwise Devices, no repeats."""
    for i, dev in enumerate(devices):
        if not isinstance(dev, Device):
            raise DeviceError(
                f"{what}: entry {i} is {dev!r} ({type(dev).__name__}), not a shardwise device. "
                "Use CPU(i) or Accelerator(i)."
            )
    if not devices:
        raise ShardingError(
            f"{what} needs at least 1 participating device, got none. Pass one signal "
            "buffer per device, e.g. Signals([CPU(0), CPU(1)]) (one device is a no-op)."
        )
    seen: set[Device] = set()
    for dev in devices:
        if dev in seen:
            raise ShardingError(
                f"{what} lists {dev!r} {devices.count(dev)} times in {list(devices)}: each "
                "participating device must appear once. Remove the repeats."
            )
        seen.add(dev)


@dataclass(frozen=True, slots=True)
class SignalBuffer:
    """The signal buffer of one participating device (no data in the simulated runtime)."""

    device: Device

    def __post_init__(self) -> None:
        if not isinstance(self.device, Device):
            raise DeviceError(
                f"SignalBuffer device must be a shardwise device such as CPU(0). "
                f"Got {self.device!r} ({type(self.device).__name__})."
            )

    @property
    def type(self) -> BufferType:
        """``BufferType(uint8, [SIGNAL_BUFFER_BYTES], device)``."""
        return BufferType(torch.uint8, (SIGNAL_BUFFER_BYTES,), self.device)

    def __repr__(self) -> str:
        return f"SignalBuffer({self.device!r})"


@dataclass(frozen=True, slots=True)
class Signals:
    """The participants of a per-device collective: one signal buffer per device.

    >>> signals = Signals([CPU(0), CPU(1)])
    >>> signals.buffers()
    (SignalBuffer(CPU(0)), SignalBuffer(CPU(1)))
    >>> from shardwise.graph import ops
    >>> x0, x1 = (shardwise.tensor([float(i)], device=CPU(i)) for i in range(2))
    >>> [y.to_torch().tolist() for y in ops.allgather([x0, x1], signals.buffers())]
    [[0.0, 1.0], [0.0, 1.0]]

    ::

        device          CPU(0)              CPU(1)
        signal buffer   BufferType(uint8)   BufferType(uint8)
    """

    devices: tuple[Device, ...]

    def __post_init__(self) -> None:
        try:
            devices = tuple(self.devices)
        except TypeError:
            raise ShardingTypeError(
                f"Signals(devices) needs an iterable of devices, e.g. [CPU(0), CPU(1)]. "
                f"Got {self.devices!r} ({type(self.devices).__name__})."
            ) from None
        _check_devices(devices, "Signals(devices)")
        object.__setattr__(self, "devices", devices)

    def buffers(self) -> tuple[SignalBuffer, ...]:
        """One signal buffer per device, in device order."""
        return tuple(SignalBuffer(d) for d in self.devices)

    def __iter__(self) -> Iterator[SignalBuffer]:
        return iter(self.buffers())

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"Signals({list(self.devices)!r})"


def participants(signal_buffers: Iterable[Any], op: str) -> tuple[Device, ...]:
    """The devices of ``signal_buffers`` (checked: >= 1, distinct), in order."""
    if isinstance(signal_buffers, (SignalBuffer, BufferType)):
        signal_buffers = [signal_buffers]
    try:
        items = list(signal_buffers)
    except TypeError:
        raise ShardingTypeError(
            f"{op} signal_buffers must be an iterable of signal buffers (or a Signals). "
            f"Got {signal_buffers!r} ({type(signal_buffers).__name__}); use "
            "Signals(devices).buffers()."
        ) from None
    devices = []
    for i, buf in enumerate(items):
        if isinstance(buf, (SignalBuffer, BufferType)):
            devices.append(buf.device)
        else:
            raise ShardingTypeError(
                f"{op} signal_buffers[{i}] is {buf!r} ({type(buf).__name__}), not a signal "
                "buffer. Pass Signals(devices).buffers() (or BufferType values)."
            )
    _check_devices(tuple(devices), f"{op} signal_buffers")
    return tuple(devices)
