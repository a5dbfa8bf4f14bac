"""The simulated runtime: every device of the mesh in this process.

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
  computed once per (layout, layout, shape) and cached.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, Step
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_bounds, local_shape, split_bounds

__all__ = [
    "assemble",
    "device_of",
    "diverge",
    "execute_plan",
    "global_value",
    "make_partial",
    "owned",
    "permute",
    "reduce",
    "relabel",
    "rep_indices",
    "run_step",
]

Shards: TypeAlias = "list[torch.Tensor]"
# A recipe node: ("leaf", src_device, ((dim, start, length), ...), move_to | None)
#             or ("cat", dim, (child, child, ...)).
Node: TypeAlias = "tuple[Any, ...]"


@functools.lru_cache(maxsize=4096)
def rep_indices(layout: Layout) -> tuple[int, ...]:
    """For each device, the device whose object it shares: its coordinate with
    every replicated mesh axis set to 0."""
    mesh = layout.mesh
    used = set(layout.sharded_axes) | set(layout.partial_axes)
    out = []
    for k in range(mesh.num_devices):
        coord = [c if a in used else 0 for a, c in enumerate(mesh.coord_of(k))]
        out.append(mesh.index_of(coord))
    return tuple(out)


def _piece_of(size: int, pieces: int, x: int) -> int:
    base, rem = divmod(size, pieces)
    edge = rem * (base + 1)
    return x // (base + 1) if x < edge else rem + (x - edge) // base


def _unravel(index: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        index, r = divmod(index, s)
        out.append(r)
    return out[::-1]


@functools.lru_cache(maxsize=4096)
def _assemble_recipe(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                              dict[int, Node]]:
    mesh = src.mesh
    rep_src, rep_dst = rep_indices(src), rep_indices(dst)
    # Virtual CPUs share host memory: blocks never move between torch devices.
    torch_dev = [None] * mesh.num_devices if mesh.is_simulated else [
        d.to_torch() for d in mesh.devices]
    nodes: dict[int, Node] = {}
    for k in sorted(set(rep_dst)):
        coord = mesh.coord_of(k)
        want = local_bounds(shape, dst, coord)
        per_dim: list[list[tuple[int, int, int, int]]] = []  # (piece, start, length, piece_len)
        for d, (lo, hi) in enumerate(want):
            axes = src.dims[d]
            pieces = math.prod(mesh.mesh_shape[a] for a in axes)
            size = shape[d]
            if pieces == 1:
                per_dim.append([(0, lo, hi - lo, size)])
                continue
            if hi == lo:
                # An empty block: narrow any source piece to length 0 (piece_len is that
                # piece's real length, so the narrow is not skipped).
                p = _piece_of(size, pieces, min(lo, size - 1)) if size else 0
                plo, phi = split_bounds(size, pieces, p)
                per_dim.append([(p, 0, 0, phi - plo)])
                continue
            entries = []
            for p in range(_piece_of(size, pieces, lo), _piece_of(size, pieces, hi - 1) + 1):
                plo, phi = split_bounds(size, pieces, p)
                s, e = max(lo, plo), min(hi, phi)
                entries.append((p, s - plo, e - s, phi - plo))
            per_dim.append(entries)

        def build(d: int, chosen: tuple[tuple[int, int, int, int], ...], k: int = k,
                  coord: tuple[int, ...] = coord,
                  per_dim: list[list[tuple[int, int, int, int]]] = per_dim) -> Node:
            if d == len(per_dim):
                src_coord = list(coord)
                narrows = []
                for dd, (p, start, length, plen) in enumerate(chosen):
                    axes = src.dims[dd]
                    for a, c in zip(axes, _unravel(p, [mesh.mesh_shape[a] for a in axes])):
                        src_coord[a] = c
                    if start != 0 or length != plen:
                        narrows.append((dd, start, length))
                j = rep_src[mesh.index_of(src_coord)]
                move = torch_dev[k] if torch_dev[j] != torch_dev[k] else None
                return ("leaf", j, tuple(narrows), move)
            if len(per_dim[d]) == 1:
                return build(d + 1, (*chosen, per_dim[d][0]))
            return ("cat", d, tuple(build(d + 1, (*chosen, e)) for e in per_dim[d]))

        nodes[k] = build(0, ())
    return rep_dst, nodes


@functools.lru_cache(maxsize=4096)
def _splits(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[
        tuple[int, int, tuple[int, ...], tuple[tuple[int, tuple[tuple[int, int, int], ...]],
                                              ...]], ...]:
    """Sources cut into several pieces along one dim that tile it exactly: one
    ``torch.split`` per source instead of one ``narrow`` per piece (all_to_all
    cuts every source into one piece per peer)."""
    _, nodes = _assemble_recipe(src, dst, shape)
    leaves: dict[int, set[tuple[tuple[int, int, int], ...]]] = {}

    def walk(node: Node) -> None:
        if node[0] == "leaf":
            leaves.setdefault(node[1], set()).add(node[2])
        else:
            for child in node[2]:
                walk(child)

    for node in nodes.values():
        walk(node)
    out = []
    mesh = src.mesh
    for j, cuts in leaves.items():
        if len(cuts) < 2 or any(len(c) != 1 for c in cuts):
            continue
        dims = {c[0][0] for c in cuts}
        if len(dims) != 1:
            continue
        d = dims.pop()
        ordered = sorted(cuts, key=lambda c: c[0][1])
        size = local_shape(shape, src, mesh.coord_of(j))[d]
        pos = 0
        for c in ordered:
            if c[0][1] != pos:
                break
            pos += c[0][2]
        else:
            if pos == size:
                out.append((j, d, tuple(c[0][2] for c in ordered),
                            tuple((j, c) for c in ordered)))
    return tuple(out)


def _run(node: Node, shards: Sequence[torch.Tensor],
         pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] | None = None
         ) -> torch.Tensor:
    if node[0] == "leaf":
        t = pieces.get((node[1], node[2])) if pieces else None
        if t is None:
            t = shards[node[1]]
            for dim, start, length in node[2]:
                t = t.narrow(dim, start, length)
        return t if node[3] is None else t.to(node[3])
    return torch.cat([_run(child, shards, pieces) for child in node[2]], dim=node[1])


def assemble(shards: Sequence[torch.Tensor], src: Layout, dst: Layout,
             shape: tuple[int, ...]) -> Shards:
    """Move blocks from layout ``src`` to ``dst`` (same Partial axes): views where a
    target block lies in one source block, one ``cat`` copy otherwise."""
    rep_dst, nodes = _assemble_recipe(src, dst, shape)
    pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] = {}
    for j, d, sizes, keys in _splits(src, dst, shape):
        pieces.update(zip(keys, shards[j].split_with_sizes(list(sizes), d)))
    built = {k: _run(node, shards, pieces) for k, node in nodes.items()}
    return [built[r] for r in rep_dst]


def _combine(objs: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce ``objs`` left to right into ONE fresh buffer: the first op allocates,
    the rest accumulate in place (a fresh 64 MiB buffer costs ~3 copies in page
    faults). In-place accumulation is autograd-safe for sum; max/min/prod keep
    out-of-place ops while a gradient is being recorded."""
    if len(objs) == 1:
        return objs[0]
    if op is ReduceOp.AVG and not (objs[0].is_floating_point() or objs[0].is_complex()):
        raise ShardingError(
            f"Cannot average (ReduceOp.AVG) values of integer dtype {objs[0].dtype}: the "
            "mean is not an integer. Cast to a floating dtype first, or use SUM."
        )
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        out = objs[0] + objs[1]
        for o in objs[2:]:
            out.add_(o)
        if op is ReduceOp.AVG:
            out.div_(len(objs))
        return out
    fn = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}[op]
    out = fn(objs[0], objs[1])
    tracked = (torch.is_grad_enabled() and any(o.requires_grad for o in objs)) or (
        fwAD._current_level >= 0)  # forward-mode AD has no out= variants
    for o in objs[2:]:
        out = fn(out, o) if tracked else fn(out, o, out=out)
    return out


@functools.lru_cache(maxsize=4096)
def _groups(layout: Layout, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in layout.mesh.groups(axes))


def reduce(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
           op: ReduceOp) -> Shards:
    """Combine the local values along ``axes`` by ``op``; every device of a group
    gets the one result object."""
    out: list[torch.Tensor | None] = [None] * len(shards)
    memo: dict[tuple[int, ...], torch.Tensor] = {}
    for group in _groups(layout, axes):
        objs = [shards[k] for k in group]
        key = tuple(id(o) for o in objs)
        res = memo.get(key)
        if res is None:
            dev = objs[0].device
            res = _combine([o if o.device == dev else o.to(dev) for o in objs], op)
            memo[key] = res
        for k in group:
            out[k] = res if res.device == shards[k].device else res.to(shards[k].device)
    return out  # type: ignore[return-value]


def identity_like(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The identity element of ``op`` broadcast to ``t``'s shape (no memory)."""
    value = 1 if op is ReduceOp.PROD else 0
    return torch.full((), value, dtype=t.dtype, device=t.device).expand(t.shape)


def make_partial(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
                 op: ReduceOp) -> Shards:
    """Replicated along ``axes`` -> Partial(op) with the same global value: for SUM
    and PROD only coordinate 0 keeps the value (others hold the identity); for
    AVG, MIN and MAX every device keeps it."""
    if op in (ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX):
        return list(shards)
    mesh = layout.mesh
    memo: dict[int, torch.Tensor] = {}
    out = []
    for k, t in enumerate(shards):
        coord = mesh.coord_of(k)
        if all(coord[a] == 0 for a in axes):
            out.append(t)
        else:
            ident = memo.get(id(t))
            if ident is None:
                ident = memo[id(t)] = identity_like(t, op)
            out.append(ident)
    return out


def run_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> Shards:
    """Execute one planner step on the simulated mesh."""
    kind = step.kind
    if kind in ("slice", "all_gather", "all_to_all"):
        return assemble(shards, step.before, step.after, shape)
    if kind == "all_reduce":
        assert step.reduce_op is not None
        return reduce(shards, step.before, step.axes, step.reduce_op)
    if kind == "reduce_scatter":
        assert step.reduce_op is not None
        reduced = reduce(shards, step.before, step.axes, step.reduce_op)
        partial = list(step.before.partial)
        for a in step.axes:
            partial[a] = None
        mid = step.before.with_partial(tuple(partial))
        return assemble(_dedupe(reduced, mid), mid, step.after, shape)
    if kind == "make_partial":
        assert step.reduce_op is not None
        return make_partial(shards, step.before, step.axes, step.reduce_op)
    raise AssertionError(f"unknown step kind {kind!r}")


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


def diverge(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...]) -> Shards:
    """A value replicated over ``axes`` feeds an op whose output is not (sharded or
    Partial there). Nothing to do here: the replicas share one buffer, so torch
    already sums the devices' shares of its gradient."""
    return list(shards)


def permute(shards: Sequence[torch.Tensor], layout: Layout, source: Sequence[int | None],
            shape: tuple[int, ...]) -> Shards:
    """Device ``k`` receives device ``source[k]``'s block (zeros when None); replicas
    keep sharing one object."""
    mesh = layout.mesh
    reps = rep_indices(layout)
    out: list[torch.Tensor] = []
    zeros: dict[tuple[int, ...], torch.Tensor] = {}
    for k, s in enumerate(source):
        if reps[k] != k:
            out.append(out[reps[k]])
            continue
        dev = device_of(mesh, k)
        if s is None:
            want = local_shape(shape, layout, mesh.coord_of(k))
            z = zeros.get(want)
            if z is None:
                z = zeros[want] = torch.zeros((), dtype=shards[0].dtype, device=dev).expand(want)
            out.append(z)
        else:
            got = shards[s]
            out.append(got if got.device == dev else got.to(dev))
    return out


def device_of(mesh: DeviceMesh, k: int) -> torch.device:
    return mesh.devices[k].to_torch()


def owned(mesh: DeviceMesh) -> range:
    """The mesh devices this process holds: all of them."""
    return range(mesh.num_devices)
