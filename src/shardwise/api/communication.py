"""Communication ops on :class:`~shardwise.Tensor`.

Two kinds (each docstring says which):
- **Layout ops keep the global value** and change where it lives: ``shard``,
  ``all_gather``, ``all_to_all``, ``distributed_broadcast``, ``to_device``.
- **Reducing ops combine the per-device local values** over mesh axes (the
  SPMD meaning of psum): ``all_reduce``, ``reduce_scatter``. On a Partial input
  that resolves the Partial and keeps the global value.

Gradients (and forward tangents) are those of the torch ops each step is made
of, so they are exact and land in the input's layout:
all_gather <-> slice, all_to_all <-> inverse all_to_all, ppermute <-> inverse
permutation, broadcast/replicate <-> one gradient (replicas share one buffer,
so there is no N-fold overcount), all_reduce(Partial -> Replicated) <->
identity into every partial, reduce_scatter <-> all_gather, transfer <->
transfer back.
"""

from __future__ import annotations

import warnings
from typing import Any

from shardwise.api.checks import need_tensor
from shardwise.api.creation import tensor
from shardwise.api.point_to_point import ppermute
from shardwise.api.reducing import all_reduce, reduce_scatter
from shardwise.planner import Plan
from shardwise.sharding.devices import CPU, Accelerator, Device, DeviceError
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.sharding.mappings import DeviceMapping, ShardingSpec, as_layout
from shardwise.sharding.mesh import DeviceMesh, current_mesh
from shardwise.tensors.tensor import Tensor, to_layout, with_open_dims

__all__ = [
    "accelerator",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "cpu",
    "distributed_broadcast",
    "gpu",
    "plan",
    "ppermute",
    "reduce_scatter",
    "reshard",
    "shard",
    "to_device",
    "transfer_to",
]

# --- layout ops -------------------------------------------------------------------------
def shard(x: Any, mesh: DeviceMesh | None = None, dim_specs: Any = None,
          replicated_axes: set[str] | None = None, **kwargs: Any) -> Tensor:
    """Lay ``x`` out as ``dim_specs`` on ``mesh`` (layout op: global value kept).

    "Smart": from any source (host data, one device, another sharding, Partial)
    the planner picks the cheapest steps; Sharded(0)->Sharded(1) is one
    all_to_all, Partial->Sharded one reduce_scatter, Replicated->Sharded a
    local view. ``dim_specs`` is one :class:`DimSpec` (or None / axis name /
    tuple of names) per tensor dim; a PlacementMapping / NamedMapping /
    ShardingSpec is accepted too. ``partial_sum_axes=`` may be passed.

    On ``DeviceMesh(dp=2, tp=2)``, ``shard(x, mesh, ["tp", None])`` of a 4-row ``x``::

        device (dp,tp)   (0,0)    (0,1)    (1,0)    (1,1)
        block            x[0:2]   x[2:4]   x[0:2]   x[2:4]
    """
    partial_sum_axes = kwargs.pop("partial_sum_axes", None)
    if kwargs:
        raise TypeError(f"shard() got unexpected keyword arguments {sorted(kwargs)}.")
    if isinstance(dim_specs, (DeviceMapping, Layout)):
        target_mesh = dim_specs.mesh
        if mesh is not None and mesh != target_mesh:
            raise ShardingError(
                f"shard() got mesh={mesh!r} and a sharding on {target_mesh!r}: they must "
                "match. Pass one of them."
            )
        spec: Any = dim_specs
    else:
        mesh = mesh if mesh is not None else current_mesh()
        if mesh is None:
            raise ShardingError(
                "shard() needs a mesh: pass mesh= or call it inside `with mesh:`."
            )
        if dim_specs is None:
            raise ShardingError("shard() needs dim_specs: one DimSpec (or None) per tensor dim.")
        spec = ShardingSpec(mesh, dim_specs, replicated_axes or frozenset(),  # type: ignore[arg-type]
                            partial_sum_axes or frozenset())
    if not isinstance(x, Tensor):
        return tensor(x, sharding=spec)
    return with_open_dims(to_layout(x, as_layout(spec, x.ndim)), spec)


def reshard(*args: Any, **kwargs: Any) -> Tensor:
    """Deprecated: use :func:`shard`, which does smart resharding itself."""
    warnings.warn("reshard() is deprecated; use shardwise.shard() (same arguments).",
                  DeprecationWarning, stacklevel=2)
    return shard(*args, **kwargs)


def all_gather(sharded_tensor: Tensor, axis: int | None = None, **kwargs: Any) -> Tensor:
    """Un-shard tensor dim ``axis`` over every mesh axis sharding it (layout op).

    ``axis=None`` gathers every dim; negative ``axis`` counts from the end; an
    unsharded dim is a no-op; Partial axes stay Partial. Gradient: slice.

    On ``DeviceMesh(x=2)``, ``Sharded(0)`` -> ``Replicated()``::

        device      CPU(0)          CPU(1)
        before      x[0:2]          x[2:4]
        after       x (one buffer shared by both devices)
    """
    t = need_tensor(sharded_tensor, "all_gather")
    if kwargs:
        raise TypeError(f"all_gather() got unexpected keyword arguments {sorted(kwargs)}.")
    dims = list(t.dist_layout.dims)
    if axis is None:
        dims = [()] * t.ndim
    else:
        dims[normalize_dim(axis, t.ndim, "all_gather axis")] = ()
    return t.relayout(_sharded_orders(t.dist_layout.with_dims(tuple(dims))))


def _sharded_orders(layout: Layout) -> Layout:
    """``layout`` with the sequence orders of its whole dims dropped: a gathered dim
    is shown (and held) in natural order, as ``to_torch`` shows it."""
    return layout.with_orders(tuple(o for o in layout.orders if layout.dims[o.dim]))


def all_to_all(sharded_tensor: Tensor, split_axis: int, concat_axis: int, tiled: bool = True,
               axis_name: str | None = None) -> Tensor:
    """Distributed transpose (layout op): the mesh axis that shards ``concat_axis``
    moves to ``split_axis``; the global value is kept. Uneven sizes work.

    Per device this is JAX's tiled all_to_all: each device splits its block
    along ``split_axis`` into one chunk per peer and concatenates what it
    receives along ``concat_axis``. Gradient: the inverse all_to_all.

    On ``DeviceMesh(x=2)``, a 4x4 ``x`` ``Sharded(0)`` -> ``Sharded(1)``::

        device      CPU(0)          CPU(1)
        before      x[0:2, :]       x[2:4, :]
        after       x[:, 0:2]       x[:, 2:4]
    """
    t = need_tensor(sharded_tensor, "all_to_all")
    if not tiled:
        raise ShardingError(
            "all_to_all(tiled=False) stacks per-device chunks on a new dim, which has no "
            "global-layout meaning for a shardwise.Tensor. Use tiled=True here, or "
            "shard_map for per-device semantics."
        )
    split = normalize_dim(split_axis, t.ndim, "all_to_all split_axis")
    concat = normalize_dim(concat_axis, t.ndim, "all_to_all concat_axis")
    layout = t.dist_layout
    axes = layout.dims[concat]
    names = t.mesh.axis_names
    if not axes:
        raise ShardingError(
            f"all_to_all(split_axis={split_axis}, concat_axis={concat_axis}) moves the mesh "
            f"axis sharding dim {concat} to dim {split}, but dim {concat} of {t!r} is not "
            f"sharded. Shard dim {concat} first, or call shard() with the target layout."
        )
    a = axes[-1] if axis_name is None else t.mesh.axis_index(axis_name)
    if a != axes[-1]:
        raise ShardingError(
            f"all_to_all axis_name={axis_name!r}: dim {concat} of {t!r} is split over "
            f"{tuple(names[x] for x in axes)}; only its minor-most axis {names[axes[-1]]!r} "
            "can move. Pass that axis or use shard() for the target layout."
        )
    if split == concat:
        return t
    dims = list(layout.dims)
    dims[concat] = axes[:-1]
    dims[split] = (*dims[split], a)
    return t.relayout(_sharded_orders(layout.with_dims(tuple(dims))))


def distributed_broadcast(x: Any, mesh: DeviceMesh | None = None) -> Tensor:
    """Replicate ``x`` on every device of ``mesh`` (layout op; the current mesh
    when None). Replicas share one buffer on a simulated mesh. Gradient: the
    one gradient of the shared value (no N-fold overcount).

    ``distributed_broadcast(x, DeviceMesh.cpu(2, "x"))``: CPU(0) and CPU(1) both hold ``x``.
    """
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ShardingError(
            "distributed_broadcast() needs a mesh: pass mesh= or call it inside `with mesh:`."
        )
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(f"distributed_broadcast mesh must be a DeviceMesh, got {mesh!r}.")
    if not isinstance(x, Tensor):
        x = tensor(x)
    return to_layout(x, Layout.replicated(mesh, x.ndim))


def to_device(x: Any, device: Device | Any = None, *, sharding: Any = None) -> Tensor:
    """Transfer ``x`` to ``device`` or lay it out as ``sharding`` (layout op).

    Like JAX's device_put: ``to_device(x, CPU(0))`` gathers onto one device;
    ``to_device(x, sharding=spec)`` distributes. ``device`` and ``sharding`` are
    mutually exclusive; with neither, a Tensor is returned as is and host data
    goes to the default device. Differentiable: the gradient is transferred
    back to the input's layout.

    >>> x = torch.arange(4.0)
    >>> y = to_device(x, sharding=PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)]))
    >>> [s.tolist() for s in y.shards], to_device(y, CPU(1)).to_torch().tolist()
    ([[0.0, 1.0], [2.0, 3.0]], [0.0, 1.0, 2.0, 3.0])
    """
    if device is not None and sharding is not None:
        raise ShardingError(
            f"to_device() takes device= or sharding=, not both (got {device!r} and "
            f"{sharding!r}). A sharding already names its devices."
        )
    if not isinstance(x, Tensor):
        return tensor(x, device, sharding)
    if device is None and sharding is None:
        return x
    if device is not None:
        if not isinstance(device, Device):
            raise DeviceError(
                f"to_device() needs a shardwise device such as CPU(0) or Accelerator(0). "
                f"Got {device!r} ({type(device).__name__})."
            )
        layout = Layout.replicated(DeviceMesh.single(device), x.ndim)
        if x.mesh.is_single and x.mesh.devices[0] == device:
            return x
        return to_layout(x, layout)
    return with_open_dims(to_layout(x, as_layout(sharding, x.ndim)), sharding)


def transfer_to(x: Any, device: Device | Any = None, *, sharding: Any = None) -> Tensor:
    """Transfer ``x`` to ``device`` or lay it out as ``sharding``; see :func:`to_device`."""
    return to_device(x, device, sharding=sharding)


def cpu(x: Any) -> Tensor:
    """``to_device(x, CPU())``: the global value on the host."""
    return to_device(x, CPU(0))


def gpu(x: Any) -> Tensor:
    """``to_device(x, Accelerator())``; raises DeviceError naming the available
    devices when there is no accelerator."""
    return to_device(x, Accelerator(0))


def accelerator(x: Any, device_id: int = 0) -> Tensor:
    """``to_device(x, Accelerator(device_id))``."""
    return to_device(x, Accelerator(device_id))


def plan(x: Tensor, target: Any) -> Plan:
    """The steps (op, mesh axes, bytes per device) that would take ``x`` to
    ``target`` (any sharding form, same mesh), without running them.

    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> x = shardwise.zeros((8, 8), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> print(plan(x, PlacementMapping(mesh, [Sharded(1)])))
    Plan DeviceMesh(x=4)[S(x), R] -> DeviceMesh(x=4)[R, S(x)]  shape=[8, 8]
      1. all_to_all(axes=('x',), dim 0->1)  48 B/device
      total 48 B/device moved
    """
    t = need_tensor(x, "plan")
    return t.plan_to(as_layout(target, t.ndim))
