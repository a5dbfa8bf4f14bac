"""Device values: ``CPU(id)``, ``Accelerator(id)`` and ``VirtualDevice(id, on)``, and
discovery of what exists.

Invariants:
- Devices are frozen, hashable values; constructing one never touches hardware.
- ``CPU(i)`` for any ``i`` is a *virtual* CPU device: all virtual CPU devices of
  one process share host memory, which is what a simulated mesh is made of.
- ``Accelerator(i)`` names the ``i``-th device of torch's current accelerator
  (CUDA, ROCm, XPU, MPS ...). Binding it to a ``torch.device`` checks that it
  exists and otherwise raises :class:`DeviceError` listing what does exist.
- ``VirtualDevice(i, on=Accelerator(g))`` is a virtual device whose blocks live on
  accelerator ``g``, beside the other virtual devices there: the simulated mesh on
  one GPU. Its ``memory`` (the physical device it shares) is what tells a mesh whose
  blocks never move between torch devices (``DeviceMesh.is_simulated``).
- torch is imported lazily, only by the functions that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.sharding.errors import ShardingError

__all__ = [
    "CPU",
    "Accelerator",
    "Device",
    "VirtualDevice",
    "DeviceError",
    "accelerator_count",
    "accelerator_type",
    "available_devices",
    "default_device",
    "from_torch",
]


class DeviceError(ShardingError):
    """A device was asked for that does not exist here, or a value is not a device."""


@dataclass(frozen=True, slots=True)
class Device:
    """Base of the device values. ``kind`` is ``"cpu"`` or ``"accelerator"``."""

    id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0:
            raise DeviceError(
                f"{type(self).__name__}(id={self.id!r}): a device id must be an int >= 0. "
                f"Got {self.id!r}; use e.g. {type(self).__name__}(0)."
            )

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def label(self) -> str:
        """Short label used in visualisations, e.g. ``cpu:3``."""
        return f"{self.kind}:{self.id}"

    @property
    def memory(self) -> Device | None:
        """The physical device whose memory this virtual device shares with the other
        virtual devices on it (``CPU(0)`` for every ``CPU(i)``); None for a physical
        device of its own (an :class:`Accelerator`)."""
        raise NotImplementedError

    def to_torch(self) -> Any:
        """The ``torch.device`` this device's data lives on."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id})"


@dataclass(frozen=True, slots=True, repr=False)
class CPU(Device):
    """A (virtual) CPU device. Every ``CPU(i)`` of one process uses host memory."""

    @property
    def kind(self) -> str:
        return "cpu"

    @property
    def memory(self) -> Device:
        return CPU(0)

    def to_torch(self) -> Any:
        import torch

        return torch.device("cpu")


@dataclass(frozen=True, slots=True, repr=False)
class Accelerator(Device):
    """The ``id``-th device of torch's current accelerator (``cuda:0``, ``xpu:1``, ...)."""

    @property
    def kind(self) -> str:
        return "accelerator"

    @property
    def memory(self) -> None:
        return None

    def to_torch(self) -> Any:
        import torch

        count = accelerator_count()
        if self.id >= count:
            raise DeviceError(
                f"{self!r} does not exist: this machine has {count} accelerator(s) "
                f"({accelerator_type() or 'none found by torch'}). "
                f"Available devices: {available_devices()}. "
                "Use CPU devices (e.g. DeviceMesh.cpu(...)) or run where an accelerator exists."
            )
        return torch.device(accelerator_type() or "cuda", self.id)


@dataclass(frozen=True, slots=True, repr=False)
class VirtualDevice(Device):
    """Virtual device ``id`` whose blocks live on the physical device ``on``, beside the
    other virtual devices placed there: k of them on one GPU run a mesh of k devices
    on that GPU (``init_device_mesh(..., devices_per_gpu=k)``). ``on`` is an
    :class:`Accelerator` (or ``CPU(0)``, which stands in for one in tests).

    >>> d = VirtualDevice(3, on=Accelerator(0))
    >>> d, d.kind, d.memory
    (VirtualDevice(3, on=Accelerator(0)), 'accelerator', Accelerator(0))
    """

    on: Device = Accelerator(0)

    def __post_init__(self) -> None:
        Device.__post_init__(self)
        if not isinstance(self.on, (CPU, Accelerator)):
            raise DeviceError(
                f"VirtualDevice(id={self.id!r}, on={self.on!r}): a virtual device is placed "
                "on a physical device, Accelerator(i) (or CPU(0)). Got "
                f"{type(self.on).__name__}; use e.g. VirtualDevice({self.id}, "
                "on=Accelerator(0)).")

    @property
    def kind(self) -> str:
        return self.on.kind

    @property
    def memory(self) -> Device:
        return self.on.memory or self.on

    def to_torch(self) -> Any:
        return self.on.to_torch()

    def __repr__(self) -> str:
        return f"VirtualDevice({self.id}, on={self.on!r})"


def accelerator_type() -> str | None:
    """torch's current accelerator type (``"cuda"``, ``"xpu"``, ``"mps"``...) or None."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        current = acc.current_accelerator()
        return None if current is None else str(current.type)
    if torch.cuda.is_available():
        return "cuda"
    return None


def accelerator_count() -> int:
    """How many accelerator devices torch can see in this process."""
    import torch

    if accelerator_type() is None:
        return 0
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return int(acc.device_count())
    return int(torch.cuda.device_count())


def available_devices() -> list[Device]:
    """``[CPU(0)]`` plus every accelerator torch can see."""
    return [CPU(0), *(Accelerator(i) for i in range(accelerator_count()))]


def default_device() -> Device:
    """Where host data goes when no device is named: ``CPU(0)``.

    Accelerators are only used when asked for, so a program behaves the same
    on a laptop and on a GPU machine until it opts in.
    """
    return CPU(0)


def from_torch(device: Any) -> Device:
    """The shardwise device for a ``torch.device`` (or its string)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(
            f"{device!r} is not a torch device: {err}. Use e.g. 'cpu', 'cuda:0' or a "
            "torch.device."
        ) from None
    if dev.type == "cpu":
        return CPU(0)
    if dev.type == "meta":
        raise DeviceError(f"torch device {dev} holds no data; it has no shardwise device.")
    return Accelerator(dev.index or 0)
