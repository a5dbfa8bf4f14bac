"""Shape arithmetic of sharded tensors: the split rule and per-device shapes.

Invariants (the split rule):
- A dim of size ``g`` over ``n`` shards gives shard ``k`` the size
  ``g // n + (1 if k < g % n else 0)``; shards are contiguous and in order,
  so earlier shards are never smaller. Size-0 shards are legal.
- A dim split over several mesh axes is split once into ``prod(sizes)``
  pieces; device coordinate ``(i, j)`` over axes ``(a, b)`` holds piece
  ``i * size(b) + j``.
- Per-device lists are in row-major device order (``DeviceMesh.devices``).

Example: 5 rows over 2 devices give shards of 3 and 2 rows (rows 0:3, 3:5).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.sharding.errors import ShardingError, ShardingTypeError, check_items
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement

__all__ = [
    "check_shape",
    "global_shape_from_local",
    "local_bounds",
    "local_shape",
    "local_shard_shape_from_global",
    "piece_index",
    "reshape_groups",
    "shard_shape",
    "split_bounds",
    "split_size",
]


def split_size(size: int, n: int, k: int) -> int:
    """Size of piece ``k`` when ``size`` is split into ``n`` pieces."""
    return size // n + (1 if k < size % n else 0)


def split_bounds(size: int, n: int, k: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``k`` when ``size`` is split into ``n`` pieces."""
    base, rem = size // n, size % n  # (not divmod: a symbolic size, from dynamic shapes)
    start = k * base + min(k, rem)
    return start, start + base + (1 if k < rem else 0)


def piece_index(mesh_shape: Sequence[int], axes: Sequence[int], coord: Sequence[int]) -> tuple[
    int, int
]:
    """``(piece, pieces)``: which piece of a dim split over ``axes`` the device at
    ``coord`` holds, and how many pieces there are."""
    piece, pieces = 0, 1
    for a in axes:
        piece = piece * mesh_shape[a] + coord[a]
        pieces *= mesh_shape[a]
    return piece, pieces


def local_bounds(
    global_shape: Sequence[int], layout: Layout, coord: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """Per-dim ``(start, stop)`` of the block the device at ``coord`` holds."""
    _check_rank(global_shape, layout)
    out = []
    for size, axes in zip(global_shape, layout.dims, strict=True):
        if not axes:
            out.append((0, size))
        else:
            piece, pieces = piece_index(layout.mesh.mesh_shape, axes, coord)
            out.append(split_bounds(size, pieces, piece))
    return tuple(out)


def local_shape(global_shape: Sequence[int], layout: Layout, coord: Sequence[int]) -> tuple[
    int, ...
]:
    """Shape of the block the device at ``coord`` holds."""
    _check_rank(global_shape, layout)
    out = []
    for size, axes in zip(global_shape, layout.dims, strict=True):
        if not axes:
            out.append(size)
        else:
            piece, pieces = piece_index(layout.mesh.mesh_shape, axes, coord)
            out.append(split_size(size, pieces, piece))
    return tuple(out)


def _check_rank(global_shape: Sequence[int], layout: Layout) -> None:
    if len(global_shape) != layout.ndim:
        raise ShardingError(
            f"Shape {tuple(global_shape)} has rank {len(global_shape)} but the layout "
            f"{layout} is for rank {layout.ndim}: they must match."
        )


def check_shape(shape: Sequence[int] | int, what: str = "shape") -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints >= 0) as a tuple, or an error naming
    ``what``: :class:`ShardingTypeError` for a wrong type, ShardingError for a negative size.

    >>> check_shape(4), check_shape([2, 3])
    ((4,), (2, 3))
    """
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    out = check_items(shape, what, "an int or a sequence of ints, e.g. (4, 2)")
    for d, s in enumerate(out):
        if isinstance(s, bool) or not isinstance(s, int):
            raise ShardingTypeError(f"{what} {out} must hold ints >= 0. Got {s!r} "
                                    f"({type(s).__name__}) at dim {d}.")
        if s < 0:
            raise ShardingError(f"{what} {out} must hold ints >= 0. Got {s!r} at dim {d}.")
    return out



def shard_shape(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The per-shard shape: each ``Sharded(k)`` on mesh axis ``i`` divides dim ``k``
    by ``mesh_shape[i]``. For uneven splits this is the largest shard (that of
    the first device); use :func:`local_shard_shape_from_global` for every device.

    >>> shard_shape((8, 6), [Sharded(0), Sharded(1)], (2, 4))
    (4, 2)
    """
    shape = check_shape(global_shape, "global_shape")
    mesh = DeviceMesh(tuple(range(_prod(mesh_shape))), tuple(mesh_shape),
                      tuple(f"a{i}" for i in range(len(tuple(mesh_shape)))))
    layout = Layout.from_placements(mesh, tuple(placements), len(shape))
    return local_shape(shape, layout, (0,) * mesh.ndim)


def local_shard_shape_from_global(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> list[tuple[int, ...]]:
    """One local shape per device, row-major over the mesh.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> local_shard_shape_from_global((5, 3), mesh, [Sharded(0)])
    [(3, 3), (2, 3)]
    """
    shape = check_shape(global_shape, "global_shape")
    layout = Layout.from_placements(mesh, tuple(placements), len(shape))
    return [local_shape(shape, layout, mesh.coord_of(k)) for k in range(mesh.num_devices)]


def global_shape_from_local(
    local_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    local_shapes: Sequence[Sequence[int]] | None = None,
) -> tuple[int, ...]:
    """The global shape from one device's local shape, assuming an even split.

    An uneven split cannot be told from one shape (3 rows over 2 devices may be
    5 or 6 rows): pass ``local_shapes`` (one per device, row-major) for the exact
    global shape; they are checked against the split rule.

    >>> global_shape_from_local((3, 3), DeviceMesh.cpu(2, "x"), [Sharded(0)])
    (6, 3)
    """
    shape = check_shape(local_shape, "local_shape")
    layout = Layout.from_placements(mesh, tuple(placements), len(shape))
    if local_shapes is None:
        out = list(shape)
        for d, axes in enumerate(layout.dims):
            for a in axes:
                out[d] *= mesh.mesh_shape[a]
        return tuple(out)
    shapes = [check_shape(s, "local_shapes entry") for s in local_shapes]
    if len(shapes) != mesh.num_devices:
        raise ShardingError(
            f"local_shapes gives {len(shapes)} shapes for {mesh!r} with {mesh.num_devices} "
            "devices: give one per device, row-major."
        )
    if shape not in shapes or any(len(s) != len(shape) for s in shapes):
        raise ShardingError(
            f"local_shapes {shapes} must all have the rank of local_shape {shape} and "
            "include it (it is one device's shard). Pass consistent shapes."
        )
    out = list(shape)
    for d, axes in enumerate(layout.dims):
        if axes:
            total = 0
            for k in range(mesh.num_devices):
                coord = mesh.coord_of(k)
                if all(coord[a] == 0 for a in range(mesh.ndim) if a not in axes):
                    total += shapes[k][d]
            out[d] = total
    result = tuple(out)
    expected = local_shard_shape_from_global(result, mesh, placements)
    if [tuple(s) for s in shapes] != expected:
        raise ShardingError(
            f"local_shapes {shapes} do not follow the split rule for global shape {result} "
            f"and placements {list(placements)} (expected {expected}). Shards must be "
            "contiguous with sizes g // n + (1 if k < g % n else 0)."
        )
    return result


def reshape_groups(src: Sequence[int], new: Sequence[int]
                   ) -> list[tuple[list[int], list[int]]]:
    """How a reshape of ``src`` (at least one element) to ``new`` (as many) aligns
    dims: ``(source dims, target dims)`` per run of equal element count, in order; a
    size-1 dim that appears or disappears on its own is ``([], [j])`` / ``([i], [])``.

    >>> reshape_groups((2, 32), (2, 4, 8))
    [([0], [0]), ([1], [1, 2])]
    >>> reshape_groups((3, 1, 4), (12,))
    [([0, 1, 2], [0])]
    >>> reshape_groups((1, 6), (6,))
    [([0], []), ([1], [0])]
    """
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(new):
        if i < len(src) and src[i] == 1 and (j >= len(new) or new[j] != 1):
            out.append(([i], []))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i >= len(src) or src[i] != 1):
            out.append(([], [j]))
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], new[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= new[j]
                gj.append(j)
                j += 1
        out.append((gi, gj))
    return out


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
