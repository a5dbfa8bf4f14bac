"""The resharding planner: a pure function from (source, target) layouts to steps.

Pure Python (no torch): a plan is computed, cached and printable before
anything runs. Each step is one collective (or one local op) over a group of
mesh axes; its ``before``/``after`` layouts chain from source to target.

Transition table (per mesh axis ``a``; ``S(d)`` = shards tensor dim ``d``):

    source        target        step
    R             S(d)          slice            local view, no communication
    S(d)          R             all_gather
    S(d)          S(e)          all_to_all       one collective, never gather+slice
    P(op)         R             all_reduce
    P(op)         S(d)          reduce_scatter
    P(op)         P(op2)        all_reduce, then make_partial
    R             P(op)         make_partial     local: identity element off the root
    S(d)          P(op)         all_gather, then make_partial
    S(a,b)        S(b,a)        permute          each device sends its block to one peer

The last row: a dim split over the same mesh axes in another order (evenly)
holds the same blocks on other devices, so one point-to-point permutation moves
them (a relabelling on the simulated mesh) instead of a gather and a slice.
Dims that trade axes (``[S(dp), S(tp)] -> [S(tp), S(dp)]``) go all_to_all,
permute, all_to_all: when no plain all_to_all applies, an axis moves into the
dim that wants it out of order, and a permute then puts that dim's target
prefix first and its leaving axes minor-most, where all_to_all can take them.

Order: all_to_all moves (with the permutes they need) first, then slices
(shrink the data), then partial resolution on the smallest data
(reduce_scatter where the target shards the axis, else all_reduce), then
all_gathers, the remaining slices, and make_partial (outer mesh axes first:
Partial axes reduce last axis first, so with mixed ops the outer identities
must be laid down before inner axes split them).
Steps over several axes of the same kind are merged into one collective over
the product group. When uneven pieces do not nest (e.g. 6 rows: 2-way
[3, 3] vs 4-way [2, 2, 1, 1]), a dim is gathered whole and re-sliced.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_bounds

__all__ = ["Plan", "Step", "make_plan", "permute_sources"]

COLLECTIVES = frozenset({"all_gather", "all_to_all", "all_reduce", "reduce_scatter", "permute"})


@dataclass(frozen=True, slots=True)
class Step:
    """One collective or local op over the mesh axes ``axes`` (a product group).

    ``dim``: the tensor dim gathered, sliced or scattered (``all_to_all``: the
    dim the axes leave); ``dim2``: the dim ``all_to_all`` moves them to.
    """

    kind: str
    axes: tuple[int, ...]
    before: Layout
    after: Layout
    dim: int | None = None
    dim2: int | None = None
    reduce_op: ReduceOp | None = None
    bytes_per_device: int = 0

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.before.mesh.axis_names[a] for a in self.axes)

    def __str__(self) -> str:
        args = [f"axes={self.axis_names}"]
        if self.kind == "all_to_all":
            args.append(f"dim {self.dim}->{self.dim2}")
        elif self.dim is not None:
            args.append(f"dim={self.dim}")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op.value}")
        return f"{self.kind}({', '.join(args)})  {_fmt_bytes(self.bytes_per_device)}/device"


@dataclass(frozen=True, slots=True)
class Plan:
    """Steps from ``src`` to ``dst`` for a tensor of ``shape`` and ``itemsize`` bytes."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    itemsize: int
    steps: tuple[Step, ...] = field(default=())

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.is_collective)

    @property
    def bytes_per_device(self) -> int:
        return sum(s.bytes_per_device for s in self.steps)

    def __str__(self) -> str:
        head = f"Plan {self.src} -> {self.dst}  shape={list(self.shape)}"
        if not self.steps:
            return head + "\n  (no steps: layouts are equal)"
        lines = [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        total = f"  total {_fmt_bytes(self.bytes_per_device)}/device moved"
        return "\n".join([head, *lines, total])

    def __len__(self) -> int:
        return len(self.steps)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _nests(size: int, outer: int, inner: int) -> bool:
    """True when splitting ``size`` into ``outer`` pieces, each into ``inner``,
    equals splitting it into ``outer * inner`` pieces directly."""
    if inner == 1 or size % (outer * inner) == 0:
        return True
    n = outer * inner
    for p in range(outer):
        lo, hi = split_bounds(size, outer, p)
        first, last = p * inner, p * inner + inner - 1
        if split_bounds(size, n, first)[0] != lo or split_bounds(size, n, last)[1] != hi:
            return False
    return True


class _Builder:
    """Accumulates steps, merging neighbours of the same kind into one collective."""

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

    def add(self, kind: str, axes: tuple[int, ...], after: Layout, dim: int | None = None,
            dim2: int | None = None, op: ReduceOp | None = None) -> None:
        before = self.cur
        last = self.steps[-1] if self.steps else None
        if (last is not None and last.kind == kind and last.dim == dim and last.dim2 == dim2
                and last.reduce_op == op and kind != "make_partial"):
            before, axes = last.before, last.axes + axes
            self.steps.pop()
        n = math.prod(before.mesh.mesh_shape[a] for a in axes)
        frac = (n - 1) / n if n else 0.0
        if kind == "all_gather":
            moved = int(self.block_bytes(after) * frac)
        elif kind == "all_reduce":
            moved = int(2 * self.block_bytes(after) * frac)
        elif kind in ("reduce_scatter", "all_to_all"):
            moved = int(self.block_bytes(before) * frac)
        elif kind == "permute":
            moved = self.block_bytes(before)
        else:
            moved = 0
        self.steps.append(Step(kind, axes, before, after, dim, dim2, op, moved))
        self.cur = after


def _replace_dim(layout: Layout, dim: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    dims = list(layout.dims)
    dims[dim] = axes
    return tuple(dims)


@functools.lru_cache(maxsize=4096)
def make_plan(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> Plan:
    """The cheapest sequence of steps taking a ``shape`` tensor from ``src`` to ``dst``.

    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> s0, s1 = (Layout(mesh, ((0,), ()), (None,)), Layout(mesh, ((), (0,)), (None,)))
    >>> [s.kind for s in make_plan(s0, s1, (8, 8), 4).steps]
    ['all_to_all']
    """
    if src.mesh != dst.mesh or src.ndim != dst.ndim or len(shape) != src.ndim:
        raise ValueError(f"make_plan needs layouts on one mesh and of rank {len(shape)}")
    b = _Builder(src, shape, itemsize)
    ndim = len(shape)

    def prefix(d: int) -> bool:
        cur, want = b.cur.dims[d], dst.dims[d]
        return want[: len(cur)] == cur

    def can_append(d: int, axes: tuple[int, ...]) -> bool:
        have = len(b.cur.dims[d])
        return (prefix(d) and dst.dims[d][have: have + len(axes)] == axes
                and _nests(shape[d], b.pieces(d), b.sizes(axes)))

    # 1. all_to_all: move an axis that must leave dim d to the dim that needs it next.
    def move(d: int, e: int, a: int) -> None:
        after = b.cur.with_dims(_replace_dim(
            b.cur.with_dims(_replace_dim(b.cur, d, b.cur.dims[d][:-1])), e, (*b.cur.dims[e], a)))
        b.add("all_to_all", (a,), after, d, e)

    def leaves_evenly(d: int) -> bool:
        """The minor-most axis of dim ``d`` can leave it (the rest's pieces nest)."""
        cur = b.cur.dims[d]
        return _nests(shape[d], math.prod(b.cur.mesh.mesh_shape[x] for x in cur[:-1]),
                      b.sizes(cur[-1:]))

    def reorderable(e: int, axes: tuple[int, ...]) -> bool:
        """Dim ``e`` holding ``axes`` (evenly) can be permuted into the target's prefix
        followed by the axes that must still leave it."""
        stay = [x for x in axes if x in dst.dims[e]]
        return (sorted(stay) == sorted(dst.dims[e][: len(stay)])
                and shape[e] % b.sizes(axes) == 0)

    for _ in range(4 * src.mesh.ndim + 1):  # each round ends stuck, or places an axis
        changed = True
        while changed:
            changed = False
            for d in range(ndim):
                cur = b.cur.dims[d]
                if not cur or prefix(d):
                    continue
                for e in range(ndim):
                    if e != d and can_append(e, cur[-1:]) and leaves_evenly(d):
                        move(d, e, cur[-1])
                        changed = True
                        break
        # Stuck (e.g. dims trading axes: [S(dp), S(tp)] -> [S(tp), S(dp)]): move an axis
        # into the dim that wants it although that dim's order is not right yet, then
        # permute that dim (target prefix first, leaving axes minor-most) so the plain
        # moves above can go on. Each such move puts an axis in its final dim.
        progressed = False
        for d in range(ndim):
            cur = b.cur.dims[d]
            if not cur or prefix(d) or not leaves_evenly(d):
                continue
            a = cur[-1]
            home = dst.dim_of_axis(a)
            if (home is not None and home != d and (*b.cur.dims[home], a) != dst.dims[home]
                    and reorderable(home, (*b.cur.dims[home], a))):
                move(d, home, a)
                progressed = True
                break
        for e in range(ndim):
            cur = b.cur.dims[e]
            if prefix(e) or not reorderable(e, cur):
                continue
            stay = tuple(x for x in cur if x in dst.dims[e])
            order = dst.dims[e][: len(stay)] + tuple(x for x in cur if x not in dst.dims[e])
            if order != cur:
                b.add("permute", cur, b.cur.with_dims(_replace_dim(b.cur, e, order)), e)
                progressed = True
        if not progressed:
            break

    def slice_ready() -> None:
        """Slice every replicated axis that extends a dim whose current split is a prefix."""
        for d in range(ndim):
            if not prefix(d):
                continue
            need = dst.dims[d][len(b.cur.dims[d]):]
            take: list[int] = []
            for a in need:
                if b.cur.partial[a] is not None or b.cur.dim_of_axis(a) is not None:
                    break
                take.append(a)
            if take and _nests(shape[d], b.pieces(d), b.sizes(tuple(take))):
                after = b.cur.with_dims(_replace_dim(b.cur, d, (*b.cur.dims[d], *take)))
                b.add("slice", tuple(take), after, d)

    # 2. slices that need nothing else first (they shrink the data for what follows).
    slice_ready()

    # 3. partial resolution on the smallest data.
    todo = [a for a in range(b.cur.mesh.ndim)
            if b.cur.partial[a] is not None and b.cur.partial[a] != dst.partial[a]]
    # Partial axes reduce last mesh axis first, so a PROD made on axis ``a`` puts its
    # identity (1) on every device of an inner SUM axis ``c > a``, which would sum to
    # size(c). Resolve such inner SUM axes first; step 6 makes them again afterwards.
    for a in range(b.cur.mesh.ndim):
        if dst.partial[a] is ReduceOp.PROD and b.cur.partial[a] is not ReduceOp.PROD:
            todo += [c for c in range(a + 1, b.cur.mesh.ndim)
                     if b.cur.partial[c] is ReduceOp.SUM and c not in todo]
    mixed = len({op for op in b.cur.partial if op is not None}) > 1
    if mixed and todo:
        # Ops that do not commute (sum vs max) reduce in a fixed order: the last
        # mesh axis first. Resolve every Partial axis in that order; the ones the
        # target keeps are re-made by make_partial at the end.
        for a in reversed(range(b.cur.mesh.ndim)):
            op = b.cur.partial[a]
            if op is not None:
                partial = list(b.cur.partial)
                partial[a] = None
                b.add("all_reduce", (a,), b.cur.with_partial(tuple(partial)), op=op)
        todo = []
    for d in range(ndim):
        if not prefix(d):
            continue
        need = dst.dims[d][len(b.cur.dims[d]):]
        run: list[int] = []
        for a in need:
            if a not in todo:
                break
            run.append(a)
        ops = {b.cur.partial[a] for a in run}
        while run and (len(ops) > 1 or not _nests(shape[d], b.pieces(d), b.sizes(tuple(run)))):
            run.pop()
            ops = {b.cur.partial[a] for a in run}
        if run:
            op = b.cur.partial[run[0]]
            partial = list(b.cur.partial)
            for a in run:
                partial[a] = None
                todo.remove(a)
            after = Layout(b.cur.mesh, _replace_dim(b.cur, d, (*b.cur.dims[d], *run)),
                           tuple(partial))
            b.add("reduce_scatter", tuple(run), after, d, op=op)
    for op in ReduceOp:
        group = tuple(a for a in todo if b.cur.partial[a] == op)
        if group:
            partial = list(b.cur.partial)
            for a in group:
                partial[a] = None
            b.add("all_reduce", group, b.cur.with_partial(tuple(partial)), op=op)

    # 4. all_gather what must leave each dim (whole dim when uneven pieces don't nest).
    for d in range(ndim):
        if prefix(d):
            continue
        cur, want = b.cur.dims[d], dst.dims[d]
        keep = 0
        while keep < len(cur) and keep < len(want) and cur[keep] == want[keep]:
            keep += 1
        outer = math.prod(b.cur.mesh.mesh_shape[a] for a in cur[:keep])
        while keep and not _nests(shape[d], outer, b.sizes(cur[keep:])):
            keep -= 1
            outer = math.prod(b.cur.mesh.mesh_shape[a] for a in cur[:keep])
        after = b.cur.with_dims(_replace_dim(b.cur, d, cur[:keep]))
        b.add("all_gather", cur[keep:], after, d)

    # 5. the remaining slices (a whole dim is always sliceable from replicated).
    slice_ready()
    for d in range(ndim):
        if b.cur.dims[d] != dst.dims[d]:
            if b.cur.dims[d]:  # uneven pieces that do not nest: gather, then slice whole
                after = b.cur.with_dims(_replace_dim(b.cur, d, ()))
                b.add("all_gather", b.cur.dims[d], after, d)
            after = b.cur.with_dims(_replace_dim(b.cur, d, dst.dims[d]))
            b.add("slice", dst.dims[d], after, d)

    # 6. make_partial: replicated axes the target holds as Partial, outer (lower) mesh
    # axes first: reduction runs last axis first, so an outer axis's identity elements
    # must be laid down before inner axes split them. Neighbours of one op are merged.
    make = [a for a in range(b.cur.mesh.ndim)
            if dst.partial[a] is not None and b.cur.partial[a] is None]
    while make:
        op = dst.partial[make[0]]
        same: list[int] = []
        while make and dst.partial[make[0]] == op:
            same.append(make.pop(0))
        partial = list(b.cur.partial)
        for a in same:
            partial[a] = op
        b.add("make_partial", tuple(same), b.cur.with_partial(tuple(partial)), op=op)

    assert b.cur == dst, f"planner did not reach the target: {b.cur} != {dst}"
    return Plan(src, dst, shape, itemsize, tuple(b.steps))


@functools.lru_cache(maxsize=1024)
def permute_sources(step: Step) -> tuple[int, ...]:
    """For a ``permute`` step: ``source[k]``, the device whose ``before`` block is
    device ``k``'s ``after`` block (dim ``step.dim`` is split over the same axes in
    another order; every other coordinate is kept).

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> plan = make_plan(Layout(mesh, ((0, 1),), (None, None)),
    ...                  Layout(mesh, ((1, 0),), (None, None)), (4,), 4)
    >>> permute_sources(plan.steps[0])  # blocks 0 1 2 3 held by devices 0 2 1 3
    (0, 2, 1, 3)
    """
    assert step.kind == "permute" and step.dim is not None
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
