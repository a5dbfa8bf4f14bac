"""Broadcasts, stacks and repeats of shardwise Tensors (issue 20): ``broadcast_to``,
``broadcast_tensors``, ``atleast_*d``, ``ravel``, ``h/v/dstack``, ``column_stack``,
``repeat``, ``tile``, ``meshgrid``, ``cartesian_prod``, ``sum_to_size``.

Invariants:
- Every op here is a composition of ops on rules (reshape, expand, cat, sum), in the
  order torch's own implementation composes them, so its values are torch's and each
  dim keeps the sharding those rules give it. None gathers inside its handler.
- Arguments are checked, and output shapes and dtypes found, by torch's op on
  ``meta`` tensors of the global shapes (torch's errors, torch's sizes).
- Plain torch tensors among the operands are Replicated on the first Tensor's mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.ops import compute, shapes
from shardwise.ops.registry import TensorMethod, on_mesh, register, shape_args
from shardwise.ops.views import meta
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor, place

__all__: list[str] = []

_VF: Any = torch._C._VariableFunctions  # torch's Python wrappers hand a list on to these


def _tensors(args: tuple[Any, ...]) -> list[Any]:
    """``f(a, b)`` or ``f([a, b])``: the tensors."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return list(args[0])
    return list(args)


def _metas(ts: Sequence[Any]) -> list[torch.Tensor]:
    return [meta(t) if isinstance(t, torch.Tensor) else t for t in ts]


# --- broadcasts ---------------------------------------------------------------------------
@register(torch.broadcast_to, TensorMethod.broadcast_to)
def broadcast_to(x: Any, size: Sequence[int]) -> Any:
    return shapes.expand(x, tuple(torch.broadcast_to(meta(x), size).shape))


@register(torch.broadcast_tensors)
def broadcast_tensors(*tensors: Any) -> Any:
    shape = tuple(torch.broadcast_tensors(*_metas(tensors))[0].shape) if tensors else ()
    return tuple(shapes.expand(t, shape) for t in on_mesh(tensors))


@register(torch.ravel, TensorMethod.ravel)
def ravel(x: Any) -> Any:
    return compute.reshape(x, (x.numel(),))


def _atleast(name: str) -> Any:
    func = getattr(torch, name)

    def handler(*args: Any) -> Any:
        ts = _tensors(args)
        sizes = [tuple(m.shape) for m in func(*_metas(ts))] if len(ts) > 1 else [
            tuple(func(meta(ts[0])).shape)]
        out = tuple(compute.reshape(t, s) if isinstance(t, Tensor) else func(t)
                    for t, s in zip(ts, sizes))
        return out if len(args) > 1 or isinstance(args[0], (list, tuple)) else out[0]

    return handler


for _name in ("atleast_1d", "atleast_2d", "atleast_3d"):  # _VF's: given a list
    register(getattr(torch, _name), getattr(_VF, _name))(
        _atleast(_name))


# --- stacks: atleast_*d, then cat (torch's composition) ------------------------------------
def _stack(name: str, dim_of: Any) -> Any:
    func = getattr(torch, name)

    def handler(tensors: Sequence[Any], *, out: Any = None) -> Any:
        func(_metas(tensors))  # torch's checks (ranks, shapes, count)
        ts = on_mesh(list(tensors))
        return shapes.cat([compute.reshape(t, s) for t, s in zip(ts, _prepared(name, ts))],
                          dim_of(ts), out=out)

    return handler


def _prepared(name: str, ts: Sequence[Any]) -> list[tuple[int, ...]]:
    """Each tensor's shape as torch's stack takes it (atleast_*d, or a column)."""
    if name == "column_stack":
        return [(t.numel(), 1) if t.ndim <= 1 else tuple(t.shape) for t in ts]
    lift = {"hstack": torch.atleast_1d, "vstack": torch.atleast_2d,
            "row_stack": torch.atleast_2d, "dstack": torch.atleast_3d}[name]
    return [tuple(lift(meta(t)).shape) for t in ts]


for _name, _dim_of in (("hstack", lambda ts: 0 if ts[0].ndim <= 1 else 1),
                       ("vstack", lambda ts: 0), ("row_stack", lambda ts: 0),
                       ("dstack", lambda ts: 2), ("column_stack", lambda ts: 1)):
    register(getattr(torch, _name))(_stack(_name, _dim_of))


# --- repeats ------------------------------------------------------------------------------
@register(TensorMethod.repeat)
def repeat(x: Any, *sizes: Any) -> Any:
    """Each dim ``s`` repeated ``r`` times: ``(r, s)`` expanded from ``(1, s)``, merged
    (the copies are the major factor, so a sharded ``s`` is gathered by the reshape)."""
    reps = shape_args(sizes)
    out = meta(x).repeat(reps)  # torch's checks (fewer sizes than dims raises)
    shape = (1,) * (len(reps) - x.ndim) + tuple(x.shape)
    wide = tuple(d for s in shape for d in (1, s))
    expanded = shapes.expand(compute.reshape(x, wide), tuple(d for r, s in zip(reps, shape)
                                                   for d in (r, s)))
    return compute.reshape(expanded, tuple(out.shape))


@register(torch.tile, TensorMethod.tile)
def tile(x: Any, *dims: Any) -> Any:
    reps = shape_args(dims)
    torch.tile(meta(x), reps)
    return repeat(x, (1,) * (x.ndim - len(reps)) + reps)


@register(TensorMethod.sum_to_size)
def sum_to_size(x: Any, *size: Any) -> Any:
    """The sum over the dims ``size`` broadcasts (leading ones, and size-1 ones)."""
    target = shape_args(size)
    out = meta(x).sum_to_size(target)
    if tuple(out.shape) == tuple(x.shape) and out.dtype == x.dtype:
        return x  # (torch sums a 0-d value anyway: a bool one becomes int64)
    lead = x.ndim - len(target)
    dims = [*range(lead), *(lead + i for i, s in enumerate(target)
                            if s == 1 and x.shape[lead + i] != 1)]
    summed = x.sum(dims, keepdim=True)
    return compute.reshape(summed, target)


# --- grids --------------------------------------------------------------------------------
@register(torch.meshgrid, _VF.meshgrid)
def meshgrid(*tensors: Any, indexing: str | None = None) -> Any:
    """Each 0-D or 1-D tensor reshaped along its own output dim, expanded to the grid."""
    ts = _tensors(tensors)
    grids = torch.meshgrid(*_metas(ts), indexing=indexing)  # torch's checks and warning
    order = list(range(len(ts)))
    if indexing == "xy" and len(ts) > 1:
        order[0], order[1] = 1, 0
    shape = tuple(grids[0].shape) if grids else ()
    out = []
    for t, d in zip(on_mesh(ts), order):
        line = tuple(s if i == d else 1 for i, s in enumerate(shape))
        out.append(shapes.expand(compute.reshape(t, line), shape))
    return tuple(out)


@register(torch.cartesian_prod)
def cartesian_prod(*tensors: Any) -> Any:
    ts = _tensors(tensors)
    torch.cartesian_prod(*_metas(ts))
    if len(ts) == 1:
        return ts[0]
    grids = meshgrid(*ts, indexing="ij")
    return shapes.stack([ravel(g) for g in grids], 1)


@register(torch.combinations)
def combinations(x: Any, r: int = 2, with_replacement: bool = False) -> Any:
    """Rows of ``x``'s elements picked by torch's own combinations of their positions
    (index_select: the planner gathers ``x``, a 1-D tensor)."""
    if x.ndim != 1:  # torch's error (no meta kernel)
        torch.combinations(torch.empty(tuple(x.shape)), r, with_replacement)
    picks = torch.combinations(torch.arange(x.shape[0]), r, with_replacement)
    if picks.ndim == 1:  # no combination: torch's empty result
        return torch.index_select(x, 0, picks)
    rows: Any = torch.index_select(x, 0, picks.reshape(-1))
    return compute.reshape(rows, tuple(picks.shape))


def _zeros(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Replicated +0 of ``shape`` (torch's padding value), one expanded scalar."""
    z = torch.zeros((), dtype=dtype, device=like.device).expand(shape)
    return place(z, Layout.replicated(like.mesh, len(shape)))


@register(torch.block_diag)
def block_diag(*tensors: Any) -> Any:
    """Each tensor as a (rows, cols) block between zeros, the rows stacked: cat twice."""
    dtype = torch.block_diag(*_metas(tensors)).dtype  # torch's checks and promotion
    ts = on_mesh(list(tensors))
    mats = [t if t.ndim == 2 else compute.reshape(t, (1, t.numel())) for t in ts]  # 0-d, 1-d
    width = sum(m.shape[1] for m in mats)
    rows, left = [], 0
    for m in mats:
        r, c = m.shape
        rows.append(shapes.cat([_zeros(m, (r, left), dtype), m.to(dtype),
                                _zeros(m, (r, width - left - c), dtype)], 1))
        left += c
    return shapes.cat(rows, 0)


@register(torch._chunk_cat)
def chunk_cat(tensors: Sequence[Any], dim: int, num_chunks: int, *, out: Any = None) -> Any:
    """torch's decomposition: each tensor padded with zeros along ``dim`` to a multiple of
    ``num_chunks``, viewed as ``(*lead, num_chunks, -1)``, and all concatenated."""
    torch._chunk_cat(_metas(tensors), dim, num_chunks)  # torch's checks
    ts = on_mesh(list(tensors))
    d = dim % ts[0].ndim
    parts = []
    for t in ts:
        size = t.shape[d]
        padded = -(-size // num_chunks) * num_chunks
        if padded != size:
            pad = (*t.shape[:d], padded - size, *t.shape[d + 1:])
            t = shapes.cat([t, _zeros(t, pad, t.dtype)], d)
        rest = t.numel() // max(math.prod(t.shape[:d]) * num_chunks, 1)
        parts.append(compute.reshape(t, (*t.shape[:d], num_chunks, rest)))
    return shapes.cat(parts, d + 1, out=out)
