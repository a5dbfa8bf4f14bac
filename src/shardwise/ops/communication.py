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

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

from shardwise.creation import place, tensor
from shardwise.debug import comm
from shardwise.devices import CPU, Accelerator, Device, DeviceError
from shardwise.planner import Plan, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime.simulated import rep_indices
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.sharding.mappings import DeviceMapping, ShardingSpec, as_layout
from shardwise.sharding.mesh import DeviceMesh, current_mesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.tensors import Tensor, run_plan, with_open_dims

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


def _need_tensor(x: Any, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ShardingTypeError(
            f"{op} needs a shardwise.Tensor, got {type(x).__name__}. Make one with "
            "shardwise.tensor(data, sharding=...) first."
        )
    return x


def _cross_mesh(x: Tensor, layout: Layout) -> Tensor:
    """``x``'s global value laid out on another mesh (differentiable)."""
    return place(x._global(), layout)


def _to_layout(x: Tensor, layout: Layout) -> Tensor:
    if layout.mesh == x.mesh:
        return x.relayout(layout)
    return _cross_mesh(x, layout)


def _mesh_axes(mesh: DeviceMesh, axes: Any, what: str) -> tuple[int, ...]:
    if isinstance(axes, (str, int)):
        axes = (axes,)
    out = tuple(mesh.axis_index(a) for a in axes)
    if len(set(out)) != len(out):
        names = [mesh.axis_names[a] for a in out]
        raise ShardingError(f"{what} names a mesh axis twice: {names}. Name each axis once.")
    return out


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
        spec = ShardingSpec(mesh, dim_specs, frozenset(replicated_axes or ()),
                            frozenset(partial_sum_axes or ()))
    if not isinstance(x, Tensor):
        return tensor(x, sharding=spec)
    return with_open_dims(_to_layout(x, as_layout(spec, x.ndim)), spec)


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
    t = _need_tensor(sharded_tensor, "all_gather")
    if kwargs:
        raise TypeError(f"all_gather() got unexpected keyword arguments {sorted(kwargs)}.")
    dims = list(t.layout.dims)
    if axis is None:
        dims = [()] * t.ndim
    else:
        dims[normalize_dim(axis, t.ndim, "all_gather axis")] = ()
    return t.relayout(t.layout.with_dims(tuple(dims)))


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
    t = _need_tensor(sharded_tensor, "all_to_all")
    if not tiled:
        raise ShardingError(
            "all_to_all(tiled=False) stacks per-device chunks on a new dim, which has no "
            "global-layout meaning for a shardwise.Tensor. Use tiled=True here, or "
            "shard_map for per-device semantics."
        )
    split = normalize_dim(split_axis, t.ndim, "all_to_all split_axis")
    concat = normalize_dim(concat_axis, t.ndim, "all_to_all concat_axis")
    layout = t.layout
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
    return t.relayout(layout.with_dims(tuple(dims)))


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
    return _to_layout(x, Layout.replicated(mesh, x.ndim))


def to_device(x: Any, device: Device | Any = None, *, sharding: Any = None) -> Tensor:
    """Transfer ``x`` to ``device`` or lay it out as ``sharding`` (layout op).

    Like JAX's device_put: ``to_device(x, CPU(0))`` gathers onto one device;
    ``to_device(x, sharding=spec)`` distributes. ``device`` and ``sharding`` are
    mutually exclusive; with neither, a Tensor is returned as is and host data
    goes to the default device. Differentiable: the gradient is transferred
    back to the input's layout.

    >>> y = to_device(x, sharding=PlacementMapping(DeviceMesh.cpu(2, "x"), [Sharded(0)]))
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
        return _to_layout(x, layout)
    return with_open_dims(_to_layout(x, as_layout(sharding, x.ndim)), sharding)


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

    >>> print(plan(x, PlacementMapping(mesh, [Sharded(1)])))   # doctest: +SKIP
    Plan DeviceMesh(x=4)[S(x), R] -> DeviceMesh(x=4)[R, S(x)]  shape=[8, 8]
      1. all_to_all(axes=('x',), dim 0->1)  48 B/device
    """
    t = _need_tensor(x, "plan")
    return t.plan_to(as_layout(target, t.ndim))


# --- reducing ops -----------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _partial_layout(layout: Layout, shape: tuple[int, ...], axes: tuple[int, ...],
                    op: ReduceOp | None, what: str) -> tuple[Layout, tuple[int, ...],
                                                             tuple[int, ...]]:
    """Reinterpret the local values along ``axes`` as Partial (no data moves): the
    layout, global shape and replicated axes to relabel. Partial axes keep their op
    unless ``op`` is given; replicated and sharded axes become Partial(op or SUM). A
    sharded dim shrinks to its local size, which must be the same on every device."""
    mesh = layout.mesh
    out_shape = list(shape)
    dims = [list(d) for d in layout.dims]
    partial = list(layout.partial)
    names = mesh.axis_names
    for a in axes:
        if partial[a] is not None:
            partial[a] = op or partial[a]
            continue
        d = layout.dim_of_axis(a)
        if d is not None:
            pieces = 1
            for x in layout.dims[d]:
                pieces *= mesh.mesh_shape[x]
            # the input's split (not ``out_shape``, already shrunk by earlier axes of this dim)
            if shape[d] % pieces:
                raise ShardingError(
                    f"{what} over mesh axis {names[a]!r} combines the local blocks of dim {d}, "
                    f"but dim {d} (size {shape[d]}) is split unevenly into {pieces} pieces, "
                    "so the blocks differ in shape. Make the dim divisible, or all_gather it "
                    "first."
                )
            out_shape[d] //= mesh.mesh_shape[a]
            dims[d].remove(a)
        partial[a] = op or ReduceOp.SUM
    new = Layout(mesh, tuple(tuple(d) for d in dims), tuple(partial))
    split = tuple(a for a in axes if layout.partial[a] is None and layout.dim_of_axis(a) is None)
    return new, tuple(out_shape), split


def _relabelled(t: Tensor, split: tuple[int, ...], op: ReduceOp | None) -> Sequence[Any]:
    # Replicated axes split into independent partials: their gradient is the sum
    # over the replicas, which the backend installs here.
    if not split:
        return t.shards
    return backend_for(t.mesh).relabel(t.shards, t.layout, split, op or ReduceOp.SUM)


@functools.lru_cache(maxsize=4096)
def _reduced_target(layout: Layout, axes: tuple[int, ...], scatter_dim: int | None) -> Layout:
    """Target of all_reduce (``scatter_dim`` None) or reduce_scatter: ``axes`` no
    longer Partial, and for reduce_scatter appended minor-most to ``scatter_dim``."""
    partial = tuple(None if a in axes else o for a, o in enumerate(layout.partial))
    if scatter_dim is None:
        return layout.with_partial(partial)
    dims = list(layout.dims)
    dims[scatter_dim] = (*dims[scatter_dim], *axes)
    return Layout(layout.mesh, tuple(dims), partial)


@functools.lru_cache(maxsize=4096)
def _reduce_recipe(layout: Layout, shape: tuple[int, ...], axes: tuple[int, ...],
                   op: ReduceOp | None, what: str, scatter_dim: int | None, itemsize: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...], Layout, Plan]:
    """Everything a reducing op decides from its input's type, computed once: the
    replicated axes to relabel, the result's shape and layout, and the plan."""
    new, out_shape, split = _partial_layout(layout, shape, axes, op, what)
    target = _reduced_target(new, axes, scatter_dim)
    return split, out_shape, target, make_plan(new, target, out_shape, itemsize)


def _reduce(t: Tensor, axes: tuple[int, ...], op: ReduceOp | None, what: str,
            scatter_dim: int | None) -> Tensor:
    """The reducing ops' one path: relabel, then run the cached plan (one result
    Tensor, no intermediate Partial Tensor: this is per-op overhead)."""
    split, shape, target, plan = _reduce_recipe(t.layout, t.shape, axes, op, what,
                                                scatter_dim, t.dtype.itemsize)
    return Tensor(run_plan(t.mesh, plan, _relabelled(t, split, op)), target, shape, t.dtype)


def _reduce_args(t: Tensor, reduce_axes: Any, reduce_op: Any,
                 what: str) -> tuple[tuple[int, ...], ReduceOp | None]:
    if reduce_axes is None:
        axes = t.layout.partial_axes or tuple(range(t.mesh.ndim))
    else:
        axes = _mesh_axes(t.mesh, reduce_axes, f"{what} reduce_axes")
    op = None if reduce_op is None else ReduceOp.parse(reduce_op)
    return axes, op


def all_reduce(sharded_tensor: Tensor, *, reduce_axes: Any = None, reduce_op: Any = None,
               **kwargs: Any) -> Tensor:
    """Combine the local values over mesh axes ``reduce_axes`` by ``reduce_op``
    (reducing op); the result is Replicated over those axes.

    On a Partial input this resolves the Partial: the global value is kept.
    On a Replicated or Sharded input it combines the local values, as JAX's
    psum does: on ``DeviceMesh(x=2)`` a Replicated ``v`` becomes ``2 * v``; a
    ``Sharded(0)`` ``[a, b]`` becomes the Replicated ``[a + b]``. Defaults:
    ``reduce_axes`` = the Partial axes if any, else every mesh axis;
    ``reduce_op`` = the Partial's op, else SUM. Any of SUM/AVG/MIN/MAX/PROD.
    Gradient of Partial(sum) -> Replicated: the identity into every partial.

        device      CPU(0)      CPU(1)
        before      p0          p1          Partial('sum')
        after       p0 + p1     p0 + p1     Replicated (one shared buffer)
    """
    t = _need_tensor(sharded_tensor, "all_reduce")
    if kwargs:
        raise TypeError(f"all_reduce() got unexpected keyword arguments {sorted(kwargs)}.")
    axes, op = _reduce_args(t, reduce_axes, reduce_op, "all_reduce")
    return _reduce(t, axes, op, "all_reduce", None)


def reduce_scatter(sharded_tensor: Tensor, axis: int, *, reduce_axes: Any = None,
                   reduce_op: Any = None, **kwargs: Any) -> Tensor:
    """Combine the local values over ``reduce_axes`` (as :func:`all_reduce`) and
    scatter the result: those mesh axes then shard tensor dim ``axis``
    (appended minor-most, in the order given). Uneven sizes follow the split
    rule. Gradient: all_gather.

        device      CPU(0)          CPU(1)
        before      p0              p1              Partial('sum'), 4 rows
        after       (p0+p1)[0:2]    (p0+p1)[2:4]    Sharded(0)
    """
    t = _need_tensor(sharded_tensor, "reduce_scatter")
    if kwargs:
        raise TypeError(f"reduce_scatter() got unexpected keyword arguments {sorted(kwargs)}.")
    d = normalize_dim(axis, t.ndim, "reduce_scatter axis")
    axes, op = _reduce_args(t, reduce_axes, reduce_op, "reduce_scatter")
    return _reduce(t, axes, op, "reduce_scatter", d)


# --- point to point ----------------------------------------------------------------------
def _check_permutation(permutation: Any, n: int, where: str) -> dict[int, int]:
    try:
        pairs = [tuple(p) for p in permutation]
    except TypeError:
        raise ShardingError(
            f"ppermute permutation must be a list of (src, dst) pairs. Got {permutation!r}."
        ) from None
    dst_to_src: dict[int, int] = {}
    seen_src: set[int] = set()
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(i, int) and not isinstance(i, bool)
                                     for i in pair):
            raise ShardingError(
                f"ppermute permutation entries are (src, dst) pairs of ints. Got {pair!r}."
            )
        src, dst = pair
        for i in (src, dst):
            if not 0 <= i < n:
                raise ShardingError(
                    f"ppermute pair {pair!r}: index {i} is out of range; {where} has {n} "
                    f"devices, so indices must be in [0, {n})."
                )
        if src in seen_src:
            raise ShardingError(
                f"ppermute sends from device {src} twice in {pairs!r}: each source must "
                "appear once."
            )
        if dst in dst_to_src:
            raise ShardingError(
                f"ppermute sends to device {dst} twice in {pairs!r}: each destination must "
                "appear once."
            )
        seen_src.add(src)
        dst_to_src[dst] = src
    return dst_to_src


@functools.lru_cache(maxsize=1024)
def _ppermute_sources(layout: Layout, shape: tuple[int, ...], permutation: Any,
                      axis_name: str | None) -> tuple[int | None, ...]:
    """Validated ``source[k]`` (the device whose block device ``k`` receives) for a
    permutation on a layout; cached, since validation walks every device."""
    mesh = layout.mesh
    if axis_name is None:
        src_of = _check_permutation(permutation, mesh.num_devices, repr(mesh))
        source = [src_of.get(k) for k in range(mesh.num_devices)]
    else:
        a = mesh.axis_index(axis_name)
        src_of = _check_permutation(permutation, mesh.mesh_shape[a],
                                    f"mesh axis {mesh.axis_names[a]!r}")
        source = []
        for k in range(mesh.num_devices):
            coord = list(mesh.coord_of(k))
            s = src_of.get(coord[a])
            if s is None:
                source.append(None)
            else:
                coord[a] = s
                source.append(mesh.index_of(coord))
    reps = rep_indices(layout)
    for k, src in enumerate(source):
        want = local_shape(shape, layout, mesh.coord_of(k))
        r = reps[k]
        if r != k:
            rs = source[r]
            if (src is None) != (rs is None) or (
                    src is not None and rs is not None and reps[src] != reps[rs]):
                axes = [mesh.axis_names[x] for x in range(mesh.ndim)
                        if mesh.coord_of(k)[x] != mesh.coord_of(r)[x]]
                raise ShardingError(
                    f"ppermute {list(permutation)!r} would give replicas along mesh axes "
                    f"{axes} different values (device {r} receives from {rs}, device {k} from "
                    f"{src}), but the layout {layout} holds them Replicated. Permute along a "
                    "sharded axis, or use a permutation that keeps replicas equal."
                )
            continue
        if src is not None:
            got = local_shape(shape, layout, mesh.coord_of(src))
            if got != want:
                raise ShardingError(
                    f"ppermute sends device {src}'s block of shape {got} to device {k}, "
                    f"whose block in layout {layout} has shape {want}: uneven shards cannot "
                    "trade places. Make the sharded dims divisible by the mesh axis sizes."
                )
    return tuple(source)


def ppermute(sharded_tensor: Tensor, permutation: Sequence[tuple[int, int]],
             axis_name: str | None = None) -> Tensor:
    """Point-to-point permutation: for each ``(src, dst)`` pair, device ``dst``
    receives device ``src``'s local value; devices that receive nothing get
    zeros. Indices are flat over the mesh, or positions along ``axis_name``.
    The layout is kept. Gradient: the inverse permutation.

    On ``DeviceMesh(x=2)``, ``Sharded(0)``, ``permutation=[(0, 1), (1, 0)]``::

        device      CPU(0)      CPU(1)
        before      x[0:2]      x[2:4]
        after       x[2:4]      x[0:2]
    """
    t = _need_tensor(sharded_tensor, "ppermute")
    mesh, layout = t.mesh, t.layout
    try:
        key = tuple(tuple(p) for p in permutation)
        hash(key)
    except TypeError:
        key = None  # not pairs: let the checks below say what is wrong
    source = (_ppermute_sources(layout, t.shape, key, axis_name) if key is not None
              else _ppermute_sources.__wrapped__(layout, t.shape, permutation, axis_name))
    if comm.active():
        moved = max((math.prod(local_shape(t.shape, layout, mesh.coord_of(k)))
                     for k, s in enumerate(source) if s is not None and s != k), default=0)
        comm.record("ppermute", moved * t.dtype.itemsize)
    out = backend_for(mesh).permute(t.shards, layout, source, t.shape)
    return Tensor(out, layout, t.shape, t.dtype)
