"""Step accumulation and cost for the planner's phases.

Invariants:
- :class:`StepList` holds the layout reached so far (``cur``); each added step
  starts there and ends at its ``after`` layout, so steps always chain.
- Neighbouring steps of one kind over the same dims and op merge into one
  collective over the product group (never ``make_partial``: its outer-axis-first
  order matters).
- Bytes per device are the data each device sends (ring algorithms), computed
  from block sizes only; pure Python.
"""

from __future__ import annotations

import math

from shardwise.planner.steps import Step, StepKind
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_bounds

__all__ = ["StepList", "nests", "replace_dim"]


def nests(size: int, outer: int, inner: int) -> bool:
    """True when splitting ``size`` into ``outer`` pieces, each into ``inner``,
    equals splitting it into ``outer * inner`` pieces directly.

    >>> nests(8, 2, 2), nests(6, 2, 2)   # 6 rows: [3, 3] then [2, 1, 2, 1] != [2, 2, 1, 1]
    (True, False)
    """
    if inner == 1 or size % (outer * inner) == 0:
        return True
    n = outer * inner
    for p in range(outer):
        lo, hi = split_bounds(size, outer, p)
        first, last = p * inner, p * inner + inner - 1
        if split_bounds(size, n, first)[0] != lo or split_bounds(size, n, last)[1] != hi:
            return False
    return True


def replace_dim(layout: Layout, dim: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``layout.dims`` with dim ``dim`` split over ``axes`` instead."""
    dims = list(layout.dims)
    dims[dim] = axes
    return tuple(dims)


class StepList:
    """Accumulates steps from ``src``, merging neighbours of the same kind into one
    collective."""

    def __init__(self, src: Layout, shape: tuple[int, ...], itemsize: int) -> None:
        self.cur = src
        self.shape = shape
        self.itemsize = itemsize
        self.steps: list[Step] = []

    def sizes(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.cur.mesh.mesh_shape[a] for a in axes)

    def pieces(self, dim: int, layout: Layout | None = None) -> int:
        lay = layout or self.cur
        return math.prod(lay.mesh.mesh_shape[a] for a in lay.dims[dim])

    def block_bytes(self, layout: Layout) -> int:
        n = self.itemsize
        for size, axes in zip(self.shape, layout.dims):
            pieces = math.prod(layout.mesh.mesh_shape[a] for a in axes)
            n *= -(-size // pieces) if pieces else size
        return n

    def moved(self, kind: StepKind, n: int, before: Layout, after: Layout) -> int:
        """Bytes each device sends for a ``kind`` step over a group of ``n`` devices."""
        frac = (n - 1) / n if n else 0.0
        match kind:
            case StepKind.ALL_GATHER:
                return _share(self.block_bytes(after), frac, n)
            case StepKind.ALL_REDUCE:
                return _share(2 * self.block_bytes(after), frac, n)
            case StepKind.REDUCE_SCATTER | StepKind.ALL_TO_ALL:
                return _share(self.block_bytes(before), frac, n)
            case StepKind.PERMUTE:
                return self.block_bytes(before)
            case StepKind.SLICE | StepKind.MAKE_PARTIAL:
                return 0

    def add(self, kind: StepKind, axes: tuple[int, ...], after: Layout, dim: int | None = None,
            dim2: int | None = None, op: ReduceOp | None = None) -> None:
        before = self.cur
        last = self.steps[-1] if self.steps else None
        if (last is not None and last.kind is kind and last.dim == dim and last.dim2 == dim2
                and last.reduce_op == op and kind is not StepKind.MAKE_PARTIAL):
            before, axes = last.before, last.axes + axes
            self.steps.pop()
        n = math.prod(before.mesh.mesh_shape[a] for a in axes)
        self.steps.append(Step(kind, axes, before, after, dim, dim2, op,
                               self.moved(kind, n, before, after)))
        self.cur = after


def _share(nbytes: int, frac: float, n: int) -> int:
    """``int(nbytes * frac)``; a symbolic size (torch.compile's dynamic shapes), which
    ``int()`` of a float would specialise, in integer arithmetic instead."""
    if type(nbytes) is int:
        return int(nbytes * frac)
    return nbytes * (n - 1) // n if n else 0
