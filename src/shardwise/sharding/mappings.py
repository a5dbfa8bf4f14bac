"""The public sharding forms and their lossless conversions.

Invariants:
- :class:`PlacementMapping` is mesh-axis-indexed (PyTorch DTensor style): one
  placement per mesh axis; a dim sharded by several axes is split in mesh order.
- :class:`NamedMapping` is tensor-dim-indexed (JAX PartitionSpec style): one
  :data:`SpecEntry` per tensor dim; ``unreduced`` axes are Partial with the one
  ``reduce_op``.
- :class:`ShardingSpec` is the per-dim (Shardy style) form used by ``shard``:
  one :class:`DimSpec` per tensor dim, with open/closed dims and priorities.
- All are frozen and validated. Unknown axis names raise; an axis appears at
  most once in the whole spec. Every form converts to a :class:`Layout`
  (``to_layout(ndim)``); conversions between forms are lossless or raise
  :class:`ConversionError` (a Partial's op is never dropped).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

from shardwise.sharding.errors import (
    ConversionError,
    ShardingError,
    ShardingTypeError,
    check_items,
)
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement, ReduceOp

__all__ = [
    "DeviceMapping",
    "DimSpec",
    "NamedMapping",
    "PlacementMapping",
    "ShardingSpec",
    "SpecEntry",
    "as_layout",
]

SpecEntry: TypeAlias = "str | tuple[str, ...] | None"
"""One tensor dim of a NamedMapping: None (not sharded), an axis name, or a
tuple of axis names (split over several mesh axes, major to minor)."""


def _check_mesh(mesh: object, owner: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(
            f"{owner} needs a DeviceMesh. Got {mesh!r} ({type(mesh).__name__}); build one "
            "with e.g. DeviceMesh.cpu((2, 2), ('dp', 'tp'))."
        )
    return mesh


def _entry_axes(entry: object, mesh: DeviceMesh, where: str) -> tuple[str, ...]:
    """The axis names of one spec entry, validated against ``mesh``."""
    if entry is None:
        return ()
    names: tuple[object, ...] = (entry,) if isinstance(entry, str) else ()
    if not isinstance(entry, str):
        if not isinstance(entry, (tuple, list)):
            raise ShardingError(
                f"{where}: a spec entry is None, an axis name or a tuple of axis names. "
                f"Got {entry!r} ({type(entry).__name__})."
            )
        names = tuple(entry)
    for name in names:
        if not isinstance(name, str):
            raise ShardingError(
                f"{where}: mesh axes are named by strings. Got {name!r} in {entry!r}; "
                f"{mesh!r} has axes {list(mesh.axis_names)}."
            )
        mesh.axis_index(name)  # raises for unknown names
    return tuple(str(n) for n in names)


def _check_unique(used: Iterable[str], owner: str) -> None:
    seen: set[str] = set()
    for name in used:
        if name in seen:
            raise ShardingError(
                f"{owner}: mesh axis {name!r} is used twice. Each mesh axis may shard one "
                "tensor dim (or be unreduced/replicated) once; remove the repeat."
            )
        seen.add(name)


def _axis_set(names: Iterable[str] | None, mesh: DeviceMesh, what: str) -> frozenset[str]:
    if names is None:
        return frozenset()
    if isinstance(names, str):
        names = (names,)
    names = check_items(names, what, "a set of mesh axis names (str)")
    for name in names:
        if not isinstance(name, str):
            raise ShardingTypeError(f"{what} holds mesh axis names (str). Got {name!r}.")
        mesh.axis_index(name)
    return frozenset(names)


def _set_repr(names: frozenset[str], mesh: DeviceMesh) -> str:
    ordered = [n for n in mesh.axis_names if n in names]
    return "{" + ", ".join(repr(n) for n in ordered) + "}"


class DeviceMapping:
    """Abstract base of the sharding forms: a mesh plus where a tensor lives on it."""

    __slots__ = ()
    mesh: DeviceMesh

    def to_layout(self, ndim: int) -> Layout:
        """The canonical layout for a rank-``ndim`` tensor (lossless)."""
        raise NotImplementedError

    def to_placements(self) -> tuple[Placement, ...]:
        raise NotImplementedError

    def to_named_sharding(self, rank: int) -> NamedMapping:
        raise NotImplementedError

    @property
    def is_fully_replicated(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class PlacementMapping(DeviceMapping):
    """Mesh-axis-indexed sharding: one :class:`Placement` per mesh axis.

    On ``DeviceMesh(dp=2, tp=2)``, ``[Sharded(0), Replicated()]`` for a global ``x``
    of 4 rows: devices (0,0) and (0,1) hold ``x[0:2]``, (1,0) and (1,1) hold ``x[2:4]``.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        mesh = _check_mesh(self.mesh, "PlacementMapping")
        placements = check_items(self.placements, "PlacementMapping placements",
                            "a list with one placement per mesh axis, e.g. [Sharded(0)]")
        if len(placements) != mesh.ndim:
            raise ShardingError(
                f"{mesh!r} has {mesh.ndim} axes but {len(placements)} placements were given "
                f"({list(placements)}): give exactly one placement per mesh axis."
            )
        for p in placements:
            if not isinstance(p, Placement):
                raise ShardingTypeError(
                    f"PlacementMapping placements must be Replicated(), Sharded(axis) or "
                    f"Partial(op). Got {p!r} ({type(p).__name__})."
                )
        object.__setattr__(self, "placements", placements)

    def __repr__(self) -> str:
        return f"PlacementMapping({self.mesh!r}, {list(self.placements)!r})"

    def to_layout(self, ndim: int) -> Layout:
        return Layout.from_placements(self.mesh, self.placements, ndim)

    def to_placements(self) -> tuple[Placement, ...]:
        return self.placements

    def to_named_sharding(self, rank: int) -> NamedMapping:
        return NamedMapping.from_layout(self.to_layout(rank))

    @property
    def is_fully_replicated(self) -> bool:
        return all(p.short == "R" for p in self.placements)


@dataclass(frozen=True, slots=True)
class NamedMapping(DeviceMapping):
    """Tensor-dim-indexed sharding (JAX PartitionSpec style).

    On ``DeviceMesh(dp=2, tp=2)``, ``spec=('tp', None)`` for a global ``x`` of 4 rows:
    devices (0,0) and (1,0) hold ``x[0:2]``, (0,1) and (1,1) hold ``x[2:4]``.
    Dims past the end of ``spec`` are not sharded.
    """

    mesh: DeviceMesh
    spec: tuple[SpecEntry, ...]
    unreduced: frozenset[str] = frozenset()
    priorities: tuple[int, ...] = ()
    reduce_op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        mesh = _check_mesh(self.mesh, "NamedMapping")
        if isinstance(self.spec, (str, type(None))):
            raise ShardingError(
                f"NamedMapping spec is a tuple with one entry per tensor dim. Got {self.spec!r};"
                f" write ({self.spec!r},) for a 1-D tensor."
            )
        spec: list[SpecEntry] = []
        used: list[str] = []
        for d, entry in enumerate(check_items(self.spec, "NamedMapping spec", "a tuple with "
                                         "one entry per tensor dim, e.g. ('dp', None)")):
            axes = _entry_axes(entry, mesh, f"NamedMapping spec entry {d}")
            used.extend(axes)
            spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        unreduced = _axis_set(self.unreduced, mesh, "NamedMapping unreduced")
        used.extend(n for n in mesh.axis_names if n in unreduced)
        _check_unique(used, f"NamedMapping{tuple(self.spec)!r}")
        priorities = tuple(self.priorities)
        for p in priorities:
            if isinstance(p, bool) or not isinstance(p, int):
                raise ShardingError(
                    f"NamedMapping priorities hold one int per spec entry. Got {p!r} in "
                    f"{priorities}."
                )
        if priorities and len(priorities) != len(spec):
            raise ShardingError(
                f"NamedMapping priorities {priorities} must give one int per spec entry "
                f"({len(spec)}), or be empty."
            )
        object.__setattr__(self, "spec", tuple(spec))
        object.__setattr__(self, "unreduced", unreduced)
        object.__setattr__(self, "priorities", priorities)
        object.__setattr__(self, "reduce_op", ReduceOp.parse(self.reduce_op))

    def __repr__(self) -> str:
        text = f"NamedMapping({self.mesh!r}, {self.spec!r}"
        if self.unreduced:
            text += f", unreduced={_set_repr(self.unreduced, self.mesh)}"
        if self.priorities:
            text += f", priorities={self.priorities!r}"
        if self.reduce_op is not ReduceOp.SUM:
            text += f", reduce_op={self.reduce_op.value!r}"
        return text + ")"

    @classmethod
    def from_layout(cls, layout: Layout) -> NamedMapping:
        op = layout.single_reduce_op("NamedMapping")
        names = layout.mesh.axis_names
        unreduced = frozenset(names[a] for a in layout.partial_axes)
        return cls(layout.mesh, layout.spec_entries(), unreduced, (), op)

    def to_layout(self, ndim: int) -> Layout:
        if len(self.spec) > ndim:
            raise ShardingError(
                f"{self!r} has {len(self.spec)} spec entries but the tensor has rank {ndim}: "
                "give at most one entry per tensor dim."
            )
        index = self.mesh.axis_index
        dims = [tuple(index(n) for n in _entry_axes(e, self.mesh, "spec")) for e in self.spec]
        dims += [()] * (ndim - len(dims))
        partial = tuple(
            self.reduce_op if n in self.unreduced else None for n in self.mesh.axis_names
        )
        return Layout(self.mesh, tuple(dims), partial)

    def to_placements(self) -> tuple[Placement, ...]:
        if any(self.priorities):
            raise ConversionError(
                f"{self!r} has priorities {self.priorities}, which placements cannot hold. "
                "Drop the priorities or keep the NamedMapping."
            )
        return self.to_layout(len(self.spec)).to_placements()

    def to_named_sharding(self, rank: int) -> NamedMapping:
        if len(self.spec) == rank:
            return self
        return NamedMapping(
            self.mesh,
            self.to_layout(rank).spec_entries(),
            self.unreduced,
            self.priorities + (0,) * (rank - len(self.spec)) if self.priorities else (),
            self.reduce_op,
        )

    @property
    def is_fully_replicated(self) -> bool:
        return not self.unreduced and all(e is None for e in self.spec)


@dataclass(frozen=True, slots=True)
class DimSpec:
    """How one tensor dim is sharded (Shardy style).

    ``axes`` are mesh axis names, major to minor (``None``, a name, or a tuple);
    an open dim (``is_open=True``) may be further sharded by propagation, a
    closed one may not; ``priority`` orders propagation (lower first).
    """

    axes: tuple[str, ...] = ()
    is_open: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        axes = self.axes
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        elif not isinstance(axes, (tuple, list)):
            raise ShardingError(
                f"DimSpec axes are None, a mesh axis name or a tuple of names. Got {axes!r}."
            )
        for name in axes:
            if not isinstance(name, str):
                raise ShardingError(f"DimSpec axes must be axis names (str). Got {name!r}.")
        _check_unique(axes, f"DimSpec({tuple(axes)!r})")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ShardingError(f"DimSpec priority must be an int. Got {self.priority!r}.")
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "is_open", bool(self.is_open))

    @classmethod
    def of(cls, value: DimSpec | SpecEntry) -> DimSpec:
        return value if isinstance(value, DimSpec) else cls(value)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        axes: object = (
            None if not self.axes else self.axes[0] if len(self.axes) == 1 else self.axes
        )
        text = f"DimSpec({axes!r}"
        if self.is_open:
            text += ", is_open=True"
        if self.priority:
            text += f", priority={self.priority}"
        return text + ")"


@dataclass(frozen=True, slots=True)
class ShardingSpec(DeviceMapping):
    """Per-dim sharding (Shardy style), the form ``shard(x, mesh, dim_specs)`` takes.

    ``replicated_axes`` are explicitly replicated (propagation may not shard
    open dims over them); ``partial_sum_axes`` hold Partial sums.
    """

    mesh: DeviceMesh
    dim_specs: tuple[DimSpec, ...]
    replicated_axes: frozenset[str] = frozenset()
    partial_sum_axes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        mesh = _check_mesh(self.mesh, "ShardingSpec")
        if isinstance(self.dim_specs, (str, DimSpec)) or self.dim_specs is None:
            raise ShardingError(
                "ShardingSpec dim_specs is a list with one DimSpec per tensor dim. "
                f"Got {self.dim_specs!r}; wrap it in a list."
            )
        specs = tuple(DimSpec.of(s) for s in check_items(
            self.dim_specs, "ShardingSpec dim_specs",
            "a list with one DimSpec (or None, an axis name) per tensor dim, e.g. ['x', None]"))
        used = [n for s in specs for n in s.axes]
        for name in used:
            mesh.axis_index(name)
        rep = _axis_set(self.replicated_axes or (), mesh, "ShardingSpec replicated_axes")
        part = _axis_set(self.partial_sum_axes or (), mesh, "ShardingSpec partial_sum_axes")
        ordered = [n for n in mesh.axis_names if n in rep] + [
            n for n in mesh.axis_names if n in part
        ]
        _check_unique(used + ordered, f"ShardingSpec({list(specs)!r})")
        object.__setattr__(self, "dim_specs", specs)
        object.__setattr__(self, "replicated_axes", rep)
        object.__setattr__(self, "partial_sum_axes", part)

    def __repr__(self) -> str:
        text = f"ShardingSpec({self.mesh!r}, {list(self.dim_specs)!r}"
        if self.replicated_axes:
            text += f", replicated_axes={_set_repr(self.replicated_axes, self.mesh)}"
        if self.partial_sum_axes:
            text += f", partial_sum_axes={_set_repr(self.partial_sum_axes, self.mesh)}"
        return text + ")"

    @classmethod
    def from_layout(cls, layout: Layout) -> ShardingSpec:
        names = layout.mesh.axis_names
        bad = {names[a]: op.value for a, op in enumerate(layout.partial) if op not in (None,
                                                                                      ReduceOp.SUM)}
        if bad:
            raise ConversionError(
                f"ShardingSpec holds only Partial sums (partial_sum_axes), but axes {bad} "
                "reduce by another op: converting would drop it. Use PlacementMapping."
            )
        specs = [DimSpec(tuple(names[a] for a in axes)) for axes in layout.dims]
        return cls(layout.mesh, tuple(specs), frozenset(),
                   frozenset(names[a] for a in layout.partial_axes))

    @property
    def open_dims(self) -> tuple[bool, ...]:
        return tuple(s.is_open for s in self.dim_specs)

    def to_layout(self, ndim: int) -> Layout:
        if len(self.dim_specs) != ndim:
            raise ShardingError(
                f"ShardingSpec has {len(self.dim_specs)} dim specs but the tensor has rank "
                f"{ndim}: give exactly one DimSpec per tensor dim."
            )
        index = self.mesh.axis_index
        dims = tuple(tuple(index(n) for n in s.axes) for s in self.dim_specs)
        partial = tuple(
            ReduceOp.SUM if n in self.partial_sum_axes else None for n in self.mesh.axis_names
        )
        return Layout(self.mesh, dims, partial)

    def _check_closed(self, target: str) -> None:
        open_dims = [d for d, s in enumerate(self.dim_specs) if s.is_open]
        if open_dims:
            raise ConversionError(
                f"Dims {open_dims} of {self!r} are open (may be further sharded), which "
                f"{target} cannot express. Close them (is_open=False) first."
            )

    def to_placements(self) -> tuple[Placement, ...]:
        self._check_closed("placements")
        if any(s.priority for s in self.dim_specs):
            raise ConversionError(
                f"{self!r} has dim priorities, which placements cannot hold. Drop them first."
            )
        return self.to_layout(len(self.dim_specs)).to_placements()

    def to_named_sharding(self, rank: int) -> NamedMapping:
        self._check_closed("NamedMapping")
        named = NamedMapping.from_layout(self.to_layout(rank))
        priorities = tuple(s.priority for s in self.dim_specs)
        if any(priorities):
            named = NamedMapping(named.mesh, named.spec, named.unreduced, priorities,
                                 named.reduce_op)
        return named

    @property
    def is_fully_replicated(self) -> bool:
        return not self.partial_sum_axes and all(not s.axes for s in self.dim_specs)


def as_layout(sharding: object, ndim: int) -> Layout:
    """The :class:`Layout` of any sharding form for a rank-``ndim`` tensor."""
    if isinstance(sharding, Layout):
        if sharding.ndim != ndim:
            raise ShardingError(
                f"Layout {sharding} is for rank {sharding.ndim}, the tensor has rank {ndim}."
            )
        return sharding
    if isinstance(sharding, DeviceMapping):
        return _cached_layout(sharding, ndim, id(sharding.mesh))
    raise ShardingTypeError(
        "A sharding is a PlacementMapping, NamedMapping or ShardingSpec. "
        f"Got {sharding!r} ({type(sharding).__name__})."
    )


@functools.lru_cache(maxsize=4096)
def _cached_layout(mapping: DeviceMapping, ndim: int, mesh_id: int) -> Layout:
    # Mappings are frozen values: their layout is computed once per rank (ops call
    # this on every reshard, and validation costs microseconds). ``mesh_id`` keeps
    # equal-but-distinct meshes apart, so a Tensor's .mesh is the very mesh passed in
    # (the cached Layout holds its mesh, so the id cannot be reused meanwhile).
    return mapping.to_layout(ndim)
