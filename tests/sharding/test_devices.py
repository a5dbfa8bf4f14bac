"""Device values: CPU, Accelerator and VirtualDevice, validation, discovery, binding to
torch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.sharding import ShardingError
from shardwise.sharding.devices import (
    CPU,
    Accelerator,
    Device,
    DeviceError,
    VirtualDevice,
    accelerator_count,
    available_devices,
    default_device,
    from_torch,
)


def test_values_and_reprs() -> None:
    assert repr(CPU(0)) == "CPU(0)"
    assert repr(CPU(7)) == "CPU(7)"
    assert repr(Accelerator(1)) == "Accelerator(1)"
    assert CPU().id == 0
    assert CPU(3).kind == "cpu"
    assert Accelerator(2).kind == "accelerator"
    assert CPU(3).label == "cpu:3"
    assert Accelerator(2).label == "accelerator:2"


def test_equality_and_hash() -> None:
    assert CPU(1) == CPU(1)
    assert CPU(1) != CPU(2)
    assert CPU(0) != Accelerator(0)
    assert len({CPU(0), CPU(0), CPU(1), Accelerator(0), Accelerator(0)}) == 3
    assert isinstance(CPU(0), Device)
    assert isinstance(Accelerator(0), Device)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPU(0).id = 1


@pytest.mark.parametrize("cls", [CPU, Accelerator])
@pytest.mark.parametrize("bad", [-1, 1.0, "0", True, None])
def test_bad_ids_raise(cls: type[Device], bad: object) -> None:
    with pytest.raises(DeviceError, match="a device id must be an int >= 0") as info:
        cls(bad)
    assert f"Got {bad!r}" in str(info.value)
    assert f"{cls.__name__}(id={bad!r})" in str(info.value)


def test_device_error_family() -> None:
    assert issubclass(DeviceError, ShardingError)
    assert issubclass(DeviceError, ValueError)
    with pytest.raises(ValueError):
        CPU(-3)


def test_cpu_to_torch() -> None:
    assert CPU(0).to_torch() == torch.device("cpu")
    assert CPU(5).to_torch() == torch.device("cpu")


def test_available_and_default_devices() -> None:
    devices = available_devices()
    assert devices[0] == CPU(0)
    assert devices[1:] == [Accelerator(i) for i in range(accelerator_count())]
    assert default_device() == CPU(0)


def test_missing_accelerator_lists_available_devices() -> None:
    missing = Accelerator(accelerator_count())
    with pytest.raises(DeviceError) as info:
        missing.to_torch()
    message = str(info.value)
    assert repr(missing) in message
    assert f"Available devices: {available_devices()}" in message
    assert "CPU(0)" in message


def test_no_accelerator_on_this_machine() -> None:
    """This test machine has no accelerator: Accelerator(0) cannot be bound."""
    if torch.cuda.is_available():  # an accelerator machine checks the other branch above
        assert accelerator_count() >= 1
        return
    assert accelerator_count() == 0
    assert available_devices() == [CPU(0)]
    with pytest.raises(DeviceError, match=r"Accelerator\(0\) does not exist.*\[CPU\(0\)\]"):
        Accelerator(0).to_torch()


def test_from_torch() -> None:
    assert from_torch("cpu") == CPU(0)
    assert from_torch(torch.device("cpu")) == CPU(0)
    assert from_torch("cuda:1") == Accelerator(1)
    assert from_torch("cuda") == Accelerator(0)
    with pytest.raises(DeviceError, match="meta"):
        from_torch("meta")
    with pytest.raises(DeviceError, match="'bogus' is not a torch device"):
        from_torch("bogus")
    with pytest.raises(DeviceError, match="None is not a torch device"):
        from_torch(None)


def test_virtual_devices_share_the_memory_of_the_device_they_are_on() -> None:
    d = VirtualDevice(3, on=Accelerator(1))
    assert repr(d) == "VirtualDevice(3, on=Accelerator(1))"
    assert (d.kind, d.label, d.memory) == ("accelerator", "accelerator:3", Accelerator(1))
    assert VirtualDevice(2) == VirtualDevice(2, on=Accelerator(0))   # on GPU 0 by default
    assert VirtualDevice(2) != VirtualDevice(2, on=Accelerator(1)) != Accelerator(2)
    assert len({VirtualDevice(0), VirtualDevice(0), VirtualDevice(1)}) == 2
    assert CPU(5).memory == CPU(0) and Accelerator(0).memory is None
    stand_in = VirtualDevice(7, on=CPU(0))   # the CPU stands in for a GPU in tests
    assert stand_in.memory == CPU(0) and stand_in.to_torch() == torch.device("cpu")


@pytest.mark.parametrize("on", [VirtualDevice(0), "cuda:0", 0])
def test_a_virtual_device_is_placed_on_a_physical_device(on: object) -> None:
    with pytest.raises(DeviceError, match=r"placed on a physical device, Accelerator\(i\)"):
        VirtualDevice(1, on=on)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="a device id must be an int >= 0"):
        VirtualDevice(-1)
