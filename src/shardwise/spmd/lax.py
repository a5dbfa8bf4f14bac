"""Collectives by mesh-axis name, for the per-device code that ``shard_map`` runs.

Inside ``shardwise.shard_map(fn, mesh, in_specs, out_specs)``, ``fn`` is plain
torch code run once per device on its local block; these functions let it talk
to the other devices, as ``jax.lax`` does inside ``jax.shard_map``.

Invariants:
- They run only inside a shard_map's ``fn`` (anywhere else: ShardingError) and
  take and return local ``torch.Tensor`` blocks.
- ``axis_name`` is a mesh axis name or a tuple of names. A tuple acts on the
  devices that differ only along those axes, numbered row-major over the names
  *as given* (first name major): that order is the order of ``all_gather``'s
  pieces, of ``axis_index`` and of ``ppermute``'s indices.
- Every device calls the same collectives in the same order with the same
  arguments (SPMD); the simulated runtime checks this and raises, never hangs.
- Sizes may be uneven (the shardwise split rule ``g // n + (1 if k < g % n else
  0)``) for ``all_gather(tiled=True)``, ``psum_scatter(tiled=True)``,
  ``all_to_all(tiled=True)`` and ``ppermute``, and any sizes, given as a matrix, for
  ``ragged_all_to_all``; the others need equal shapes.
- Gradients are the transposes (beside each op in the runtimes): psum <-> psum,
  all_gather <-> psum_scatter, ppermute <-> inverse ppermute, all_to_all <->
  inverse all_to_all (ragged too); pmax/pmin send the gradient to the devices holding the
  extreme (split evenly among ties).

On ``DeviceMesh(dp=2, tp=2)`` with local values ``v(dp, tp)``::

    device (dp,tp)        (0,0)          (0,1)          (1,0)          (1,1)
    psum(v, "tp")         v00+v01        v00+v01        v10+v11        v10+v11
    axis_index("tp")      0              1              0              1
    axis_index(("tp","dp")) 0            2              1              3
    all_gather(v, "dp")   stack(v00,v10) stack(v01,v11) stack(v00,v10) stack(v01,v11)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.runtime import check_reduce
from shardwise.runtime.spmd import AxisEnv, current_env
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import normalize_dim
from shardwise.sharding.placements import ReduceOp

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "ragged_all_to_all",
]

AxisName = str | Sequence[str]


def _env(op: str) -> AxisEnv:
    env = current_env()
    if env is None:
        raise ShardingError(
            f"shardwise.lax.{op} was called outside shard_map: its axis names only mean "
            "something while shard_map runs fn on each device. Call it inside the fn of "
            "shardwise.shard_map(fn, mesh, in_specs, out_specs); on a whole Tensor use "
            "shardwise.all_reduce / all_gather / reduce_scatter / ppermute instead."
        )
    return env


def _axes(env: AxisEnv, axis_name: Any, op: str) -> tuple[int, ...]:
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ShardingTypeError(
            f"lax.{op}: axis_name is a mesh axis name or a tuple of names. Got "
            f"{axis_name!r}; the mesh {env.mesh!r} has axes {list(env.mesh.axis_names)}."
        )
    axes = []
    for name in names:
        if name not in env.mesh.axis_names:
            raise ShardingError(
                f"lax.{op}: unknown mesh axis {name!r}: shard_map's mesh {env.mesh!r} has "
                f"axes {list(env.mesh.axis_names)}. Use one of those names."
            )
        axes.append(env.mesh.axis_names.index(name))
    if len(set(axes)) != len(axes):
        raise ShardingError(f"lax.{op}: axis_name {axis_name!r} names a mesh axis twice.")
    return tuple(axes)


def _setup(op: str, axis_name: Any) -> tuple[AxisEnv, tuple[int, ...], int]:
    env = _env(op)
    axes = _axes(env, axis_name, op)
    return env, axes, math.prod(env.mesh.mesh_shape[a] for a in axes)


def _tensor(x: Any, op: str) -> torch.Tensor:
    # a shardwise Tensor is a torch.Tensor too; __torch_function__ tells them apart
    if not isinstance(x, torch.Tensor) or hasattr(x, "dist_layout"):
        raise ShardingTypeError(
            f"lax.{op} takes the local block, a torch.Tensor. Got {type(x).__name__}. Inside "
            "shard_map, fn receives and returns torch tensors (not shardwise Tensors)."
        )
    return x


# --- reductions ---------------------------------------------------------------------------
_REDUCE_OP = {"psum": ReduceOp.SUM, "pmax": ReduceOp.MAX, "pmin": ReduceOp.MIN}


def _reduce(op: str, x: Any, axis_name: AxisName) -> Any:
    env, axes, size = _setup(op, axis_name)
    if isinstance(x, (tuple, list)):
        return type(x)(_reduce(op, v, axis_name) for v in x)
    if isinstance(x, (bool, int, float)):  # a constant: the same on every device
        return x * size if op == "psum" else x
    x = _tensor(x, op)
    check_reduce(x, _REDUCE_OP[op])  # on one device too: the same error on every mesh size
    return x if size == 1 else env.collective(op, x, axes, ())


def psum(x: Any, axis_name: AxisName) -> Any:
    """Sum of ``x`` over the devices of ``axis_name``; every one of them gets the sum.

    ``psum(1, "x")`` is the size of axis ``x``; a tuple/list of tensors is summed
    leaf by leaf. Gradient: psum of the incoming gradients.
    """
    return _reduce("psum", x, axis_name)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """Mean of ``x`` over the devices of ``axis_name`` (``psum(x) / axis_size``)."""
    size = axis_size(axis_name)
    if isinstance(x, (tuple, list)):
        return type(x)(pmean(v, axis_name) for v in x)
    return psum(x, axis_name) / size


def pmax(x: Any, axis_name: AxisName) -> Any:
    """Elementwise max over the devices of ``axis_name``. Gradient: to the device(s)
    holding the max, split evenly among ties."""
    return _reduce("pmax", x, axis_name)


def pmin(x: Any, axis_name: AxisName) -> Any:
    """Elementwise min over the devices of ``axis_name``; see :func:`pmax`."""
    return _reduce("pmin", x, axis_name)


# --- data movement ------------------------------------------------------------------------
def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0,
               tiled: bool = False) -> torch.Tensor:
    """The blocks of every device of ``axis_name``, in axis order.

    ``tiled=False`` (JAX's default) stacks them along a new dim ``axis`` (equal
    shapes needed); ``tiled=True`` concatenates them along ``axis`` (uneven sizes
    allowed, e.g. blocks of 2, 1, 1, 1 rows give the 5 rows back).
    Gradient: psum_scatter of the incoming gradients.
    """
    env, axes, size = _setup("all_gather", axis_name)
    x = _tensor(x, "all_gather")
    if not tiled:
        x = x.unsqueeze(normalize_dim(axis, x.ndim + 1, "all_gather axis"))
        if size == 1:
            return x
        return env.collective("all_gather", x, axes, (normalize_dim(axis, x.ndim), True))
    d = normalize_dim(axis, x.ndim, "all_gather axis")
    return x if size == 1 else env.collective("all_gather", x, axes, (d, False))


def psum_scatter(x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0,
                 tiled: bool = True) -> torch.Tensor:
    """Sum ``x`` over ``axis_name`` and keep this device's piece of dim
    ``scatter_dimension``: piece ``axis_index(axis_name)`` of the split rule
    (``tiled=True``, uneven sizes allowed), or with ``tiled=False`` (JAX's
    default) index ``axis_index`` of a dim whose size must be the axis size,
    which is dropped. Gradient: all_gather of the incoming gradients.
    """
    env, axes, size = _setup("psum_scatter", axis_name)
    x = _tensor(x, "psum_scatter")
    check_reduce(x, ReduceOp.SUM)
    d = normalize_dim(scatter_dimension, x.ndim, "psum_scatter scatter_dimension")
    if not tiled and x.shape[d] != size:
        raise ShardingError(
            f"lax.psum_scatter(tiled=False) needs x.shape[{d}] == the size of "
            f"{axis_name!r} ({size}). Got shape {tuple(x.shape)}. Use tiled=True to split "
            "the dim into contiguous pieces instead."
        )
    out = x if size == 1 else env.collective("psum_scatter", x, axes, (d,))
    return out if tiled else out.squeeze(d)


def ppermute(x: torch.Tensor, axis_name: AxisName,
             perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` along ``axis_name``: for each ``(src, dst)`` pair of axis indices,
    device ``dst`` receives the block of device ``src``; devices that receive
    nothing get zeros shaped like their own ``x``. Blocks may differ in shape.
    Gradient: the inverse permutation.
    """
    env, axes, size = _setup("ppermute", axis_name)
    x = _tensor(x, "ppermute")
    pairs = _check_perm(perm, size, axis_name)
    if size == 1:
        return x if pairs else torch.zeros_like(x)
    return env.collective("ppermute", x, axes, (pairs,))


def _check_perm(perm: Any, size: int, axis_name: Any) -> tuple[tuple[int, int], ...]:
    try:
        items = [tuple(p) for p in perm]
        ok = all(len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
                 for p in items)
    except TypeError:
        ok = False
    if not ok:
        raise ShardingTypeError(
            f"lax.ppermute: perm is a sequence of (source, destination) int pairs. Got {perm!r}."
        )
    pairs = tuple((int(s), int(d)) for s, d in items)
    for what, idx in (("source", 0), ("destination", 1)):
        seen = [p[idx] for p in pairs]
        bad = [v for v in seen if not 0 <= v < size]
        if bad:
            raise ShardingError(
                f"lax.ppermute: {what} {bad[0]} is out of range for axis {axis_name!r} of "
                f"size {size}: indices run 0..{size - 1}. Got perm={list(pairs)!r}."
            )
        if len(set(seen)) != len(seen):
            raise ShardingError(
                f"lax.ppermute: perm must be a permutation: a {what} appears twice in "
                f"{list(pairs)!r}."
            )
    return tuple(sorted(pairs))


def all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = True) -> torch.Tensor:
    """Split ``x`` along ``split_axis`` into one piece per device of ``axis_name``
    (split rule), send piece ``j`` to device ``j``, and concatenate the pieces
    received along ``concat_axis`` in axis order (``tiled=True``; uneven sizes
    allowed). With ``tiled=False`` (JAX's default) ``x.shape[split_axis]`` must be
    the axis size; that dim is dropped and the received blocks are stacked in a
    new dim ``concat_axis``. Gradient: the inverse all_to_all.
    """
    env, axes, size = _setup("all_to_all", axis_name)
    x = _tensor(x, "all_to_all")
    s = normalize_dim(split_axis, x.ndim, "all_to_all split_axis")
    c = normalize_dim(concat_axis, x.ndim, "all_to_all concat_axis")
    if tiled:
        return x if size == 1 else env.collective("all_to_all", x, axes, (s, c, False))
    if x.shape[s] != size:
        raise ShardingError(
            f"lax.all_to_all(tiled=False) needs x.shape[split_axis={s}] == the size of "
            f"{axis_name!r} ({size}). Got shape {tuple(x.shape)}. Use tiled=True to split the "
            "dim into contiguous pieces instead."
        )
    y = x.movedim(s, 0)
    if size > 1:
        y = env.collective("all_to_all", y, axes, (0, 0, True))
    return y.movedim(0, c)


def ragged_all_to_all(x: torch.Tensor, axis_name: AxisName,
                      split_sizes: Sequence[Sequence[int]], *, axis: int = 0) -> torch.Tensor:
    """All-to-all with pieces of any sizes (MPI's alltoallv, torch's
    ``all_to_all_single`` with split sizes): device ``i`` of ``axis_name`` sends its next
    ``split_sizes[i][j]`` entries along ``axis`` to device ``j``, in order, and each
    device concatenates what it receives along ``axis`` in axis order.

    ``split_sizes`` is the whole matrix, the same on every device (one row per sender,
    Python ints): every device then knows what it receives, so no sizes are exchanged
    (where only a device's own row is known, ``all_gather`` the rows first). Row ``i``
    must sum to device ``i``'s ``x.shape[axis]``. Gradient: the transposed exchange.

    On ``DeviceMesh(x=2)`` with ``split_sizes=[[1, 2], [3, 0]]``::

        device   sends            receives
        0        a[0:1] -> 0      a[0:1] ++ b[0:3]
                 a[1:3] -> 1
        1        b[0:3] -> 0      a[1:3]
    """
    env, axes, size = _setup("ragged_all_to_all", axis_name)
    x = _tensor(x, "ragged_all_to_all")
    d = normalize_dim(axis, x.ndim, "ragged_all_to_all axis")
    sizes = _check_sizes(split_sizes, size, axis_name)
    me = axis_index(axis_name)
    if sum(sizes[me]) != x.shape[d]:
        raise ShardingError(
            f"lax.ragged_all_to_all: device {me} of {axis_name!r} sends "
            f"{sum(sizes[me])} entries (row {me} of split_sizes: {list(sizes[me])}) but its "
            f"x has {x.shape[d]} along axis {d} (shape {tuple(x.shape)}). Each row of "
            "split_sizes must sum to that device's x.shape[axis].")
    if size == 1:
        return x
    return env.collective("ragged_all_to_all", x, axes, (d, sizes))


def _check_sizes(split_sizes: Any, size: int, axis_name: Any) -> tuple[tuple[int, ...], ...]:
    try:
        rows = tuple(tuple(row) for row in split_sizes)
    except TypeError:
        rows = ()
    ok = len(rows) == size and all(
        len(row) == size and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                 for v in row) for row in rows)
    if not ok:
        raise ShardingError(
            f"lax.ragged_all_to_all: split_sizes is a {size}x{size} matrix of non-negative "
            f"Python ints (row i: what device i of {axis_name!r} sends to each device). "
            f"Got {split_sizes!r}.")
    return rows


# --- indices ------------------------------------------------------------------------------
def axis_index(axis_name: AxisName) -> int:
    """This device's index along ``axis_name`` (row-major over a tuple of names), a
    Python int: usable for slicing and arithmetic in ``fn``."""
    env = _env("axis_index")
    index = 0
    for a in _axes(env, axis_name, "axis_index"):
        index = index * env.mesh.mesh_shape[a] + env.coord[a]
    return index


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (product over a tuple of names)."""
    return _setup("axis_size", axis_name)[2]
