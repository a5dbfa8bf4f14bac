"""The simulated backend: every device of the mesh in this process.

Invariants:
- ``shards[k]`` is device ``k``'s local ``torch.Tensor`` (row-major over the mesh).
- Devices that differ only along Replicated mesh axes hold the *same* tensor
  object (one buffer); contiguous sub-blocks are views. Nothing here mutates
  an input, which is what makes the sharing safe.
- Every step is made of differentiable torch ops (narrow, cat, add, maximum...)
  applied once per distinct object, so torch's autograd (reverse and forward
  mode) computes the exact gradient of the global computation: a replica used
  N times gets its gradient summed once, never N times too large.
- Execution recipes (which source block feeds which target block) are
  computed once per (layout, layout, shape) and cached, with the choice of
  torch calls made once too (host meshes):
  - small tensors (at most ``buffers.SMALL_BYTES``): all_to_all-like moves gather whole
    and cut views (two torch calls instead of two per device); small sums of
    more than 3 terms are one ``stack().sum()`` when no gradient is recorded;
  - large tensors: targets are built block by block into contiguous buffers;
    an all_to_all fills one buffer with one strided copy per source when that
    buffer is at most 32 MiB or comes from the result pool / reused heap
    (a fresh mmap's page faults cost more than the saving), else one ``cat``
    per target; above 32 MiB reduce_scatter reduces each target block on its
    own. Results above 32 MiB come from :func:`buffers.empty` (the pool).
- Targets whose source pieces are adjacent views of one buffer (and no
  gradient is being recorded) are returned as views of it: no copy (large
  tensors; the check costs more than a small copy).
- Buffer reuse is opt-in (:func:`set_buffer_reuse`): it keeps freed buffers in
  the C heap, so a fresh 64 MiB output costs a copy, not its pages' faults.

Modules: ``runtime/blocks`` (the recipes), ``host_paths`` (the compiled host fast
path), ``runtime/collectives`` (the group reductions, shared with shard_map and the
graph ops),
``runtime/buffers`` (buffer reuse); this one runs the planner's steps with them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from shardwise.planner import Plan, Step, StepKind, check_handlers, permute_sources
from shardwise.runtime import Decided, blocks, buffers, collectives
from shardwise.runtime.blocks import rep_indices
from shardwise.runtime.buffers import buffer_reuse, set_buffer_reuse
from shardwise.runtime.local import Local, Whole, failed, run_blocks
from shardwise.runtime.owner import GradOwner
from shardwise.runtime.simulated import host_paths as hp
from shardwise.runtime.simulated.control import (  # the world, its links and stages
    barrier,
    begin_world,
    end_world,
    first_failure,
    flush_links,
    gather_world,
    link,
    prepare_stages,
    process_count,
    process_index,
    record_failure,
)
from shardwise.runtime.simulated.spmd import run_spmd, spmd_outputs
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape

__all__ = [
    "assemble",
    "buffer_reuse",
    "device_of",
    "diverge",
    "execute_plan",
    "global_value",
    "make_partial",
    "owned",
    "permute",
    "reduce",
    "reduce_scatter",
    "relabel",
    "rep_indices",
    "run_local",
    "run_spmd",
    "run_step",
    "set_buffer_reuse",
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

Shards: TypeAlias = "list[torch.Tensor]"


def _nbytes(shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> int:
    return math.prod(shape) * shards[0].element_size()


def assemble(shards: Sequence[torch.Tensor], src: Layout, dst: Layout,
             shape: tuple[int, ...]) -> Shards:
    """Move blocks from layout ``src`` to ``dst`` (same Partial axes): views where a
    target block lies in one source block, one ``cat`` copy otherwise (small
    tensors: one gather and views of it; see the module doc)."""
    if not hp.is_host(src.mesh):
        rep_dst, nodes = blocks.assemble_recipe(src, dst, shape)
        pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] = {}
        for j, d, sizes, keys in blocks.source_splits(src, dst, shape):
            pieces.update(zip(keys, shards[j].split_with_sizes(list(sizes), d)))
        built = {k: blocks.run_node(node, shards, pieces) for k, node in nodes.items()}
        return [built[r] for r in rep_dst]
    return _assemble_on_host(shards, src, dst, shape, _nbytes(shards, shape))


def _assemble_on_host(shards: Sequence[torch.Tensor], src: Layout, dst: Layout,
                      shape: tuple[int, ...], nbytes: int) -> Shards:
    direct, via = hp.routes(src, dst, shape)
    big = nbytes > buffers.SMALL_BYTES
    if via is not None and not big:
        return hp.assemble_host(hp.assemble_host(shards, via[0], False), via[1], False)
    return hp.assemble_host(shards, direct, big)


@functools.lru_cache(maxsize=4096)
def _groups(layout: Layout, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in layout.mesh.groups(axes))


@functools.lru_cache(maxsize=4096)
def _whole(layout: Layout, axes: tuple[int, ...]) -> bool:
    """True when ``axes`` group every device of the mesh, in mesh order (one result)."""
    groups = _groups(layout, axes)
    return len(groups) == 1 and groups[0] == tuple(range(layout.mesh.num_devices))


def reduce(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
           op: ReduceOp) -> Shards:
    """Combine the local values along ``axes`` by ``op``; every device of a group
    gets the one result object."""
    host = hp.is_host(layout.mesh)
    if host and _whole(layout, axes):
        return [collectives.reduce(shards, op)] * len(shards)
    out: list[torch.Tensor | None] = [None] * len(shards)
    memo: dict[tuple[int, ...], torch.Tensor] = {}
    for group in _groups(layout, axes):
        objs = [shards[k] for k in group]
        key = tuple(map(id, objs))
        res = memo.get(key)
        if res is None:
            if not host:
                dev = objs[0].device
                objs = [o if o.device == dev else o.to(dev) for o in objs]
            res = memo[key] = collectives.reduce(objs, op)
        for k in group:
            out[k] = res if host or res.device == shards[k].device else res.to(
                shards[k].device)
    return out  # type: ignore[return-value]


def _unreduced(layout: Layout, axes: tuple[int, ...]) -> Layout:
    """``layout`` with the Partial mesh axes ``axes`` resolved (Replicated)."""
    partial = list(layout.partial)
    for a in axes:
        partial[a] = None
    return layout.with_partial(tuple(partial))


@functools.lru_cache(maxsize=4096)
def _scatter_blocks(before: Layout, after: Layout, axes: tuple[int, ...],
                    shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """reduce_scatter block by block: per distinct target block, the devices whose
    local values it reduces and the slice of them it takes; None when a target
    block is not one slice of the reduced value (uneven pieces that do not nest)."""
    rep_dst, nodes = blocks.assemble_recipe(_unreduced(before, axes), after, shape)
    group_of = {k: g for g in _groups(before, axes) for k in g}
    out = []
    for k, node in nodes.items():
        if node[0] != "leaf":
            return None
        out.append((k, group_of[node[1]], node[2], hp.slice_index(node[2])))
    return rep_dst, tuple(out)


@functools.lru_cache(maxsize=4096)
def _scatter_route(before: Layout, after: Layout, axes: tuple[int, ...], shape: tuple[int, ...]
                   ) -> tuple[bool, bool, Layout, Any]:
    """Host mesh?, one group of every device (host only)?, the reduced layout, and
    the direct program cutting the one result into the targets when that is the
    route :func:`_assemble_on_host` would take whatever the size (else None)."""
    host = hp.is_host(before.mesh)
    whole = host and _whole(before, axes)
    mid = _unreduced(before, axes)
    direct, via = hp.routes(mid, after, shape) if whole else (None, None)
    return host, whole, mid, direct if via is None else None


def reduce_scatter(shards: Sequence[torch.Tensor], before: Layout, after: Layout,
                   axes: tuple[int, ...], op: ReduceOp, shape: tuple[int, ...]) -> Shards:
    """Combine the local values along ``axes`` by ``op`` and scatter the result as
    ``after`` lays it out. On the host, results above glibc's mmap limit (32 MiB)
    reduce each target block on its own: a contiguous buffer of 1/n of the bytes,
    which the C heap reuses instead of page-faulting a fresh mmap, and whose
    accumulation stays in cache longer (below, the n*(n-1) smaller calls cost more
    than they save). Otherwise reduce whole and slice."""
    plan = None
    host, whole, mid, direct = _scatter_route(before, after, axes, shape)
    nbytes = _nbytes(shards, shape)
    if host and nbytes > hp.MMAP_MAX:
        plan = _scatter_blocks(before, after, axes, shape)
    if plan is None:
        if whole:  # one result on the host: cut it (views of it)
            ones = [collectives.reduce(shards, op)] * len(shards)
            if direct is not None:
                return hp.assemble_host(ones, direct, nbytes > buffers.SMALL_BYTES)
            return _assemble_on_host(ones, mid, after, shape, nbytes)
        reduced = reduce(shards, before, axes, op)
        return assemble(_dedupe(reduced, mid), mid, after, shape)
    rep_dst, todo = plan
    built: dict[int, torch.Tensor] = {}
    memo: dict[Any, torch.Tensor] = {}
    for k, members, key, index in todo:
        objs = [shards[m] for m in members]
        ident = (tuple(map(id, objs)), key)
        res = memo.get(ident)
        if res is None:
            if index is not None:
                objs = [o[index] for o in objs]
            res = memo[ident] = collectives.reduce(objs, op)
        built[k] = res
    return [built[r] for r in rep_dst]


def identity_like(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The identity element of ``op`` broadcast to ``t``'s shape (no memory)."""
    value = 1 if op is ReduceOp.PROD else 0
    return torch.full((), value, dtype=t.dtype, device=t.device).expand(t.shape)


@functools.lru_cache(maxsize=4096)
def _roots(layout: Layout, axes: tuple[int, ...]) -> tuple[bool, ...]:
    """Per device: True when its coordinate is 0 along every one of ``axes``."""
    mesh = layout.mesh
    return tuple(all(mesh.coord_of(k)[a] == 0 for a in axes) for k in range(mesh.num_devices))


def make_partial(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
                 op: ReduceOp) -> Shards:
    """Replicated along ``axes`` -> Partial(op) with the same global value: for SUM
    and PROD only coordinate 0 keeps the value (others hold the identity); for
    AVG, MIN and MAX every device keeps it."""
    if op in (ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX):
        return list(shards)
    memo: dict[int, torch.Tensor] = {}
    out = []
    for t, root in zip(shards, _roots(layout, axes)):
        if root:
            out.append(t)
        else:
            ident = memo.get(id(t))
            if ident is None:
                ident = memo[id(t)] = identity_like(t, op)
            out.append(ident)
    return out


StepHandler: TypeAlias = Callable[[Step, Sequence[torch.Tensor], tuple[int, ...]], Shards]


def _assemble_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> Shards:
    return assemble(shards, step.before, step.after, shape)


def _all_reduce_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]
                     ) -> Shards:
    assert step.reduce_op is not None
    return reduce(shards, step.before, step.axes, step.reduce_op)


def _reduce_scatter_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]
                         ) -> Shards:
    assert step.reduce_op is not None
    return reduce_scatter(shards, step.before, step.after, step.axes, step.reduce_op, shape)


def _make_partial_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]
                       ) -> Shards:
    assert step.reduce_op is not None
    return make_partial(shards, step.before, step.axes, step.reduce_op)


def _permute_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> Shards:
    return permute(shards, step.after, permute_sources(step), shape)


# One handler per planner step kind (checked complete at import).
STEP_HANDLERS: dict[StepKind, StepHandler] = {
    StepKind.SLICE: _assemble_step,
    StepKind.ALL_GATHER: _assemble_step,
    StepKind.ALL_TO_ALL: _assemble_step,
    StepKind.ALL_REDUCE: _all_reduce_step,
    StepKind.REDUCE_SCATTER: _reduce_scatter_step,
    StepKind.MAKE_PARTIAL: _make_partial_step,
    StepKind.PERMUTE: _permute_step,
}
check_handlers(STEP_HANDLERS, "the simulated runtime")


def run_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> Shards:
    """Execute one planner step on the simulated mesh."""
    return STEP_HANDLERS[step.kind](step, shards, shape)


def _dedupe(shards: Sequence[torch.Tensor], layout: Layout) -> Shards:
    reps = rep_indices(layout)
    return [shards[r] for r in reps]


def execute_plan(plan: Plan, shards: Sequence[torch.Tensor]) -> Shards:
    out = list(shards)
    for step in plan.steps:
        out = run_step(step, out, plan.shape)
    return out


def global_value(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The global value of a fully replicated tensor."""
    return shards[0]


def relabel(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
            op: ReduceOp) -> Shards:
    """Replicated ``axes`` become Partial(op) holding the same local values. Nothing
    to do here: replicas already share one buffer, so torch sums its gradient."""
    return list(shards)


def diverge(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
            owner: GradOwner | None = None) -> Shards:
    """A value replicated over ``axes`` feeds an op whose output is not (sharded or
    Partial there). Nothing to do here: the replicas share one buffer, so torch
    already sums the devices' shares of its gradient (``owner``'s axes included)."""
    return list(shards)


@functools.lru_cache(maxsize=4096)
def _local_shapes(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    mesh = layout.mesh
    return tuple(local_shape(shape, layout, mesh.coord_of(k)) for k in range(mesh.num_devices))


def permute(shards: Sequence[torch.Tensor], layout: Layout, source: Sequence[int | None],
            shape: tuple[int, ...]) -> Shards:
    """Device ``k`` receives device ``source[k]``'s block (zeros when None); replicas
    keep sharing one object. On the host this only relabels objects (no copy)."""
    mesh = layout.mesh
    host = hp.is_host(mesh)
    reps = rep_indices(layout)
    out: list[torch.Tensor] = []
    zeros: dict[tuple[int, ...], torch.Tensor] = {}
    for k, s in enumerate(source):
        if reps[k] != k:
            out.append(out[reps[k]])
            continue
        if s is None:
            dev = shards[0].device if host else device_of(mesh, k)
            want = _local_shapes(layout, shape)[k]
            z = zeros.get(want)
            if z is None:
                z = zeros[want] = torch.zeros((), dtype=shards[0].dtype, device=dev).expand(want)
            out.append(z)
        elif host:
            out.append(shards[s])
        else:
            got, dev = shards[s], device_of(mesh, k)
            out.append(got if got.device == dev else got.to(dev))
    return out


def device_of(mesh: DeviceMesh, k: int) -> torch.device:
    return mesh.devices[k].to_torch()


def owned(mesh: DeviceMesh) -> range:
    """The mesh devices this process holds: all of them."""
    return range(mesh.num_devices)


def run_local(op: str, fn: Callable[..., torch.Tensor], args: Sequence[Any],
              decided: Decided, shaped: bool, views: dict[int, torch.Tensor] | None
              ) -> tuple[Local, torch.Tensor | None]:
    """Run a decided op here (``Backend.run_local``): once on the operands' whole
    values when every one has one (its own, or one derived from its blocks), the
    global op as one autograd node, the result held whole; else once per distinct row
    of blocks. A whole result that aliases a copy derived from some operand's blocks (a
    view) is dropped for the blocks, whose views alias them."""
    wholes = decided.wholes(args, views)
    if wholes is None:
        return run_blocks(op, fn, args, decided, shaped)
    factors = decided.factors
    if shaped:
        wholes.append(factors.out_shape)
    try:
        r = fn(*wholes)
    except (RuntimeError, TypeError, ValueError, IndexError) as err:  # (one block: the whole)
        raise failed(op, wholes, factors.shapes, factors.text, err) from err
    if r.shape != factors.out_shape:
        raise AssertionError(f"{op}: the whole result has shape {tuple(r.shape)}, the rule "
                             f"gives {factors.out_shape}")
    if r._base is None:  # a new tensor (the common case), unless it is an operand itself
        for w in wholes:
            if r is w:
                break
        else:
            return Whole(r, decided.dec.output), r
    if decided.aliases_copy(args, r):
        return run_blocks(op, fn, args, decided, shaped)
    return Whole(r, decided.dec.output), r
