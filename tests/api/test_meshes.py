"""init_device_mesh: meshes in torch's spelling, on a machine without a GPU. What it
builds on a GPU machine is checked here by faking what torch sees (devices are values:
building a mesh never touches a GPU), and a mesh of virtual devices runs with the CPU
standing in for the GPU they share (``VirtualDevice(i, on=CPU(0))``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import shardwise as sw
from shardwise import (
    CPU,
    Accelerator,
    DeviceMesh,
    Partial,
    PlacementMapping,
    Replicated,
    Sharded,
    VirtualDevice,
)
from shardwise.api import distributed, meshes
from shardwise.sharding.devices import DeviceError, accelerator_count


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """This process sees ``gpus[0]`` CUDA devices (as far as init_device_mesh asks)."""
    seen = [1]
    monkeypatch.setattr(meshes, "accelerator_type", lambda: "cuda" if seen[0] else None)
    monkeypatch.setattr(meshes, "accelerator_count", lambda: seen[0])
    yield seen


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """An initialized world of ``world[0]`` processes (as far as init_device_mesh asks)."""
    size = [4]
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "process_count", lambda: size[0])
    return size


def test_cpu_is_a_mesh_of_virtual_cpus() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert mesh == DeviceMesh.cpu((2, 4), ("dp", "tp")) and mesh.is_simulated
    assert sw.init_device_mesh("cpu", 4).axis_names == ("dim0",)   # torch's may be unnamed
    assert sw.init_device_mesh("cpu", (2, 2), devices_per_gpu=4) == DeviceMesh.cpu(
        (2, 2), ("dim0", "dim1"))   # virtual already: device-neutral code may pass it


@pytest.mark.skipif(accelerator_count() > 0, reason="this machine has an accelerator")
def test_no_gpu_names_the_value_and_the_fix() -> None:
    with pytest.raises(DeviceError) as info:
        sw.init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
    text = str(info.value)
    assert "init_device_mesh('cuda', (2, 4))" in text and "torch sees no accelerator" in text
    assert "init_device_mesh('cpu', (2, 4), ...)" in text and "devices_per_gpu" in text


def test_one_gpu_holds_the_whole_mesh_as_virtual_devices(gpus: list[int]) -> None:
    mesh = sw.init_device_mesh("cuda", (2, 2), ("dp", "tp"), devices_per_gpu=4)
    assert mesh.devices == tuple(VirtualDevice(i, on=Accelerator(0)) for i in range(4))
    assert mesh.is_simulated and repr(mesh) == "DeviceMesh(dp=2, tp=2)"
    with pytest.raises(DeviceError, match=r"needs 4 devices, but this process sees 1 'cuda' "
                                          r"device\(s\), which hold 1 at devices_per_gpu=1"
                                          r".*Pass devices_per_gpu=4"):
        sw.init_device_mesh("cuda", (2, 2), ("dp", "tp"))


def test_several_gpus_hold_one_device_each_or_k_virtual_ones(gpus: list[int]) -> None:
    gpus[0] = 8
    assert sw.init_device_mesh("cuda", (2, 2), ("dp", "tp")).devices == tuple(
        Accelerator(i) for i in range(4))                        # the first 4 GPUs
    mesh = sw.init_device_mesh("cuda", (4,), "x", devices_per_gpu=2)
    assert [d.on for d in mesh.devices] == [Accelerator(0)] * 2 + [Accelerator(1)] * 2
    assert not mesh.is_simulated                                 # blocks move between GPUs
    with pytest.raises(DeviceError, match=r"needs 18 devices.*devices_per_gpu=3"):
        sw.init_device_mesh("cuda", (2, 9), ("dp", "tp"), devices_per_gpu=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_devices_per_gpu_is_a_positive_int(gpus: list[int], bad: object) -> None:
    with pytest.raises(sw.ShardingError, match=rf"devices_per_gpu={bad!r}\): devices_per_gpu "
                                               r"is an int >= 1.*devices_per_gpu=4 puts"):
        sw.init_device_mesh("cuda", (2, 2), devices_per_gpu=bad)  # type: ignore[arg-type]


def test_an_accelerator_this_machine_lacks_names_the_one_it_has(gpus: list[int]) -> None:
    with pytest.raises(DeviceError, match=r"init_device_mesh\('xpu', \(2,\)\): torch sees a "
                                          r"'cuda' accelerator.*or 'cuda'"):
        sw.init_device_mesh("xpu", 2)
    with pytest.raises(sw.ShardingError, match=r"device_type=3\): the device type is a string"):
        sw.init_device_mesh(3, 2)  # type: ignore[arg-type]


def test_a_world_gives_one_device_per_process(world: list[int], gpus: list[int]) -> None:
    assert sw.init_device_mesh("cpu", (2, 2), ("dp", "tp")).devices == tuple(
        CPU(i) for i in range(4))
    assert sw.init_device_mesh("cuda", (2, 2), ("dp", "tp")).devices == tuple(
        Accelerator(i) for i in range(4))                        # GPU LOCAL_RANK each
    with pytest.raises(sw.ShardingError, match=r"names 8 devices, but this run has 4 "
                                               r"processes.*torchrun --nproc-per-node 8"):
        sw.init_device_mesh("cuda", (2, 4), ("dp", "tp"))
    with pytest.raises(sw.ShardingError, match=r"each process is one device there.*Drop "
                                               r"devices_per_gpu"):
        sw.init_device_mesh("cuda", (2, 2), ("dp", "tp"), devices_per_gpu=4)


def test_a_mesh_of_virtual_devices_on_one_memory_runs_as_the_cpu_mesh() -> None:
    """The simulated runtime's path for virtual devices on one GPU, with the CPU standing
    in for the GPU: the same values and gradients as the mesh of virtual CPUs."""
    on_one = DeviceMesh(tuple(VirtualDevice(i, on=CPU(0)) for i in range(4)), (2, 2),
                        ("dp", "tp"))
    x = torch.arange(24.0).reshape(6, 4) / 7
    w = torch.arange(16.0).reshape(4, 4) / 5
    got, want = [], []
    for mesh, out in ((on_one, got), (DeviceMesh.cpu((2, 2), ("dp", "tp")), want)):
        xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
        ws = sw.tensor(w, sharding=PlacementMapping(mesh, [Replicated(), Sharded(1)]),
                       requires_grad=True)
        y = torch.nn.functional.gelu(xs @ ws)
        p = sw.tensor(x, sharding=PlacementMapping(mesh, [Partial(), Sharded(1)]))
        y.sum().backward()
        assert ws.grad is not None
        out += [y.to_torch(), ws.grad.to_torch(), sw.all_reduce(p, reduce_axes="dp").to_torch(),
                sw.all_to_all(xs, 1, 0).to_torch(), y.shards[3].device]
    assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4], strict=True))
    assert got[4] == torch.device("cpu")
