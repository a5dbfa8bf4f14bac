"""The phases of :func:`~shardwise.planner.make_plan`, as methods of :class:`Planner`.

Invariants:
- Phases run in a fixed order (``PHASES``) on one :class:`StepList`; each only
  appends steps, and the last leaves the layout equal to the target (asserted).
- A phase never undoes an earlier one's work: all_to_all moves and permutes put
  axes in their final dim; slices and reduce_scatters only extend a dim whose
  current split is a prefix of the target's.
- Pure Python: no torch.
"""

from __future__ import annotations

import math

from shardwise.planner.builder import StepList, nests, replace_dim
from shardwise.planner.steps import Plan, StepKind
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp

__all__ = ["Planner"]


class Planner:
    """Plans one (``src``, ``dst``, ``shape``, ``itemsize``): :meth:`plan` runs the phases.

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> s0, s1 = Layout(mesh, ((0,), ()), (None,)), Layout(mesh, ((), (0,)), (None,))
    >>> [str(s.kind) for s in Planner(s0, s1, (8, 8), 4).plan().steps]
    ['all_to_all']
    """

    PHASES = ("moves", "slice_ready", "resolve_partials", "gathers", "remaining_slices",
              "make_partials")

    def __init__(self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> None:
        if src.mesh != dst.mesh or src.ndim != dst.ndim or len(shape) != src.ndim:
            raise ValueError(
                f"make_plan needs layouts on one mesh and of rank {len(shape)} (the shape's). "
                f"Got {src} on {src.mesh!r} and {dst} on {dst.mesh!r}. Plan between layouts "
                "of one mesh and the tensor's rank.")
        self.src, self.dst, self.shape, self.itemsize = src, dst, shape, itemsize
        self.b = StepList(src, shape, itemsize)
        self.ndim = len(shape)

    def plan(self) -> Plan:
        for phase in self.PHASES:
            getattr(self, phase)()
        assert self.b.cur == self.dst, f"planner did not reach the target: {self.b.cur} != " \
                                       f"{self.dst}"
        return Plan(self.src, self.dst, self.shape, self.itemsize, tuple(self.b.steps))

    # --- predicates on the layout reached so far ---------------------------------------
    def prefix(self, d: int) -> bool:
        """Dim ``d``'s current split is a prefix of the target's."""
        cur, want = self.b.cur.dims[d], self.dst.dims[d]
        return want[: len(cur)] == cur

    def can_append(self, d: int, axes: tuple[int, ...]) -> bool:
        have = len(self.b.cur.dims[d])
        return (self.prefix(d) and self.dst.dims[d][have: have + len(axes)] == axes
                and nests(self.shape[d], self.b.pieces(d), self.b.sizes(axes)))

    def leaves_evenly(self, d: int) -> bool:
        """The minor-most axis of dim ``d`` can leave it (the rest's pieces nest)."""
        cur = self.b.cur.dims[d]
        return nests(self.shape[d], math.prod(self.b.cur.mesh.mesh_shape[x] for x in cur[:-1]),
                     self.b.sizes(cur[-1:]))

    def reorderable(self, e: int, axes: tuple[int, ...]) -> bool:
        """Dim ``e`` holding ``axes`` (evenly) can be permuted into the target's prefix
        followed by the axes that must still leave it."""
        stay = [x for x in axes if x in self.dst.dims[e]]
        return (sorted(stay) == sorted(self.dst.dims[e][: len(stay)])
                and self.shape[e] % self.b.sizes(axes) == 0)

    # --- 1. all_to_all moves (with the permutes they need) -----------------------------
    def move(self, d: int, e: int, a: int) -> None:
        """all_to_all: axis ``a`` (minor-most in dim ``d``) moves to the end of dim ``e``."""
        cur = self.b.cur
        after = cur.with_dims(replace_dim(
            cur.with_dims(replace_dim(cur, d, cur.dims[d][:-1])), e, (*cur.dims[e], a)))
        self.b.add(StepKind.ALL_TO_ALL, (a,), after, d, e)

    def plain_moves(self) -> None:
        """Move an axis that must leave dim d to the dim that needs it next, while any can."""
        changed = True
        while changed:
            changed = False
            for d in range(self.ndim):
                cur = self.b.cur.dims[d]
                if not cur or self.prefix(d):
                    continue
                for e in range(self.ndim):
                    if e != d and self.can_append(e, cur[-1:]) and self.leaves_evenly(d):
                        self.move(d, e, cur[-1])
                        changed = True
                        break

    def unstick(self) -> bool:
        """When stuck (e.g. dims trading axes: [S(dp), S(tp)] -> [S(tp), S(dp)]), move an
        axis into the dim that wants it although that dim's order is not right yet, then
        permute dims (target prefix first, leaving axes minor-most) so that plain moves
        can go on. Each such move puts an axis in its final dim. True if anything moved."""
        progressed = False
        for d in range(self.ndim):
            cur = self.b.cur.dims[d]
            if not cur or self.prefix(d) or not self.leaves_evenly(d):
                continue
            a = cur[-1]
            home = self.dst.dim_of_axis(a)
            if (home is not None and home != d
                    and (*self.b.cur.dims[home], a) != self.dst.dims[home]
                    and self.reorderable(home, (*self.b.cur.dims[home], a))):
                self.move(d, home, a)
                progressed = True
                break
        for e in range(self.ndim):
            cur = self.b.cur.dims[e]
            if self.prefix(e) or not self.reorderable(e, cur):
                continue
            stay = tuple(x for x in cur if x in self.dst.dims[e])
            order = self.dst.dims[e][: len(stay)] + tuple(
                x for x in cur if x not in self.dst.dims[e])
            if order != cur:
                self.b.add(StepKind.PERMUTE, cur,
                           self.b.cur.with_dims(replace_dim(self.b.cur, e, order)), e)
                progressed = True
        return progressed

    def moves(self) -> None:
        for _ in range(4 * self.src.mesh.ndim + 1):  # each round ends stuck, or places an axis
            self.plain_moves()
            if not self.unstick():
                break

    # --- 2. and 5. slices ---------------------------------------------------------------
    def slice_ready(self) -> None:
        """Slice every replicated axis that extends a dim whose current split is a prefix
        (they shrink the data for what follows)."""
        b = self.b
        for d in range(self.ndim):
            if not self.prefix(d):
                continue
            take: list[int] = []
            for a in self.dst.dims[d][len(b.cur.dims[d]):]:
                if b.cur.partial[a] is not None or b.cur.dim_of_axis(a) is not None:
                    break
                take.append(a)
            if take and nests(self.shape[d], b.pieces(d), b.sizes(tuple(take))):
                after = b.cur.with_dims(replace_dim(b.cur, d, (*b.cur.dims[d], *take)))
                b.add(StepKind.SLICE, tuple(take), after, d)

    # --- 3. partial resolution on the smallest data -------------------------------------
    def resolve_partials(self) -> None:
        """reduce_scatter where the target shards the axis, else all_reduce."""
        b, dst, nax = self.b, self.dst, self.b.cur.mesh.ndim
        todo = [a for a in range(nax)
                if b.cur.partial[a] is not None and b.cur.partial[a] != dst.partial[a]]
        # Partial axes reduce last mesh axis first, so a PROD made on axis ``a`` puts its
        # identity (1) on every device of an inner SUM axis ``c > a``, which would sum to
        # size(c). Resolve such inner SUM axes first; make_partials re-makes them.
        for a in range(nax):
            if dst.partial[a] is ReduceOp.PROD and b.cur.partial[a] is not ReduceOp.PROD:
                todo += [c for c in range(a + 1, nax)
                         if b.cur.partial[c] is ReduceOp.SUM and c not in todo]
        if todo and len({op for op in b.cur.partial if op is not None}) > 1:
            # Ops that do not commute (sum vs max) reduce in a fixed order: the last
            # mesh axis first. Resolve every Partial axis in that order; the ones the
            # target keeps are re-made by make_partials at the end.
            for a in reversed(range(nax)):
                op = b.cur.partial[a]
                if op is not None:
                    partial = list(b.cur.partial)
                    partial[a] = None
                    b.add(StepKind.ALL_REDUCE, (a,), b.cur.with_partial(tuple(partial)), op=op)
            return
        for d in range(self.ndim):
            if self.prefix(d):
                self.reduce_scatter(d, todo)
        for op in ReduceOp:
            group = tuple(a for a in todo if b.cur.partial[a] == op)
            if group:
                partial = list(b.cur.partial)
                for a in group:
                    partial[a] = None
                b.add(StepKind.ALL_REDUCE, group, b.cur.with_partial(tuple(partial)), op=op)

    def reduce_scatter(self, d: int, todo: list[int]) -> None:
        """Resolve the longest run of ``todo`` axes (one op) that extends dim ``d``'s split
        into the target's by one reduce_scatter; they leave ``todo``."""
        b = self.b
        run: list[int] = []
        for a in self.dst.dims[d][len(b.cur.dims[d]):]:
            if a not in todo:
                break
            run.append(a)
        while run and (len({b.cur.partial[a] for a in run}) > 1
                       or not nests(self.shape[d], b.pieces(d), b.sizes(tuple(run)))):
            run.pop()
        if run:
            op = b.cur.partial[run[0]]
            partial = list(b.cur.partial)
            for a in run:
                partial[a] = None
                todo.remove(a)
            after = Layout(b.cur.mesh, replace_dim(b.cur, d, (*b.cur.dims[d], *run)),
                           tuple(partial))
            b.add(StepKind.REDUCE_SCATTER, tuple(run), after, d, op=op)

    # --- 4. all_gathers -----------------------------------------------------------------
    def gathers(self) -> None:
        """all_gather what must leave each dim (whole dim when uneven pieces don't nest)."""
        b = self.b
        for d in range(self.ndim):
            if self.prefix(d):
                continue
            cur, want = b.cur.dims[d], self.dst.dims[d]
            keep = 0
            while keep < len(cur) and keep < len(want) and cur[keep] == want[keep]:
                keep += 1
            outer = math.prod(b.cur.mesh.mesh_shape[a] for a in cur[:keep])
            while keep and not nests(self.shape[d], outer, b.sizes(cur[keep:])):
                keep -= 1
                outer = math.prod(b.cur.mesh.mesh_shape[a] for a in cur[:keep])
            after = b.cur.with_dims(replace_dim(b.cur, d, cur[:keep]))
            b.add(StepKind.ALL_GATHER, cur[keep:], after, d)

    def remaining_slices(self) -> None:
        """The remaining slices (a whole dim is always sliceable from replicated)."""
        b = self.b
        self.slice_ready()
        for d in range(self.ndim):
            if b.cur.dims[d] != self.dst.dims[d]:
                if b.cur.dims[d]:  # uneven pieces that do not nest: gather, then slice whole
                    after = b.cur.with_dims(replace_dim(b.cur, d, ()))
                    b.add(StepKind.ALL_GATHER, b.cur.dims[d], after, d)
                after = b.cur.with_dims(replace_dim(b.cur, d, self.dst.dims[d]))
                b.add(StepKind.SLICE, self.dst.dims[d], after, d)

    # --- 6. make_partial ----------------------------------------------------------------
    def make_partials(self) -> None:
        """Replicated axes the target holds as Partial, outer (lower) mesh axes first:
        reduction runs last axis first, so an outer axis's identity elements must be laid
        down before inner axes split them. Neighbours of one op are merged."""
        b, dst = self.b, self.dst
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
            b.add(StepKind.MAKE_PARTIAL, tuple(same), b.cur.with_partial(tuple(partial)), op=op)
