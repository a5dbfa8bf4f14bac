"""DeviceMesh: an N-dimensional grid of devices with named axes.

Invariants:
- Frozen and validated at construction: ``prod(mesh_shape) == len(devices)``,
  one unique, non-empty string name per axis, no device twice.
- Devices are laid out row-major: device ``k`` has coordinate
  ``unravel(k, mesh_shape)``.
- Constructing a mesh has no side effects; ``with mesh:`` makes it the
  current mesh for ops called with ``mesh=None``.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.sharding.errors import ShardingError, ShardingTypeError, check_items

__all__ = ["DeviceMesh", "current_mesh"]

_CURRENT: contextvars.ContextVar[tuple[DeviceMesh, ...]] = contextvars.ContextVar(
    "shardwise_mesh_stack", default=()
)


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _CURRENT.get()
    return stack[-1] if stack else None


@dataclass(frozen=True, slots=True, eq=False)
class DeviceMesh:
    """An N-dimensional logical grid of devices.

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> mesh
    DeviceMesh(dp=2, tp=2)
    >>> mesh.device_coord(mesh.devices[3])
    (1, 1)

    ::

        device   CPU(0)  CPU(1)  CPU(2)  CPU(3)
        (dp,tp)  (0,0)   (0,1)   (1,0)   (1,1)
    """

    devices: tuple[Any, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    _index: dict[Any, int] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        devices = check_items(self.devices, "DeviceMesh devices",
                              "a sequence of devices, e.g. (CPU(0), CPU(1))")
        shape = _mesh_shape(self.mesh_shape, "DeviceMesh")
        names = _axis_names(self.axis_names, "DeviceMesh")
        if not devices:
            raise ShardingError(
                f"DeviceMesh needs at least one device. Got devices=() for mesh_shape={shape}."
            )
        if math.prod(shape) != len(devices):
            raise ShardingError(
                f"DeviceMesh mesh_shape={shape} holds {math.prod(shape)} devices but "
                f"{len(devices)} were given: prod(mesh_shape) must equal len(devices). "
                "Pass one device per grid cell."
            )
        if len(names) != len(shape):
            raise ShardingError(
                f"DeviceMesh has {len(shape)} axes (mesh_shape={shape}) but "
                f"{len(names)} names {names}: give exactly one name per axis."
            )
        for name in names:
            if not isinstance(name, str) or not name:
                raise ShardingError(
                    f"DeviceMesh axis names must be non-empty strings. Got {name!r} "
                    f"in {names}."
                )
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ShardingError(
                f"DeviceMesh axis names must be unique. Got {names}: {dupes} repeated. "
                "Rename the axes."
            )
        for dev in devices:
            if not isinstance(dev, Hashable):
                raise ShardingError(f"DeviceMesh devices must be hashable values. Got {dev!r}.")
        index = {dev: k for k, dev in enumerate(devices)}
        if len(index) != len(devices):
            seen = sorted({repr(d) for d in devices if devices.count(d) > 1})
            raise ShardingError(
                f"DeviceMesh devices must be unique. Got {', '.join(seen)} more than once."
            )
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_hash", hash((devices, shape, names)))

    # --- construction helpers -------------------------------------------------
    @classmethod
    def cpu(
        cls, mesh_shape: Sequence[int] | int, axis_names: Sequence[str] | str
    ) -> DeviceMesh:
        """A simulated mesh of virtual CPU devices ``CPU(0) .. CPU(n-1)``."""
        from shardwise.sharding.devices import CPU

        shape = _mesh_shape(mesh_shape, "DeviceMesh.cpu")
        names = _axis_names(axis_names, "DeviceMesh.cpu")
        return cls(tuple(CPU(i) for i in range(math.prod(shape))), shape, names)

    @classmethod
    def single(cls, device: Any, axis_name: str = "_") -> DeviceMesh:
        """The one-device mesh a single-device tensor lives on."""
        return cls((device,), (1,), (axis_name,))

    # --- value semantics ----------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.mesh_shape == other.mesh_shape
            and self.axis_names == other.axis_names
            and self.devices == other.devices
        )

    def __hash__(self) -> int:
        return self._hash

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        return self  # a frozen value (Layout.__deepcopy__ says why)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape, strict=True))
        ids = [getattr(d, "id", d) for d in self.devices]
        if ids != list(range(len(ids))):  # a submesh: two stages' meshes read apart
            return f"DeviceMesh({axes}; devices {_ids_text(ids)})"
        return f"DeviceMesh({axes})"

    # --- shape queries ----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh_shape

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def is_single(self) -> bool:
        return len(self.devices) == 1

    @property
    def is_simulated(self) -> bool:
        """True when its devices are virtual devices sharing one memory: virtual CPUs
        (host memory), or virtual devices on one accelerator. Their blocks never move
        between torch devices.

        >>> from shardwise.sharding.devices import Accelerator, VirtualDevice
        >>> on_gpu = DeviceMesh(tuple(VirtualDevice(i) for i in range(4)), (2, 2), ("a", "b"))
        >>> DeviceMesh.cpu(4, "x").is_simulated, on_gpu.is_simulated
        (True, True)
        >>> DeviceMesh((Accelerator(0), Accelerator(1)), (2,), ("x",)).is_simulated
        False
        """
        first = getattr(self.devices[0], "memory", None)
        return first is not None and all(
            getattr(d, "memory", None) == first for d in self.devices)

    def axis_index(self, axis: str | int) -> int:
        """The position of mesh axis ``axis`` (a name, or an index that may be negative)."""
        if isinstance(axis, str):
            try:
                return self.axis_names.index(axis)
            except ValueError:
                raise ShardingError(
                    f"Unknown mesh axis {axis!r}: {self!r} has axes {list(self.axis_names)}. "
                    "Use one of those names."
                ) from None
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ShardingError(
                f"A mesh axis is named by a str or an int index. Got {axis!r} "
                f"({type(axis).__name__}); {self!r} has axes {list(self.axis_names)}."
            )
        if not -self.ndim <= axis < self.ndim:
            raise ShardingError(
                f"Mesh axis index {axis} is out of range for {self!r} with {self.ndim} "
                f"axes: use -{self.ndim} <= axis < {self.ndim} or an axis name."
            )
        return axis % self.ndim

    def axis_size(self, axis: str | int) -> int:
        return self.mesh_shape[self.axis_index(axis)]

    def submesh(self, **coords: int) -> DeviceMesh:
        """The mesh of the devices at the given coordinates of some axes, over the
        other axes (in order): a pipeline stage's ``(dp, tp)`` slice of a 3-D mesh.

        >>> mesh = DeviceMesh.cpu((2, 2, 2), ("pp", "dp", "tp"))
        >>> stage = mesh.submesh(pp=1)
        >>> stage, stage.devices[0]
        (DeviceMesh(dp=2, tp=2; devices 4..7), CPU(4))
        """
        fixed: dict[int, int] = {}
        for name, c in coords.items():
            a = self.axis_index(name)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < self.mesh_shape[a]:
                raise ShardingError(
                    f"submesh({name}={c!r}): {self!r} has {self.mesh_shape[a]} devices along "
                    f"{name!r}, so the coordinate must be an int in [0, {self.mesh_shape[a]})."
                )
            fixed[a] = c
        if not fixed:
            raise ShardingError(
                f"submesh() needs at least one axis=coordinate, e.g. submesh(pp=0); {self!r} "
                f"has axes {list(self.axis_names)}."
            )
        if len(fixed) == self.ndim:
            raise ShardingError(
                f"submesh({coords}) fixes every axis of {self!r}: leave at least one axis "
                "free (a mesh needs one axis).")
        rest = [a for a in range(self.ndim) if a not in fixed]
        devices = []
        for k in range(math.prod(self.mesh_shape[a] for a in rest)):
            coord = [0] * self.ndim
            for a, c in fixed.items():
                coord[a] = c
            for a, c in zip(rest, _unravel(k, [self.mesh_shape[a] for a in rest]), strict=True):
                coord[a] = c
            devices.append(self.devices[self.index_of(coord)])
        return DeviceMesh(tuple(devices), tuple(self.mesh_shape[a] for a in rest),
                          tuple(self.axis_names[a] for a in rest))

    def device_index(self, device: Any) -> int:
        """The row-major position of ``device`` in the mesh."""
        try:
            return self._index[device]
        except KeyError:
            raise ShardingError(
                f"{device!r} is not in {self!r}; its devices are {list(self.devices)}."
            ) from None

    def coord_of(self, index: int) -> tuple[int, ...]:
        """Row-major coordinate of flat device index ``index``."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ShardingError(
                f"A flat device index must be an int. Got {index!r} ({type(index).__name__})."
            )
        if not 0 <= index < self.num_devices:
            raise ShardingError(
                f"Device index {index} is out of range for {self!r} with {self.num_devices} "
                f"devices: use 0 <= index < {self.num_devices}."
            )
        return tuple(_unravel(index, self.mesh_shape))

    def index_of(self, coord: Sequence[int]) -> int:
        """Flat device index of coordinate ``coord``."""
        coord = check_items(coord, "index_of coord", "one int per mesh axis")
        if len(coord) != self.ndim:
            raise ShardingError(
                f"Coordinate {coord} has {len(coord)} entries but {self!r} has {self.ndim} "
                "axes: give one coordinate per mesh axis."
            )
        index = 0
        for c, size in zip(coord, self.mesh_shape, strict=True):
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
                raise ShardingError(
                    f"Coordinate {coord} is out of range for {self!r}: entry {c!r} must be an "
                    f"int with 0 <= c < {size}."
                )
            index = index * size + c
        return index

    def device_coord(self, device: Any) -> tuple[int, ...]:
        return self.coord_of(self.device_index(device))

    def devices_along(self, axis: str | int, coord: Sequence[int]) -> tuple[Any, ...]:
        """The devices that share ``coord`` on every axis but ``axis``, in axis order."""
        a = self.axis_index(axis)
        base = list(check_items(coord, "devices_along coord", "one int per mesh axis"))
        self.index_of(base)  # validates the coordinate
        out = []
        for i in range(self.mesh_shape[a]):
            base[a] = i
            out.append(self.devices[self.index_of(base)])
        return tuple(out)

    def groups(self, axes: Sequence[str | int]) -> list[list[int]]:
        """Flat device indices grouped so that each group varies only over ``axes``.

        ``axes`` are mesh axis names or indices (negative counts from the end).
        Within a group the order is row-major over ``axes`` (in the given order).
        """
        idx = [self.axis_index(a) for a in check_items(
            axes, "groups axes", "a sequence of mesh axis names or indices, e.g. ['tp']")]
        if len(set(idx)) != len(idx):
            raise ShardingError(
                f"groups({list(axes)!r}) names a mesh axis twice; {self!r} has axes "
                f"{list(self.axis_names)}. Name each axis once."
            )
        rest = [a for a in range(self.ndim) if a not in idx]
        out: list[list[int]] = []
        for rest_idx in range(math.prod(self.mesh_shape[a] for a in rest)):
            rest_coord = _unravel(rest_idx, [self.mesh_shape[a] for a in rest])
            group = []
            for k in range(math.prod(self.mesh_shape[a] for a in idx)):
                sub = _unravel(k, [self.mesh_shape[a] for a in idx])
                coord = [0] * self.ndim
                for a, c in zip(rest, rest_coord, strict=True):
                    coord[a] = c
                for a, c in zip(idx, sub, strict=True):
                    coord[a] = c
                group.append(self.index_of(coord))
            out.append(group)
        return out

    # --- current-mesh context -------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        _CURRENT.set((*_CURRENT.get(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _CURRENT.get()
        _CURRENT.set(stack[:-1])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.devices)


def _mesh_shape(value: Any, where: str) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints) as a shape of sizes >= 1, or a clear error."""
    shape = (value,) if isinstance(value, int) else check_items(
        value, f"{where} mesh_shape", "an int or a sequence of ints, e.g. (2, 4)")
    for a, size in enumerate(shape):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ShardingTypeError(
                f"{where} mesh_shape={shape}: every axis size must be an int >= 1. Got "
                f"{size!r} ({type(size).__name__}) at axis {a}; use ints, e.g. (2, 4)."
            )
        if size < 1:
            raise ShardingError(
                f"{where} mesh_shape={shape}: every axis size must be an int >= 1. Got "
                f"{size!r} at axis {a}; an axis of size 1 keeps the name without a split."
            )
    return shape


def _axis_names(value: Any, where: str) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else check_items(
        value, f"{where} axis_names", "a str or a sequence of str, e.g. ('dp', 'tp')")


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    coord = []
    for size in reversed(shape):
        index, rem = divmod(index, size)
        coord.append(rem)
    return list(reversed(coord))


def _ids_text(ids: list[int]) -> str:
    """``4..7`` for a run of consecutive ids, else the list."""
    if len(ids) > 1 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return str(ids)
