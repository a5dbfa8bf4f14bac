"""The collectives a plan's gradient runs: each step's transpose, for accounting.

The backward pass of a relayout runs each step's transpose, last step first
(the gradient contracts of ``runtime/functions.py``):

    forward step            backward collective
    slice                   all_gather
    all_gather              (none: the replicas' gradient is already whole: narrow)
    all_to_all              all_to_all back
    all_reduce(sum/avg)     (none: dL/dp_i is the output's gradient)
    all_reduce(max/min)     all_reduce (the count of the maxima)
    reduce_scatter          all_gather
    permute                 permute back
    make_partial(sum/avg)   (none)
    make_partial(others)    all_reduce
    diverge                 all_reduce(sum) of the gradient over the replicas

Invariants:
- The backward steps' bytes per device use the planner's own cost model
  (:meth:`~shardwise.planner.builder.StepList.moved`), so forward and backward
  bytes compare.
- Pure Python: no torch. The simulated runtime has no backward collectives of its
  own (replicas share one buffer, torch sums into it); these are what a
  one-process-per-device runtime runs, which debug tools count on both.
"""

from __future__ import annotations

import functools
import math

from shardwise.planner.builder import StepList
from shardwise.planner.steps import Plan, Step, StepKind
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp

__all__ = ["backward_steps", "diverge_step"]

_LINEAR = (ReduceOp.SUM, ReduceOp.AVG)


@functools.lru_cache(maxsize=4096)
def backward_steps(plan: Plan) -> tuple[Step, ...]:
    """The collectives the gradient of ``plan`` runs, in backward order.

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> rep, s0 = Layout.replicated(mesh, 1), Layout(mesh, ((0,),), (None,))
    >>> from shardwise.planner import make_plan
    >>> [str(s) for s in backward_steps(make_plan(rep, s0, (8,), 4))]
    ["all_gather(axes=('x',), dim=0)  24 B/device"]
    >>> backward_steps(make_plan(s0, rep, (8,), 4))   # narrow: no collective
    ()
    """
    costs = StepList(plan.src, plan.shape, plan.itemsize)
    out: list[Step] = []
    for step in reversed(plan.steps):
        kind: StepKind | None = None
        op = step.reduce_op
        dim, dim2 = step.dim, step.dim2
        match step.kind:
            case StepKind.SLICE | StepKind.REDUCE_SCATTER:
                kind, op = StepKind.ALL_GATHER, None
            case StepKind.ALL_TO_ALL:
                kind, dim, dim2 = StepKind.ALL_TO_ALL, step.dim2, step.dim
            case StepKind.PERMUTE:
                kind = StepKind.PERMUTE
            case StepKind.ALL_REDUCE | StepKind.MAKE_PARTIAL:
                if op in (ReduceOp.MAX, ReduceOp.MIN) or (
                        step.kind is StepKind.MAKE_PARTIAL and op not in _LINEAR):
                    kind, op = StepKind.ALL_REDUCE, ReduceOp.SUM
            case StepKind.ALL_GATHER:
                pass
        if kind is None:
            continue
        before, after = step.after, step.before
        if kind is StepKind.ALL_REDUCE:  # the gradient keeps the step's output layout
            before = after = step.after
        n = math.prod(before.mesh.mesh_shape[a] for a in step.axes)
        out.append(Step(kind, step.axes, before, after, dim, dim2, op,
                        costs.moved(kind, n, before, after)))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def diverge_step(layout: Layout, shape: tuple[int, ...], itemsize: int,
                 axes: tuple[int, ...]) -> Step:
    """The all_reduce(sum) the gradient of an operand laid out as ``layout`` needs
    when it feeds an op whose output is split over ``axes`` that it is replicated on.

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> str(diverge_step(Layout.replicated(mesh, 1), (8,), 4, (1,)))
    "all_reduce(axes=('tp',), op=sum)  32 B/device"
    """
    costs = StepList(layout, shape, itemsize)
    n = math.prod(layout.mesh.mesh_shape[a] for a in axes)
    return Step(StepKind.ALL_REDUCE, axes, layout, layout, None, None, ReduceOp.SUM,
                costs.moved(StepKind.ALL_REDUCE, n, layout, layout))
