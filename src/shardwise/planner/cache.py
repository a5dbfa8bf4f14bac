"""The planner's cached entry points: :func:`make_plan` and :func:`permute_sources`.

Invariants:
- Both are pure functions of hashable values (layouts, shapes, steps), so their
  results are cached (LRU) and shared by every tensor and runtime.
- Pure Python: no torch.
"""

from __future__ import annotations

import functools

from shardwise.planner.phases import Planner
from shardwise.planner.steps import Plan, Step, StepKind
from shardwise.sharding.layout import Layout

__all__ = ["make_plan", "permute_sources"]


@functools.lru_cache(maxsize=4096)
def make_plan(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> Plan:
    """The cheapest sequence of steps taking a ``shape`` tensor from ``src`` to ``dst``.

    The phases and their order are :class:`~shardwise.planner.phases.Planner`'s; the
    transition table is in :mod:`shardwise.planner`'s docstring.

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> s0, s1 = (Layout(mesh, ((0,), ()), (None,)), Layout(mesh, ((), (0,)), (None,)))
    >>> [s.kind for s in make_plan(s0, s1, (8, 8), 4).steps]
    [<StepKind.ALL_TO_ALL: 'all_to_all'>]
    >>> print(make_plan(s0, s1, (8, 8), 4))
    Plan DeviceMesh(x=4)[S(x), R] -> DeviceMesh(x=4)[R, S(x)]  shape=[8, 8]
      1. all_to_all(axes=('x',), dim 0->1)  48 B/device
      total 48 B/device moved
    """
    return Planner(src, dst, shape, itemsize).plan()


@functools.lru_cache(maxsize=1024)
def permute_sources(step: Step) -> tuple[int, ...]:
    """For a ``permute`` step: ``source[k]``, the device whose ``before`` block is
    device ``k``'s ``after`` block (dim ``step.dim`` is split over the same axes in
    another order; every other coordinate is kept).

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> plan = make_plan(Layout(mesh, ((0, 1),), (None, None)),
    ...                  Layout(mesh, ((1, 0),), (None, None)), (4,), 4)
    >>> permute_sources(plan.steps[0])  # blocks 0 1 2 3 held by devices 0 2 1 3
    (0, 2, 1, 3)
    """
    assert step.kind is StepKind.PERMUTE and step.dim is not None
    mesh = step.before.mesh
    old, new = step.before.dims[step.dim], step.after.dims[step.dim]
    out = []
    for k in range(mesh.num_devices):
        coord = list(mesh.coord_of(k))
        index = 0  # this device's block along the dim, in the ``after`` order
        for a in new:
            index = index * mesh.mesh_shape[a] + coord[a]
        for a in reversed(old):  # the device holding that block in the ``before`` order
            index, coord[a] = divmod(index, mesh.mesh_shape[a])
        out.append(mesh.index_of(coord))
    return tuple(out)
