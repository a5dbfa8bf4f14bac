"""Reducing ops: ``all_reduce`` and ``reduce_scatter`` combine the per-device
local values over mesh axes (the SPMD meaning of psum); on a Partial input that
resolves the Partial and keeps the global value. Gradients: all_reduce of
Partial(sum) -> identity into every partial; reduce_scatter -> all_gather."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from shardwise.api.checks import mesh_axes, need_tensor
from shardwise.planner import Plan, make_plan
from shardwise.runtime import backend_for
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.sharding.placements import ReduceOp
from shardwise.tensors.relayout import run_plan
from shardwise.tensors.tensor import Tensor

__all__ = ["all_reduce", "reduce_scatter"]


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
    return backend_for(t.mesh).relabel(t.shards, t.dist_layout, split, op or ReduceOp.SUM)


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
    """Everything a reducing op decides from its input's type, computed once (the
    helpers it calls are not cached themselves): the replicated axes to relabel, the
    result's shape and layout, and the plan."""
    new, out_shape, split = _partial_layout(layout, shape, axes, op, what)
    target = _reduced_target(new, axes, scatter_dim)
    return split, out_shape, target, make_plan(new, target, out_shape, itemsize)


def _reduce(t: Tensor, axes: tuple[int, ...], op: ReduceOp | None, what: str,
            scatter_dim: int | None) -> Tensor:
    """The reducing ops' one path: relabel, then run the cached plan (one result
    Tensor, no intermediate Partial Tensor: this is per-op overhead). The blocks
    combined are the natural order's (a value held in a sequence order is relaid out
    first, unless no reduced axis splits an ordered dim: then the orders carry over)."""
    orders = t.dist_layout.orders
    if orders and any(a in t.dist_layout.dims[o.dim] for o in orders for a in axes):
        t = t.relayout(t.dist_layout.with_orders(()))
        orders = ()
    split, shape, target, plan = _reduce_recipe(t.dist_layout, t.shape, axes, op, what,
                                                scatter_dim, t.dtype.itemsize)
    return Tensor(run_plan(t.mesh, plan, _relabelled(t, split, op)),
                  target.with_orders(orders), shape, t.dtype)


def _reduce_args(t: Tensor, reduce_axes: Any, reduce_op: Any,
                 what: str) -> tuple[tuple[int, ...], ReduceOp | None]:
    if reduce_axes is None:
        axes = t.dist_layout.partial_axes or tuple(range(t.mesh.ndim))
    else:
        axes = mesh_axes(t.mesh, reduce_axes, f"{what} reduce_axes")
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
    t = need_tensor(sharded_tensor, "all_reduce")
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
    t = need_tensor(sharded_tensor, "reduce_scatter")
    if kwargs:
        raise TypeError(f"reduce_scatter() got unexpected keyword arguments {sorted(kwargs)}.")
    d = normalize_dim(axis, t.ndim, "reduce_scatter axis")
    axes, op = _reduce_args(t, reduce_axes, reduce_op, "reduce_scatter")
    return _reduce(t, axes, op, "reduce_scatter", d)
