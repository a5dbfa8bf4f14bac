"""Point-to-point: ``ppermute`` moves local blocks between devices by a
permutation (the layout is kept). Gradient: the inverse permutation."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from shardwise.api.checks import need_tensor
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor

__all__ = ["ppermute"]


def _check_permutation(permutation: Any, n: int, where: str) -> dict[int, int]:
    try:
        pairs = [tuple(p) for p in permutation]
    except TypeError:
        raise ShardingTypeError(
            f"ppermute permutation must be a list of (src, dst) pairs. Got {permutation!r}."
        ) from None
    dst_to_src: dict[int, int] = {}
    seen_src: set[int] = set()
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(i, int) and not isinstance(i, bool)
                                     for i in pair):
            raise ShardingTypeError(
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
    reps = layout.representatives()
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
    t = need_tensor(sharded_tensor, "ppermute")
    if t.dist_layout.orders:  # the blocks moved are the natural order's
        t = t.relayout(t.dist_layout.with_orders(()))
    mesh, layout = t.mesh, t.dist_layout
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
