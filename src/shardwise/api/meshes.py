"""Meshes over accelerators as torch users build them: :func:`init_device_mesh`.

Invariants:
- One call gives the mesh the run has: under torchrun (or any initialized world) one
  device per process, device ``i`` being process ``i`` (on ``"cuda"`` its GPU is
  ``LOCAL_RANK``); in one process a simulated mesh: virtual CPUs for ``"cpu"``, one
  device per visible GPU for an accelerator, or ``devices_per_gpu`` virtual devices on
  each GPU (``VirtualDevice``), so one GPU runs a whole mesh.
- Launched by torchrun and not yet initialized, it starts the world first (NCCL for
  ``"cuda"``, Gloo for ``"cpu"``), as torch's ``init_device_mesh`` does.
- Every refusal names the value, the rule and the fix; nothing touches a GPU while
  the mesh is built (devices are values).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from shardwise.sharding.devices import (
    CPU,
    Accelerator,
    DeviceError,
    VirtualDevice,
    accelerator_count,
    accelerator_type,
)
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["init_device_mesh"]


def init_device_mesh(device_type: str, mesh_shape: Sequence[int] | int,
                     mesh_dim_names: Sequence[str] | str | None = None, *,
                     devices_per_gpu: int | None = None) -> DeviceMesh:
    """A mesh of ``device_type`` devices (``"cpu"``, ``"cuda"`` or torch's current
    accelerator type), in torch's spelling.

    Args:
        device_type: ``"cpu"`` or the accelerator torch sees (``"cuda"``...).
        mesh_shape: the size of each mesh axis, e.g. ``(2, 4)``.
        mesh_dim_names: one name per axis, e.g. ``("dp", "tp")`` (default
            ``"dim0"``, ``"dim1"``...).
        devices_per_gpu: in one process, place this many virtual devices on each GPU
            (device ``i`` on GPU ``i // devices_per_gpu``): ``(2, 2)`` with
            ``devices_per_gpu=4`` runs the whole mesh on ``cuda:0``. Default: one
            device per GPU. (A ``"cpu"`` mesh is virtual devices already: there it
            changes nothing, so device-neutral code may pass it.)

    Returns:
        Under torchrun (the world is started here if it is not yet) a mesh over the
        ``world_size`` processes; in one process a simulated mesh.

    >>> init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    DeviceMesh(dp=2, tp=2)

    ::

        device   CPU(0)  CPU(1)  CPU(2)  CPU(3)
        (dp,tp)  (0,0)   (0,1)   (1,0)   (1,1)

    On one GPU, ``init_device_mesh("cuda", (2, 2), ("dp", "tp"), devices_per_gpu=4)``
    holds ``VirtualDevice(0..3, on=Accelerator(0))``, all on ``cuda:0``.
    """
    # a mesh of virtual CPUs validates the shape and names (and is the 'cpu' answer)
    cpu = DeviceMesh.cpu(mesh_shape, _default_names(mesh_shape) if mesh_dim_names is None
                         else mesh_dim_names)
    shape, names = cpu.mesh_shape, cpu.axis_names
    acc = _check_type(device_type, shape)
    _check_per_gpu(devices_per_gpu, device_type, shape)
    if _started(device_type):
        return _process_mesh(device_type, shape, names,
                             None if acc is None else devices_per_gpu)
    if acc is None:   # (virtual CPUs already: devices_per_gpu changes nothing)
        return cpu
    n, per, count = math.prod(shape), devices_per_gpu or 1, accelerator_count()
    if n > per * count:
        raise DeviceError(
            f"init_device_mesh({device_type!r}, {shape}) needs {n} devices, but this "
            f"process sees {count} {device_type!r} device(s), which hold {per * count} at "
            f"devices_per_gpu={per}: "
            "a simulated mesh in one process places at most devices_per_gpu devices on "
            f"each visible GPU. Pass devices_per_gpu={math.ceil(n / count)} (virtual "
            f"devices sharing each GPU), or launch one process per GPU (torchrun "
            f"--nproc-per-node {n}).")
    if devices_per_gpu is None:
        return DeviceMesh(tuple(Accelerator(i) for i in range(n)), shape, names)
    return DeviceMesh(tuple(VirtualDevice(i, on=Accelerator(i // per)) for i in range(n)),
                      shape, names)


def _default_names(mesh_shape: object) -> tuple[str, ...]:
    """torch's meshes may go unnamed; ours name every axis: ``dim0``, ``dim1``..."""
    try:
        axes = 1 if isinstance(mesh_shape, int) else len(mesh_shape)  # type: ignore[arg-type]
    except TypeError:
        axes = 1   # (DeviceMesh.cpu then names the bad shape)
    return tuple(f"dim{a}" for a in range(axes))


def _check_type(device_type: object, shape: tuple[int, ...]) -> str | None:
    """None for ``"cpu"``, the accelerator type for an accelerator this machine has;
    otherwise an error naming what exists and the fix."""
    if device_type == "cpu":
        return None
    acc = accelerator_type()
    if isinstance(device_type, str) and device_type == acc:
        return acc
    if not isinstance(device_type, str):
        raise ShardingError(
            f"init_device_mesh(device_type={device_type!r}): the device type is a string, "
            "'cpu' or an accelerator type such as 'cuda'.")
    found = f"torch sees a {acc!r} accelerator" if acc else "torch sees no accelerator"
    raise DeviceError(
        f"init_device_mesh({device_type!r}, {shape}): {found} in this process, so there "
        f"are no {device_type!r} devices to build the mesh on. Use "
        f"init_device_mesh('cpu', {shape}, ...) for a simulated mesh of virtual CPUs"
        + (f", or '{acc}'" if acc else "") + "; for GPUs run where torch.cuda.is_available() "
        "is True (and, in one process, devices_per_gpu=k to place k virtual devices on "
        "each GPU).")


def _check_per_gpu(devices_per_gpu: object, device_type: str, shape: tuple[int, ...]) -> None:
    if devices_per_gpu is None:
        return
    if (isinstance(devices_per_gpu, bool) or not isinstance(devices_per_gpu, int)
            or devices_per_gpu < 1):
        raise ShardingError(
            f"init_device_mesh({device_type!r}, {shape}, devices_per_gpu="
            f"{devices_per_gpu!r}): devices_per_gpu is an int >= 1, the virtual devices "
            f"placed on each GPU; e.g. devices_per_gpu={math.prod(shape)} puts the whole "
            "mesh on one GPU.")


def _started(device_type: str) -> bool:
    """Whether the mesh is over processes: a world runs, or torchrun launched this
    process (then the world is started here, on the backend ``device_type`` needs)."""
    from shardwise.api import distributed

    if distributed.is_initialized():
        return True
    if "RANK" not in os.environ:
        return False
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(device_type)
    return distributed.maybe_initialize(**({"backend": backend} if backend else {}))


def _process_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                  devices_per_gpu: int | None) -> DeviceMesh:
    from shardwise.api import distributed

    world, n = distributed.process_count(), math.prod(shape)
    if devices_per_gpu is not None:
        raise ShardingError(
            f"init_device_mesh({device_type!r}, {shape}, devices_per_gpu={devices_per_gpu}) "
            f"in a world of {world} processes: each process is one device there, and "
            "virtual devices exist only in a simulated mesh (one process). Drop "
            "devices_per_gpu, or run without torchrun.")
    if n != world:
        raise ShardingError(
            f"init_device_mesh({device_type!r}, {shape}) names {n} devices, but this run has "
            f"{world} processes (one device each): the mesh's size must equal the world "
            f"size. Use a mesh_shape whose product is {world}, or launch {n} processes "
            f"(torchrun --nproc-per-node {n}).")
    kind = CPU if device_type == "cpu" else Accelerator
    return DeviceMesh(tuple(kind(i) for i in range(n)), shape, names)
