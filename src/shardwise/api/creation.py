"""Building Tensors: from data, from per-device pieces, and filled directly per shard.

Invariants:
- ``tensor(data)`` copies host data once (like ``torch.tensor``): later writes to
  the caller's array never show through. Shards are views of that copy.
- ``zeros/ones/full/arange/randn`` build each distinct shard directly at its
  local shape: no full-size host tensor is made.
- Partial targets are built from the replicated value (identity elements off
  the root for SUM/PROD), so the global value is what was asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.runtime import backend_for
from shardwise.sharding.devices import Device, DeviceError, default_device
from shardwise.sharding.errors import ShardingError, ShardingTypeError, check_items
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import as_layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.shapes import check_shape, local_bounds, local_shape
from shardwise.tensors.tensor import Tensor, as_layout_of, place, to_layout, with_open_dims

__all__ = [
    "arange",
    "as_layout_of",
    "from_local",
    "full",
    "ones",
    "place",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
]


def _target(device: Any, sharding: Any, ndim: int) -> Layout:
    if device is not None and sharding is not None:
        raise ShardingError(
            f"Give device= or sharding=, not both (got device={device!r} and "
            f"sharding={sharding!r}): a sharding already names its devices."
        )
    if sharding is not None:
        return as_layout(sharding, ndim)
    device = default_device() if device is None else device
    if not isinstance(device, Device):
        raise DeviceError(
            f"device must be a shardwise device such as CPU(0) or Accelerator(0). "
            f"Got {device!r} ({type(device).__name__})."
        )
    return Layout.replicated(DeviceMesh.single(device), ndim)


def _as_torch(data: Any, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ShardingTypeError(f"dtype must be a torch.dtype such as torch.float32. Got "
                                f"{dtype!r} ({type(dtype).__name__}).")
    if isinstance(data, torch.Tensor):
        out = data.detach().clone()
        return out if dtype is None else out.to(dtype)
    if isinstance(data, Tensor):
        raise AssertionError("handled by the caller")
    try:
        return torch.tensor(data, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ShardingError(
            f"Cannot make a tensor from {type(data).__name__} {data!r:.80}: {err}. "
            "Pass a torch.Tensor, numpy array, Python number or nested list."
        ) from None


def _leafify(t: Tensor, requires_grad: bool) -> Tensor:
    if not requires_grad:
        return t
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise ShardingTypeError(f"requires_grad=True needs a floating or complex dtype. Got "
                                f"{t.dtype}; pass dtype=torch.float32 (or cast) first.")
    return t.map_blocks(lambda s: s.detach().requires_grad_(True))


def tensor(data: Any, device: Any = None, sharding: Any = None, *,
           dtype: torch.dtype | None = None, requires_grad: bool = False) -> Tensor:
    """A Tensor holding a copy of ``data``, on ``device`` or laid out by ``sharding``.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> t = shardwise.tensor([[1., 2.], [3., 4.], [5., 6.]],
    ...                      sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> [s.tolist() for s in t.shards]
    [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]]]
    """
    if isinstance(data, Tensor):
        out = data
        if device is not None or sharding is not None:
            layout = _target(device, sharding, data.ndim)
            if layout != data.dist_layout:
                out = with_open_dims(to_layout(data, layout), sharding)
        if dtype is not None and out.dtype != dtype:
            out = out.map_blocks(lambda s: s.to(dtype))
        return _leafify(out.detach(), requires_grad) if requires_grad else out
    value = _as_torch(data, dtype)
    layout = _target(device, sharding, value.ndim)
    return with_open_dims(_leafify(place(value, layout), requires_grad), sharding)


def from_local(shards: Sequence[Any], sharding: Any, shape: Sequence[int] | None = None, *,
               requires_grad: bool = False) -> Tensor:
    """A Tensor from one local value per mesh device (row-major), laid out by ``sharding``.

    Replicas (devices differing only on replicated axes) must hold equal
    values; the first one along each replicated axis is used. ``shape`` is the
    global shape; if omitted it is derived, assuming an even split.

    The Tensor **shares** the given local tensors (no copy; one already on its
    device is used as is, like DTensor's ``from_local``). shardwise never writes
    to them, but writing to them afterwards changes the Tensor's value: pass
    ``[s.clone() for s in shards]`` if you keep writing to yours.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> t = from_local([torch.ones(2), torch.zeros(1)], PlacementMapping(mesh, [Sharded(0)]),
    ...                shape=(3,))
    >>> t.to_torch().tolist()
    [1.0, 1.0, 0.0]
    """
    items = list(check_items(shards, "from_local shards", "a list with one local tensor "
                             "per mesh device (row-major)"))
    if not any(s is not None for s in items):
        raise ShardingError("from_local needs one local value per mesh device; got none.")
    locals_ = [s if isinstance(s, torch.Tensor) or s is None else _as_torch(s, None)
               for s in items]
    present = [s for s in locals_ if s is not None]
    ndim = present[0].ndim
    layout = as_layout(sharding, ndim)
    mesh = layout.mesh
    if len(locals_) != mesh.num_devices:
        raise ShardingError(
            f"from_local got {len(locals_)} local values for {mesh!r} with "
            f"{mesh.num_devices} devices: give one per device, row-major."
        )
    if shape is None:
        full_shape = list(present[0].shape)
        for d, axes in enumerate(layout.dims):
            for a in axes:
                full_shape[d] *= mesh.mesh_shape[a]
        shape = tuple(full_shape)
    shape = check_shape(shape, "from_local shape")
    reps = layout.representatives()
    dtype = present[0].dtype
    backend = backend_for(mesh)
    mine = set(backend.owned(mesh))
    out: list[torch.Tensor | None] = []
    for k, (dev, r) in enumerate(zip(mesh.devices, reps)):
        t = locals_[r] if locals_[r] is not None else locals_[k]
        if k not in mine:
            out.append(None)
            continue
        if t is None:
            raise ShardingError(
                f"from_local: no local value for {dev!r}, which this process holds. Pass a "
                "tensor for every device this process owns (None only for the others)."
            )
        want = local_shape(shape, layout, mesh.coord_of(k))
        if tuple(t.shape) != want or t.dtype != dtype:
            raise ShardingError(
                f"from_local: device {dev!r} (coordinate {mesh.coord_of(k)}) holds shape "
                f"{tuple(t.shape)} dtype {t.dtype}, but global shape {shape} laid out as "
                f"{layout} puts shape {want} dtype {dtype} there (split rule: "
                "g // n + (1 if k < g % n else 0))."
            )
        target = backend.device_of(mesh, k)
        out.append(t if t.device == target else t.to(target))
    return with_open_dims(_leafify(Tensor(out, layout, shape, dtype), requires_grad), sharding)


def _filled(shape: Sequence[int] | int, make: Callable[[tuple[int, ...], Any, tuple[
        tuple[int, int], ...], int], torch.Tensor], device: Any, sharding: Any,
            requires_grad: bool) -> Tensor:
    shape = check_shape(shape)
    layout = _target(device, sharding, len(shape))
    mesh = layout.mesh
    plain = layout.without_partial()
    reps = plain.representatives()
    backend = backend_for(mesh)
    mine = set(backend.owned(mesh))
    built: dict[int, torch.Tensor] = {}
    for k in sorted(mine):
        r = reps[k]
        if r not in built:
            coord = mesh.coord_of(r)
            built[r] = make(local_shape(shape, plain, coord), backend.device_of(mesh, k),
                            local_bounds(shape, plain, coord), r)
    t = Tensor([built[reps[k]] if k in mine else None for k in range(mesh.num_devices)],
               plain, shape,
               next(iter(built.values())).dtype if built else torch.get_default_dtype())
    if layout.is_partial:
        t = t.relayout(layout)
    return with_open_dims(_leafify(t, requires_grad), sharding)


def full(shape: Sequence[int] | int, fill_value: Any, *, dtype: torch.dtype | None = None,
         device: Any = None, sharding: Any = None, requires_grad: bool = False) -> Tensor:
    """A Tensor of ``shape`` filled with ``fill_value``, each shard made in place.

    >>> full((4,), 7.0, sharding=PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)]))
    Tensor(shape=(4,), dtype=float32, layout=DeviceMesh(x=2)[S(x)])
    """
    return _filled(shape, lambda s, dev, b, r: torch.full(s, fill_value, dtype=dtype,
                                                           device=dev),
                   device, sharding, requires_grad)


def zeros(shape: Sequence[int] | int, *, dtype: torch.dtype | None = None, device: Any = None,
          sharding: Any = None, requires_grad: bool = False) -> Tensor:
    """A Tensor of zeros; see :func:`full`."""
    return _filled(shape, lambda s, dev, b, r: torch.zeros(s, dtype=dtype, device=dev),
                   device, sharding, requires_grad)


def ones(shape: Sequence[int] | int, *, dtype: torch.dtype | None = None, device: Any = None,
         sharding: Any = None, requires_grad: bool = False) -> Tensor:
    """A Tensor of ones; see :func:`full`."""
    return _filled(shape, lambda s, dev, b, r: torch.ones(s, dtype=dtype, device=dev),
                   device, sharding, requires_grad)


def arange(end: int, *, dtype: torch.dtype | None = None, device: Any = None,
           sharding: Any = None, requires_grad: bool = False) -> Tensor:
    """``[0, 1, ..., end - 1]``; each shard computes only its own range.

    >>> arange(5, sharding=PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)])).shards
    (tensor([0, 1, 2]), tensor([3, 4]))
    """
    return _filled((end,), lambda s, dev, b, r: torch.arange(b[0][0], b[0][1], dtype=dtype,
                                                             device=dev),
                   device, sharding, requires_grad)


def randn(shape: Sequence[int] | int, *, seed: int = 0, dtype: torch.dtype | None = None,
          device: Any = None, sharding: Any = None, requires_grad: bool = False) -> Tensor:
    """Standard normal values; each distinct block is drawn from its own generator
    seeded by ``(seed, device index)``, so values depend on the layout. For
    values independent of the layout use ``tensor(torch.randn(...), sharding=...)``.
    """
    def make(s: tuple[int, ...], dev: Any, b: Any, r: int) -> torch.Tensor:
        gen = torch.Generator(device=dev).manual_seed(hash((seed, r)) & 0x7FFF_FFFF)
        return torch.randn(s, generator=gen, dtype=dtype, device=dev)

    return _filled(shape, make, device, sharding, requires_grad)


def zeros_like(t: Tensor) -> Tensor:
    """Zeros in ``t``'s layout (no Partial axes: zeros reduce to zeros by SUM)."""
    return t.map_blocks(torch.zeros_like)
