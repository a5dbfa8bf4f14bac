"""The torch.distributed backend: each process holds only its own shards, and each
planner step (and the relabel, diverge and permute helpers) runs one spec of the
backend's one autograd family (:mod:`shardwise.runtime.process.functions`: ``slice``
-> ``Narrow``, ``all_gather`` -> ``AllGather``...), whose docstring tables each forward
with its gradient. Gradient convention: Replicated axes hold the full gradient on every
replica, Sharded axes their piece, Partial axes dL/dp_i.

Invariants:
- ``shards[k]`` is present only for the mesh devices this process owns (device id ==
  rank); the others are None.
- A step's spec is computed once per (step, shape, device) and cached on the world
  (it holds the world's groups): per op, one dict lookup and one collective.
- Every process takes part in creating a group it may not be a member of (group
  creation is collective over the world), except on a pipeline stage's mesh: its
  groups exist already (``groups.prepare_stage_groups``), its processes alone run its
  ops and read its values, and another process that reaches one is refused.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from shardwise.planner import Plan, Step, StepKind, check_handlers, permute_sources
from shardwise.runtime import blocks
from shardwise.runtime.local import run_blocks
from shardwise.runtime.owner import GradOwner
from shardwise.runtime.process import collectives, functions
from shardwise.runtime.process.control import (  # the world block of the protocol
    barrier,
    begin_world,
    end_world,
    first_failure,
    gather_world,
    process_count,
    process_index,
    record_failure,
)
from shardwise.runtime.process.groups import prepare_stage_groups as prepare_stages
from shardwise.runtime.process.links import flush_links, link
from shardwise.runtime.process.spmd import run_spmd, spmd_outputs
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.devices import accelerator_type
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
    "run_local",
    "run_spmd",
    "run_step",
    "spmd_outputs",
    # point-to-point and pipeline stages
    "flush_links",
    "link",
    "prepare_stages",
    # the world block
    "barrier",
    "begin_world",
    "end_world",
    "first_failure",
    "gather_world",
    "process_count",
    "process_index",
    "record_failure",
]

Shards = list  # list[torch.Tensor | None]


def _sizes(layout: Layout, grp: collectives.Group, dim: int, shape: tuple[int, ...]) -> list[int]:
    return collectives.sizes_along(shape, layout, grp.members, dim, layout.mesh)


SpecOf: TypeAlias = Callable[[Step, collectives.Group, tuple[int, ...], tuple[int, ...]],
                             functions.Spec]


def _tag(step: Step) -> str:
    """The step's layouts, carried in every member's collective fingerprint."""
    return f"{step.before} -> {step.after}"


def _make_partial_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...],
                       shape: tuple[int, ...]) -> functions.Spec:
    assert step.reduce_op is not None
    return functions.MakePartial(grp, step.reduce_op, all(coord[a] == 0 for a in step.axes))


def _slice_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...], shape: tuple[int, ...]
                ) -> functions.Spec:
    assert step.dim is not None
    d = step.dim
    lo_before = local_bounds(shape, step.before, coord)[d][0]
    lo, hi = local_bounds(shape, step.after, coord)[d]
    return functions.Narrow(d, lo - lo_before, hi - lo, grp, _sizes(step.after, grp, d, shape),
                            _tag(step))


def _all_gather_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> functions.Spec:
    assert step.dim is not None
    return functions.AllGather(step.dim, grp, _sizes(step.before, grp, step.dim, shape), _tag(step))


def _all_to_all_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> functions.Spec:
    assert step.dim is not None and step.dim2 is not None
    send = _sizes(step.after, grp, step.dim2, shape)
    recv = _sizes(step.before, grp, step.dim, shape)
    return functions.AllToAll(step.dim, step.dim2, grp, send, recv, _tag(step))


def _all_reduce_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...],
                     shape: tuple[int, ...]) -> functions.Spec:
    assert step.reduce_op is not None
    return functions.AllReduce(grp, step.reduce_op, _tag(step))


def _reduce_scatter_spec(step: Step, grp: collectives.Group, coord: tuple[int, ...],
                         shape: tuple[int, ...]) -> functions.Spec:
    assert step.dim is not None and step.reduce_op is not None
    return functions.ReduceScatter(step.dim, grp, _sizes(step.after, grp, step.dim, shape),
                                   step.reduce_op, _tag(step))


# The spec of the one autograd family each step kind runs per device; permute steps
# are one batched send/recv over all devices instead (run_step).
_SPEC_OF: dict[StepKind, SpecOf] = {
    StepKind.MAKE_PARTIAL: _make_partial_spec,
    StepKind.SLICE: _slice_spec,
    StepKind.ALL_GATHER: _all_gather_spec,
    StepKind.ALL_TO_ALL: _all_to_all_spec,
    StepKind.ALL_REDUCE: _all_reduce_spec,
    StepKind.REDUCE_SCATTER: _reduce_scatter_spec,
}
check_handlers(_SPEC_OF, "the multi-process runtime", elsewhere=[StepKind.PERMUTE])


def _spec(step: Step, shape: tuple[int, ...], k: int) -> functions.Spec:
    """The spec of ``step`` on mesh device ``k``, computed once (cached on WORLD.specs,
    cleared with the world: it holds the world's groups)."""
    key: tuple[Step, tuple[int, ...], int] | None = (step, shape, k)
    try:
        hit = WORLD.specs.get(key)
    except TypeError:  # symbolic sizes (torch.compile, dynamic shapes): never cached
        hit, key = None, None
    if hit is not None:
        return hit
    mesh = step.before.mesh
    out = _SPEC_OF[step.kind](step, collectives.group(mesh, step.axes), mesh.coord_of(k), shape)
    if key is not None:
        WORLD.specs[key] = out
    return out


def run_step(step: Step, shards: Sequence[torch.Tensor | None], shape: tuple[int, ...]
             ) -> Shards:
    if step.kind is StepKind.PERMUTE:
        return permute(shards, step.after, permute_sources(step), shape)
    mesh = step.before.mesh
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    k = collectives.my_index(mesh)
    if k is not None:
        x = shards[k]
        assert x is not None, "a process must hold its own shard"
        out[k] = functions.run(_spec(step, shape, k), x)
    else:  # not in this mesh, but group creation is collective: take part in it
        collectives.refuse_outsider(mesh, f"{step.kind.value} over axes {step.axes}")
        collectives.group(mesh, step.axes)
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
    grp = collectives.group(mesh, axes) if axes else None
    k = collectives.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is not None:
        x = shards[k]
        assert x is not None
        out[k] = functions.run(functions.Relabel(grp, op), x)
    return out


def diverge(shards: Sequence[torch.Tensor | None], layout: Layout, axes: tuple[int, ...],
            owner: GradOwner | None = None) -> Shards:
    """A value replicated over ``axes`` feeds a local op whose output is not (sharded or
    Partial there), so each process's gradient is only its share: sum the shares. Axes
    that ``owner`` sums itself (a fully_shard-gathered parameter: reduce_scatter, not
    all_reduce) hand the share to it instead."""
    mesh = layout.mesh
    grp = collectives.group(mesh, axes)  # group creation is collective: every process takes part
    k = collectives.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is not None:
        x = shards[k]
        assert x is not None
        if owner is not None and owner.hand_off is not None:
            rest = owner.others(axes)
            if rest != axes:
                x = owner.hand_off(k, x)
                if not rest:
                    out[k] = x
                    return out
                grp = collectives.group(mesh, rest)
        out[k] = functions.run(functions.Diverge(grp), x)
    return out


def make_partial(shards: Sequence[torch.Tensor | None], layout: Layout, axes: tuple[int, ...],
                 op: ReduceOp) -> Shards:
    mesh = layout.mesh
    k = collectives.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    grp = collectives.group(mesh, axes)
    if k is not None:
        x = shards[k]
        assert x is not None
        coord = mesh.coord_of(k)
        out[k] = functions.run(functions.MakePartial(grp, op, all(coord[a] == 0 for a in axes)), x)
    return out


def permute(shards: Sequence[torch.Tensor | None], layout: Layout, source: Sequence[int | None],
            shape: tuple[int, ...]) -> Shards:
    """Device k receives device source[k]'s block (zeros when None). Every member runs
    the Function, also one that keeps its block, so that all agree first (forward and
    backward)."""
    mesh = layout.mesh
    grp = collectives.group(mesh, tuple(range(mesh.ndim)))  # collective creation: every process
    k = collectives.my_index(mesh)
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    if k is None:
        collectives.refuse_outsider(mesh, "a permutation")
        return out
    x = shards[k]
    assert x is not None
    send_to, recv_from = _peers(mesh, tuple(source), k) or (functions.KEEP, functions.KEEP)
    out[k] = functions.run(functions.Permute(send_to, recv_from, grp,
                                             f"{layout} {tuple(shape)} from {tuple(source)}"), x)
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
    k = collectives.my_index(mesh)
    owners = {d.id for d in mesh.devices}
    world = collectives.world_group()
    if len(owners) == world.size or (k is not None and mesh in WORLD.stages):
        # a pipeline stage's processes hold the value; the others never ask for it
        assert k is not None
        return shards[k]  # type: ignore[return-value]
    collectives.refuse_outsider(mesh, "reading the global value (to_torch)")
    src = mesh.devices[0].id
    if k is not None and mesh.devices[k].id == src:
        x = shards[k]
        assert x is not None
        return functions.run(functions.Broadcast(src, world), x)
    buf = torch.empty(shape, dtype=dtype, device=device_of(mesh, 0))
    return collectives.broadcast(buf, src, world)


def device_of(mesh: Any, k: int) -> torch.device:
    """This process's torch device for mesh device ``k``."""
    dev = mesh.devices[k]
    if dev.kind == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator_type() or "cuda", int(os.environ.get("LOCAL_RANK", "0")))


def owned(mesh: Any) -> list[int]:
    k = collectives.my_index(mesh)
    return [] if k is None else [k]


def assemble(shards: Sequence[torch.Tensor | None], src: Layout, dst: Layout,
             shape: tuple[int, ...]) -> Shards:
    """Local re-blocking only (every needed source block is present here), e.g.
    slicing this process's block out of a value every process holds."""
    mesh = dst.mesh
    out: list[torch.Tensor | None] = [None] * mesh.num_devices
    k = collectives.my_index(mesh)
    if k is None:
        return out
    try:
        rep_dst, nodes = blocks.assemble_recipe(src, dst, shape)
    except TypeError:  # symbolic sizes (torch.compile, dynamic shapes): bounds stay symbolic
        rep_dst, nodes = blocks.assemble_recipe.__wrapped__(src, dst, shape)
    block = blocks.run_node(nodes[rep_dst[k]], shards)  # type: ignore[arg-type]
    dev = device_of(mesh, k)
    # a meta block (a model built on the meta device) stays meta until to_empty
    out[k] = block if block.device == dev or block.is_meta else block.to(dev)
    return out


#: ``Backend.run_local``: once on this process's block of each operand (other processes
#: run theirs)
run_local = run_blocks
