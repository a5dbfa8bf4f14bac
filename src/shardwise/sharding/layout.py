"""Layout: the canonical, lossless form of "where a tensor of known rank lives".

The three public sharding forms (PlacementMapping, NamedMapping,
ShardingSpec) each describe a subset of layouts; :class:`Layout` describes
them all, so the runtime and the planner work on one form only.

Invariants:
- ``dims[d]`` lists the mesh axes (indices) that split tensor dim ``d``,
  major to minor; ``partial[a]`` is the reduce op of mesh axis ``a`` or None.
- Each mesh axis appears at most once across ``dims`` and ``partial``; an axis
  that appears nowhere is replicated.
- A dim split over axes ``(a, b)`` is split once into ``size(a) * size(b)``
  pieces; device coordinate ``(i, j)`` holds piece ``i * size(b) + j``.
- ``orders`` (default none): the dims held in a sequence order
  (:class:`~shardwise.sharding.orders.SequenceOrder`, sorted by dim, one per dim).
  Blocks are cut from the held (permuted) coordinates; the order is part of the
  layout's identity (equality, hash, ``str``), so caches keyed on layouts tell a
  value in a region's order from one in natural order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from shardwise.sharding.errors import ConversionError, ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.orders import SequenceOrder
from shardwise.sharding.placements import Partial, Placement, ReduceOp, Replicated, Sharded

__all__ = ["Layout", "normalize_dim"]


def normalize_dim(dim: int, ndim: int, what: str = "tensor dim") -> int:
    """``dim`` as a non-negative index into a rank-``ndim`` tensor, or a clear error."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShardingTypeError(f"{what} must be an int. Got {dim!r} ({type(dim).__name__}).")
    if not -ndim <= dim < ndim:
        raise ShardingError(
            f"{what.capitalize()} {dim} is out of range for a tensor of rank {ndim}: "
            f"use -{ndim} <= dim < {ndim}."
        )
    return dim % ndim


@dataclass(frozen=True, slots=True)
class Layout:
    """Canonical layout of a rank-``len(dims)`` tensor on ``mesh``."""

    mesh: DeviceMesh
    dims: tuple[tuple[int, ...], ...]
    partial: tuple[ReduceOp | None, ...]
    orders: tuple[SequenceOrder, ...] = ()
    _hash: int = field(init=False, repr=False, compare=False)
    _partial_axes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.partial) != self.mesh.ndim:
            raise ShardingError(
                f"Layout.partial needs one entry per mesh axis ({self.mesh.ndim}). "
                f"Got {len(self.partial)}."
            )
        seen: dict[int, str] = {}
        for d, axes in enumerate(self.dims):
            for a in axes:
                if not 0 <= a < self.mesh.ndim:
                    raise ShardingError(f"Layout dim {d}: mesh axis {a} out of range.")
                if a in seen:
                    name = self.mesh.axis_names[a]
                    raise ShardingError(
                        f"Mesh axis {name!r} is used twice (by {seen[a]} and tensor dim {d}): "
                        "a mesh axis can shard at most one tensor dim, once."
                    )
                seen[a] = f"tensor dim {d}"
        for a, op in enumerate(self.partial):
            if op is not None and a in seen:
                name = self.mesh.axis_names[a]
                raise ShardingError(
                    f"Mesh axis {name!r} cannot both shard {seen[a]} and be Partial."
                )
        if self.orders:
            _check_orders(self.orders, len(self.dims))
        object.__setattr__(self, "_hash",
                           hash((self.mesh, self.dims, self.partial, self.orders)))
        # asked by every reducing op: computed once per (cached, frozen) layout
        object.__setattr__(self, "_partial_axes",
                           tuple(a for a, op in enumerate(self.partial) if op is not None))

    def __hash__(self) -> int:
        return self._hash

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        # a frozen value: its copy is itself. Dynamo deep-copies a compiled input's
        # metadata for its guard, which then compares by identity, not field by field
        return self

    def __repr__(self) -> str:
        orders = f", orders={self.orders!r}" if self.orders else ""
        return (f"Layout(mesh={self.mesh!r}, dims={self.dims!r}, "
                f"partial={self.partial!r}{orders})")

    # --- constructors -------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: DeviceMesh, ndim: int) -> Layout:
        return cls(mesh, ((),) * ndim, (None,) * mesh.ndim)

    @classmethod
    def from_placements(
        cls, mesh: DeviceMesh, placements: tuple[Placement, ...] | list[Placement], ndim: int
    ) -> Layout:
        """From one placement per mesh axis; several axes on one dim go in mesh order."""
        if len(placements) != mesh.ndim:
            raise ShardingError(
                f"{mesh!r} has {mesh.ndim} axes but {len(placements)} placements were given "
                f"({list(placements)}): give exactly one placement per mesh axis."
            )
        dims: list[list[int]] = [[] for _ in range(ndim)]
        partial: list[ReduceOp | None] = [None] * mesh.ndim
        for a, p in enumerate(placements):
            match p:
                case Sharded(axis=axis):
                    what = f"Sharded axis on mesh axis {mesh.axis_names[a]!r}"
                    dims[normalize_dim(axis, ndim, what)].append(a)
                case Partial(reduce_op=op):
                    partial[a] = op
                case Replicated():
                    pass
                case _:
                    raise ShardingError(
                        f"Placement {p!r} on mesh axis {mesh.axis_names[a]!r} is not a "
                        "Placement: use Replicated(), Sharded(axis) or Partial(op)."
                    )
        return cls(mesh, tuple(tuple(d) for d in dims), tuple(partial))

    # --- queries ------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    def dim_of_axis(self, axis: int) -> int | None:
        """The tensor dim that mesh axis ``axis`` shards, or None."""
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    @property
    def sharded_axes(self) -> tuple[int, ...]:
        return tuple(a for axes in self.dims for a in axes)

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return self._partial_axes

    @property
    def is_partial(self) -> bool:
        return bool(self._partial_axes)

    def replicated_axes(self) -> tuple[int, ...]:
        """The mesh axes along which every device holds the same block.

        >>> Layout(DeviceMesh.cpu((2, 2), ("dp", "tp")), ((0,), ()), (None, None)).replicated_axes()
        (1,)
        """
        used = set(self.sharded_axes) | set(self._partial_axes)
        return tuple(a for a in range(self.mesh.ndim) if a not in used)

    def representatives(self) -> tuple[int, ...]:
        """For each device (row-major), the device whose block it shares: its
        coordinate with every replicated mesh axis set to 0.

        >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        >>> Layout(mesh, ((0,), ()), (None, None)).representatives()
        (0, 0, 2, 2)
        """
        return _representatives(self)

    @property
    def is_fully_replicated(self) -> bool:
        return not self.is_partial and not any(self.dims)

    def placement(self, axis: int) -> Placement:
        op = self.partial[axis]
        if op is not None:
            return Partial(op)
        d = self.dim_of_axis(axis)
        return Replicated() if d is None else Sharded(d)

    def with_dims(self, dims: tuple[tuple[int, ...], ...]) -> Layout:
        return _layout(self.mesh, dims, self.partial, id(self.mesh), self.orders)

    def with_partial(self, partial: tuple[ReduceOp | None, ...]) -> Layout:
        return _layout(self.mesh, self.dims, partial, id(self.mesh), self.orders)

    def with_orders(self, orders: tuple[SequenceOrder, ...]) -> Layout:
        """This layout with its dims held in ``orders`` (sorted by dim here).

        >>> mesh = DeviceMesh.cpu(2, "cp")
        >>> str(Layout(mesh, ((), (0,)), (None,)).with_orders((SequenceOrder(1, 8, 2),)))
        'DeviceMesh(cp=2)[R, S(cp)] order 1:ht8/2'
        """
        ordered = tuple(sorted(orders, key=lambda o: o.dim))
        if ordered == self.orders:
            return self
        return _layout(self.mesh, self.dims, self.partial, id(self.mesh), ordered)

    def order_of(self, dim: int) -> SequenceOrder | None:
        """The sequence order tensor dim ``dim`` is held in, or None (natural).

        >>> lay = Layout.replicated(DeviceMesh.cpu(2, "cp"), 2)
        >>> lay.with_orders((SequenceOrder(1, 8, 2),)).order_of(1), lay.order_of(1)
        (SequenceOrder(dim=1, length=8, parts=2, inner=1), None)
        """
        for o in self.orders:
            if o.dim == dim:
                return o
        return None

    def without_partial(self) -> Layout:
        """This layout with every Partial axis reduced (replicated), dims unchanged.

        >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        >>> str(Layout(mesh, ((0,),), (None, ReduceOp.SUM)).without_partial())
        'DeviceMesh(dp=2, tp=2)[S(dp)]'
        """
        return self.with_partial((None,) * self.mesh.ndim)

    # --- conversions --------------------------------------------------------------
    def to_placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis; raises ConversionError when a dim is split
        over several mesh axes in an order other than the mesh's."""
        for d, axes in enumerate(self.dims):
            if list(axes) != sorted(axes):
                names = tuple(self.mesh.axis_names[a] for a in axes)
                raise ConversionError(
                    f"Tensor dim {d} is split over mesh axes {names} (major to minor), which "
                    f"is not mesh order {self.mesh.axis_names}: placements always split in "
                    "mesh order, so this layout has no PlacementMapping. Use NamedMapping."
                )
        return tuple(self.placement(a) for a in range(self.mesh.ndim))

    def spec_entries(self) -> tuple[str | tuple[str, ...] | None, ...]:
        names = self.mesh.axis_names
        out: list[str | tuple[str, ...] | None] = []
        for axes in self.dims:
            if not axes:
                out.append(None)
            elif len(axes) == 1:
                out.append(names[axes[0]])
            else:
                out.append(tuple(names[a] for a in axes))
        return tuple(out)

    def single_reduce_op(self, target: str) -> ReduceOp:
        """The one reduce op of all Partial axes (SUM when none); ConversionError if mixed."""
        ops = {op for op in self.partial if op is not None}
        if len(ops) > 1:
            detail = {
                self.mesh.axis_names[a]: op.value
                for a, op in enumerate(self.partial)
                if op is not None
            }
            raise ConversionError(
                f"Partial axes use different reduce ops {detail}, but {target} holds one "
                "reduce op for all unreduced axes: converting would drop an op. Use "
                "PlacementMapping, or resolve the Partial axes first (all_reduce)."
            )
        return ops.pop() if ops else ReduceOp.SUM

    def __str__(self) -> str:
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("R")
            else:
                parts.append("S(" + ",".join(self.mesh.axis_names[a] for a in axes) + ")")
        text = "[" + ", ".join(parts) + "]"
        partial = {
            self.mesh.axis_names[a]: op.value for a, op in enumerate(self.partial) if op
        }
        if partial:
            text += " partial " + ", ".join(f"{k}:{v}" for k, v in partial.items())
        if self.orders:
            text += " order " + ", ".join(str(o) for o in self.orders)
        return f"{self.mesh!r}{text}"


def _check_orders(orders: tuple[SequenceOrder, ...], ndim: int) -> None:
    dims = [o.dim for o in orders] if all(isinstance(o, SequenceOrder) for o in orders) else []
    if len(dims) != len(orders) or dims != sorted(set(dims)) or dims[-1] >= ndim:
        raise ShardingError(
            f"Layout.orders must be SequenceOrders on distinct dims of the rank-{ndim} "
            f"tensor, sorted by dim. Got {orders!r}.")


@functools.lru_cache(maxsize=8192)
def _layout(mesh: DeviceMesh, dims: tuple[tuple[int, ...], ...],
            partial: tuple[ReduceOp | None, ...], mesh_id: int,
            orders: tuple[SequenceOrder, ...] = ()) -> Layout:
    """Layouts are values: build (and validate) each one once. ``mesh_id`` keeps
    equal-but-distinct meshes apart, so derived layouts keep the very mesh object."""
    return Layout(mesh, dims, partial, orders)


@functools.lru_cache(maxsize=4096)
def _representatives(layout: Layout) -> tuple[int, ...]:
    mesh = layout.mesh
    used = set(layout.sharded_axes) | set(layout.partial_axes)
    out = []
    for k in range(mesh.num_devices):
        coord = [c if a in used else 0 for a, c in enumerate(mesh.coord_of(k))]
        out.append(mesh.index_of(coord))
    return tuple(out)

