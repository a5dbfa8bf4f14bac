"""Planner steps on the torch.distributed runtime: each step (and the relabel,
diverge and permute helpers) runs the autograd Function of the same name in
:mod:`shardwise.runtime.functions` (``slice`` -> ``Slice``, ``all_gather`` ->
``AllGather``...), whose docstring tables each forward with its gradient.
Gradient convention (see ``collectives.py``): Replicated axes hold the full
gradient on every replica, Sharded axes their piece, Partial axes dL/dp_i.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, Step, StepKind, check_handlers, permute_sources
from shardwise.runtime import collectives as D
from shardwise.runtime import functions as F
from shardwise.runtime.lax_multiprocess import run_spmd
from shardwise.runtime.world import WORLD
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_bounds

__all__ = [
    "assemble",
    "device_of",
    "diverge",
    "execute_plan",
    "global_value",
    "make_partial",
    "owned",
    "permute",
    "relabel",
    "run_spmd",
    "run_step",
]

Shards = list  # list[torch.Tensor | None]


def _sizes(layout: Layout, grp: D.Group, dim: int, shape: tuple[int, ...]) -> list[int]:
    return D.sizes_along(shape, layout, grp.members, dim, layout.mesh)


Spec: TypeAlias = tuple[Any, tuple[Any, ...]]
SpecOf: TypeAlias = Callable[[Step, D.Group, tuple[int, ...], tuple[int, ...]], Spec]


def _tag(step: Step) -> str:
    """The step's layouts, carried in every member's collective fingerprint."""
    return f"{step.before} -> {step.after}"


def _make_partial_spec(step: Step, grp: D.Group, coord: tuple[int, ...],
                       shape: tuple[int, ...]) -> Spec:
    return F.MakePartial, (grp, step.reduce_op, all(coord[a] == 0 for a in step.axes))


def _slice_spec(step: Step, grp: D.Group, coord: tuple[int, ...], shape: tuple[int, ...]
                ) -> Spec:
    assert step.dim is not None
    d = step.dim
    lo_before = local_bounds(shape, step.before, coord)[d][0]
    lo, hi = local_bounds(shape, step.after, coord)[d]
    return F.Slice, (d, lo - lo_before, hi - lo, grp, _sizes(step.after, grp, d, shape),
                     _tag(step))


def _all_gather_spec(step: Step, grp: D.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> Spec:
    assert step.dim is not None
    return F.AllGather, (step.dim, grp, _sizes(step.before, grp, step.dim, shape), _tag(step))


def _all_to_all_spec(step: Step, grp: D.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> Spec:
    assert step.dim is not None and step.dim2 is not None
    send = _sizes(step.after, grp, step.dim2, shape)
    recv = _sizes(step.before, grp, step.dim, shape)
    return F.AllToAll, (step.dim, step.dim2, grp, send, recv, _tag(step))


def _all_reduce_spec(step: Step, grp: D.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> Spec:
    return F.AllReduce, (grp, step.reduce_op, _tag(step))


def _reduce_scatter_spec(step: Step, grp: D.Group, coord: tuple[int, ...],
                         shape: tuple[int, ...]) -> Spec:
    assert step.dim is not None
    return F.ReduceScatter, (step.dim, grp, _sizes(step.after, grp, step.dim, shape),
                             step.reduce_op, _tag(step))


# The autograd Function (and its arguments) of each step kind run per device; permute
# steps are one batched send/recv over all devices instead (run_step).
_SPEC_OF: dict[StepKind, SpecOf] = {
    StepKind.MAKE_PARTIAL: _make_partial_spec,
    StepKind.SLICE: _slice_spec,
    StepKind.ALL_GATHER: _all_gather_spec,
    StepKind.ALL_TO_ALL: _all_to_all_spec,
    StepKind.ALL_REDUCE: _all_reduce_spec,
    StepKind.REDUCE_SCATTER: _reduce_scatter_spec,
}
check_handlers(_SPEC_OF, "the multi-process runtime", elsewhere=[StepKind.PERMUTE])


# step specs hold one world's groups: cached on WORLD.specs, cleared with the world


def _spec(step: Step, shape: tuple[int, ...], k: int) -> tuple[Any, tuple[Any, ...]]:
    """The autograd Function and its arguments for ``step`` on mesh device ``k``
    (computed once: per-op overhead is then one dict lookup)."""
    key = (step, shape, k)
    hit = WORLD.specs.get(key)
    if hit is not None:
        return hit
    mesh = step.before.mesh
    out = _SPEC_OF[step.kind](step, D.group(mesh, step.axes), mesh.coord_of(k), shape)
    WORLD.specs[key] = out
    return out


class _Untracked:
    """Stands in for the autograd context when nothing is recorded: a step's
    forward then runs as a plain call (Function.apply costs ~10 us per op)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def _run(fn: Any, x: torch.Tensor, args: Any) -> torch.Tensor:
    """``fn.apply(x, args)``, or its forward as a plain call when autograd records
    nothing (no grad-requiring input, no forward-mode level)."""
    if fwAD._current_level >= 0 or (x.requires_grad and torch.is_grad_enabled()):
        return fn.apply(x, args)
    return fn.forward(_Untracked(), x, args)


def _one(step: Step, x: torch.Tensor, shape: tuple[int, ...], k: int) -> torch.Tensor:
    fn, args = _spec(step, shape, k)
    return _run(fn, x, args)


def run_step(step: Step, shards: Sequence[torch.Tensor | None], shape: tuple[int, ...]
             ) -> Shards:
    if step.kind is StepKind.PERMUTE:
        return permute(shards, step.after, permute_sources(step), shape)
    mesh = step.before.mesh
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    k = D.my_index(mesh)
    if k is not None:
        x = shards[k]
        assert x is not None, "a process must hold its own shard"
        out[k] = _one(step, x, shape, k)
    else:  # not in this mesh, but group creation is collective: take part in it
        D.group(mesh, step.axes)
    return out


def execute_plan(plan: Plan, shards: Sequence[torch.Tensor | None]) -> Shards:
    out = list(shards)
    for step in plan.steps:
        out = run_step(step, out, plan.shape)
    return out


def relabel(shards: Sequence[torch.Tensor | None], layout: Layout, axes: tuple[int, ...],
            op: ReduceOp) -> Shards:
    """Replicated ``axes`` become Partial(op) holding the same local values."""
    mesh = layout.mesh
    grp = D.group(mesh, axes) if axes else None
    k = D.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is not None:
        x = shards[k]
        assert x is not None
        out[k] = F.Relabel.apply(x, (grp, op))
    return out


def diverge(shards: Sequence[torch.Tensor | None], layout: Layout, axes: tuple[int, ...]
            ) -> Shards:
    """A value replicated over ``axes`` feeds a local op whose output is not (sharded or
    Partial there), so each process's gradient is only its share: sum the shares."""
    mesh = layout.mesh
    grp = D.group(mesh, axes)  # group creation is collective: every process takes part
    k = D.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is not None:
        x = shards[k]
        assert x is not None
        # A block whose producer sums its gradient over some of these axes itself (a
        # fully_shard-gathered parameter: reduce_scatter, not all_reduce) routes them.
        route = getattr(x, "_sw_diverge", None)
        if route is not None:
            x, rest = route(x, axes)
            if not rest:
                out[k] = x
                return out
            if rest != axes:
                grp = D.group(mesh, rest)
        out[k] = F.Diverge.apply(x, grp)
    return out


def make_partial(shards: Sequence[torch.Tensor | None], layout: Layout, axes: tuple[int, ...],
                 op: ReduceOp) -> Shards:
    mesh = layout.mesh
    k = D.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    grp = D.group(mesh, axes)
    if k is not None:
        x = shards[k]
        assert x is not None
        coord = mesh.coord_of(k)
        out[k] = F.MakePartial.apply(x, (grp, op, all(coord[a] == 0 for a in axes)))
    return out


def permute(shards: Sequence[torch.Tensor | None], layout: Layout, source: Sequence[int | None],
            shape: tuple[int, ...]) -> Shards:
    """Device k receives device source[k]'s block (zeros when None). Every member runs
    the Function, also one that keeps its block, so that all agree first (forward and
    backward)."""
    mesh = layout.mesh
    grp = D.group(mesh, tuple(range(mesh.ndim)))  # collective creation: every process
    k = D.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is None:
        return out
    x = shards[k]
    assert x is not None
    send_to, recv_from = _peers(mesh, tuple(source), k) or (F.KEEP, F.KEEP)
    out[k] = _run(F.Permute, x, (send_to, recv_from, grp,
                                 f"{layout} {tuple(shape)} from {tuple(source)}"))
    return out


@functools.lru_cache(maxsize=1024)
def _peers(mesh: Any, source: tuple[int | None, ...], k: int
           ) -> tuple[int | None, int | None] | None:
    """(rank to send to, rank to receive from) of device ``k``; None when both are itself."""
    dest = [j for j, s in enumerate(source) if s == k]
    send_to = mesh.devices[dest[0]].id if dest else None
    src = source[k]
    recv_from = mesh.devices[src].id if src is not None else None
    me = mesh.devices[k].id
    return None if send_to == me and recv_from == me else (send_to, recv_from)


def global_value(shards: Sequence[torch.Tensor | None], layout: Layout, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The global value of a fully replicated tensor, on every process."""
    mesh = layout.mesh
    k = D.my_index(mesh)
    owners = {d.id for d in mesh.devices}
    world = D.world_group()
    if len(owners) == world.size:
        assert k is not None
        return shards[k]  # type: ignore[return-value]
    src = mesh.devices[0].id
    if k is not None and mesh.devices[k].id == src:
        return F.Broadcast.apply(shards[k], (src, world))
    buf = torch.empty(shape, dtype=dtype, device=device_of(mesh, 0))
    return D.broadcast(buf, src, world)


def device_of(mesh: Any, k: int) -> torch.device:
    """This process's torch device for mesh device ``k``."""
    dev = mesh.devices[k]
    if dev.kind == "cpu":
        return torch.device("cpu")
    import os

    from shardwise.devices import accelerator_type

    return torch.device(accelerator_type() or "cuda", int(os.environ.get("LOCAL_RANK", "0")))


def owned(mesh: Any) -> list[int]:
    k = D.my_index(mesh)
    return [] if k is None else [k]


def assemble(shards: Sequence[torch.Tensor | None], src: Layout, dst: Layout,
             shape: tuple[int, ...]) -> Shards:
    """Local re-blocking only (every needed source block is present here), e.g.
    slicing this process's block out of a value every process holds."""
    from shardwise.runtime import blocks

    mesh = dst.mesh
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    k = D.my_index(mesh)
    if k is None:
        return out
    rep_dst, nodes = blocks.assemble_recipe(src, dst, shape)
    block = blocks.run_node(nodes[rep_dst[k]], shards)  # type: ignore[arg-type]
    dev = device_of(mesh, k)
    out[k] = block if block.device == dev else block.to(dev)
    return out
