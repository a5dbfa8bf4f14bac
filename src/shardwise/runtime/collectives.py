"""The torch.distributed runtime: each process holds only its own shards.

Invariants:
- ``shards[k]`` is present only for the mesh devices this process owns
  (device id == rank); the others are None.
- Each planner step runs one native collective on the process group of its
  mesh axes (groups are created once per (mesh, axes) and cached).
- Gradients follow one convention, so that they equal the simulated
  runtime's (which are the exact derivatives of the global computation):
  on Replicated axes every replica holds the full gradient; on Sharded axes
  each device holds its piece; on Partial axes device ``i`` holds dL/dp_i.
  Each step's backward maps that convention through it (see ``multiprocess.py``).
- Inputs are never mutated: collectives run on fresh buffers.
- Every collective first agrees on its fingerprint with its group (``agreement.py``:
  one fixed-size control message; a small float all_reduce travels inside it) and
  every wait is bounded by the run's timeout: a skipped, mismatched, stalled or dead
  peer raises :class:`CollectiveError` on the others, never a hang or a Gloo abort.
  The fingerprint holds only what every member sees alike (global sizes, not the
  local block's).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime import agreement as A
from shardwise.runtime import buffers, check_average
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape

__all__ = ["Group", "group", "is_process_mesh", "my_index", "reset_groups"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_TORCH_OP = A._TORCH_OP


class Group:
    """A process group over mesh axes, as seen from this process."""

    __slots__ = ("label", "members", "pg", "pos", "ranks", "slot")

    def __init__(self, pg: Any, members: tuple[int, ...], ranks: tuple[int, ...],
                 pos: int, label: str = "") -> None:
        self.pg = pg            # torch ProcessGroup (None when this process is not a member)
        self.members = members  # flat mesh indices, row-major over the axes
        self.ranks = ranks
        self.pos = pos          # this process's position among the members
        self.label = label      # e.g. "mesh axes ('tp',) of DeviceMesh(dp=2, tp=2)"
        # torch orders a group's members by global rank; slot[p] is member p's place
        # in that order (None when it is the members' own order).
        order = sorted(ranks)
        slot = tuple(order.index(r) for r in ranks)
        self.slot = None if slot == tuple(range(len(ranks))) else slot

    def by_slot(self, items: Sequence[Any]) -> list[Any]:
        """Per-member items -> the order torch's collective uses."""
        if self.slot is None:
            return list(items)
        out: list[Any] = [None] * len(items)
        for p, item in enumerate(items):
            out[self.slot[p]] = item
        return out

    def by_member(self, items: Sequence[Any]) -> list[Any]:
        """Items in torch's order -> per-member order."""
        return list(items) if self.slot is None else [items[j] for j in self.slot]

    @property
    def size(self) -> int:
        return len(self.members)


_GROUPS: dict[tuple[DeviceMesh, tuple[int, ...]], Group] = {}


def reset_groups() -> None:
    _GROUPS.clear()
    _INDEX.clear()
    _CHECKED.clear()
    A.reset()
    from shardwise.runtime import multiprocess

    multiprocess._SPECS.clear()


def rank() -> int:
    return int(dist.get_rank())


# Per mesh: this process's index in it (None: not a member). Cached because every
# op asks; valid for one world, so reset_groups() (shardwise.distributed.shutdown)
# clears it with the process groups.
_INDEX: dict[DeviceMesh, int | None] = {}
_CHECKED: set[DeviceMesh] = set()  # meshes that fit the world


def is_process_mesh(mesh: DeviceMesh) -> bool:
    """True when the mesh's devices are processes of the initialized world."""
    return dist.is_available() and dist.is_initialized() and process_mesh(mesh)


def process_mesh(mesh: DeviceMesh) -> bool:
    """:func:`is_process_mesh` once the world is known to be initialized (errors
    when the mesh names more devices than there are processes)."""
    if mesh in _CHECKED:
        return True
    world = dist.get_world_size()
    big = [d for d in mesh.devices if getattr(d, "id", -1) >= world]
    if big:
        raise ShardingError(
            f"{mesh!r} names devices {big[:4]} but this run has {world} processes (device i "
            f"is process i): build meshes of at most {world} devices, or launch more "
            "processes (torchrun --nproc-per-node)."
        )
    _CHECKED.add(mesh)
    return True


def my_index(mesh: DeviceMesh) -> int | None:
    """This process's flat index among ``mesh``'s devices, or None."""
    try:
        return _INDEX[mesh]
    except KeyError:
        pass
    me = rank()
    k = next((k for k, d in enumerate(mesh.devices) if d.id == me), None)
    _INDEX[mesh] = k
    return k


def group(mesh: DeviceMesh, axes: tuple[int, ...]) -> Group:
    """This process's group over ``axes`` of ``mesh`` (created once, collectively),
    its members row-major over ``axes`` in the order given.

    Only sorted axes create process groups; axes in another order reuse those of
    their sorted order (the same members), so naming them needs no collective
    call once the sorted group exists (shard_map creates every sorted one up front)."""
    key = (mesh, axes)
    hit = _GROUPS.get(key)
    if hit is not None:
        return hit
    me = my_index(mesh)
    label = f"mesh axes {tuple(mesh.axis_names[a] for a in axes)} of {mesh!r}"
    base_axes = tuple(sorted(axes))
    if base_axes != axes:
        base = group(mesh, base_axes)
        result = Group(None, (), (), -1, label)
        if base.pos >= 0 and me is not None:
            members = next(m for m in mesh.groups(axes) if me in m)
            ranks = tuple(mesh.devices[k].id for k in members)
            result = Group(base.pg, tuple(members), ranks, members.index(me), label)
        _GROUPS[key] = result
        return result
    world = world_group()
    # Creating groups is collective over the world, matched by call order: processes
    # creating different groups would pair them up silently, so they agree first.
    A.agree(world.pg, world.ranks, world.label,
            A.fingerprint("create process groups", None, label, (), None))
    found: Group | None = None
    for members in mesh.groups(axes):
        ranks = tuple(mesh.devices[k].id for k in members)
        if ranks == world.ranks:
            pg: Any = dist.group.WORLD
        elif len(ranks) == 1:
            pg = None
        else:  # every process calls this, member or not
            pg = A.run("creating process groups", world.label, world.ranks, lambda r=ranks:
                       dist.new_group(list(r), timeout=A.timeout()))
        if me is not None and me in members:
            found = Group(pg, tuple(members), ranks, members.index(me), label)
    result = found or Group(None, (), (), -1, label)
    _GROUPS[key] = result
    return result


def world_group() -> Group:
    world = dist.get_world_size()
    return Group(dist.group.WORLD, tuple(range(world)), tuple(range(world)), rank(), "world")


def sizes_along(shape: tuple[int, ...], layout: Layout, members: Sequence[int], dim: int,
                mesh: DeviceMesh) -> list[int]:
    return [local_shape(shape, layout, mesh.coord_of(m))[dim] for m in members]


CHECK = {"enabled": os.environ.get("SHARDWISE_CHECK_COLLECTIVES", "") == "1"}


def _agree(what: str, g: Group, shape: tuple[int, ...], dtype: Any, tag: str,
           op: ReduceOp | None = None, sizes: tuple[int, ...] = (),
           device: torch.device | None = None) -> A.Fingerprint:
    """The control message of one collective (see ``agreement.py``); with the debug
    check on, also an all_gather of every member's full fingerprint."""
    if CHECK["enabled"]:
        tag += " [debug check]"  # members that differ in the mode disagree here
    fp = A.fingerprint(what, op, g.label, shape, dtype, tag, sizes)
    if A.STATE["on"]:
        A.agree(g.pg, g.ranks, g.label, fp, device=device)
    if CHECK["enabled"]:
        A.debug_check(g.pg, g.ranks, g.slot, g.label, fp)
    return fp


def _call(what: str, g: Group, fn: Callable[[], Any], sig: str = "") -> Any:
    """Run the data exchange of an agreed collective (every one passes here once)."""
    return A.run(what, g.label, g.ranks, fn, g.pg or dist.group.WORLD)


def _shape(shape: Sequence[int], dims: dict[int, int]) -> tuple[int, ...]:
    """``shape`` with some dims replaced: the rank-independent shape of a call."""
    return tuple(dims.get(d, s) for d, s in enumerate(shape))


# --- primitives on local tensors (no autograd) -------------------------------------------
def all_gather(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int], tag: str = ""
               ) -> torch.Tensor:
    """Concatenate the members' blocks along ``dim`` (uneven sizes padded in transit)."""
    if g.size == 1:
        return x
    _agree("all_gather", g, _shape(x.shape, {dim: sum(sizes)}), x.dtype, f"{tag} dim {dim}",
           sizes=tuple(sizes), device=x.device)
    if x.device.type == "cpu":
        return _all_gather_by_exchange(x, dim, g, sizes)
    m = max(sizes)
    xm = x.movedim(dim, 0)
    if xm.shape[0] < m:
        xm = torch.cat([xm, xm.new_zeros((m - xm.shape[0], *xm.shape[1:]))])
    xm = xm.contiguous()
    out = buffers.empty((g.size * m, *xm.shape[1:]), xm)
    _call("all_gather", g, lambda: _all_gather(out, xm, group=g.pg))
    if g.slot is not None or any(s != m for s in sizes):
        slots = g.slot or range(g.size)
        out = torch.cat([out.narrow(0, slots[p] * m, s) for p, s in enumerate(sizes)])
    return out.movedim(0, dim)


def _all_gather_by_exchange(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int]
                            ) -> torch.Tensor:
    """all_gather as point-to-point sends of this block to every peer, each received
    straight into its place in the result. Why on CPU: Gloo's all_gather was measured
    1.5x slower (64 MiB on 4 ranks: 190-207 ms against 114-132 ms). Uneven pieces
    need no padding, and members land in member order whatever torch's rank order."""
    xm = x.movedim(dim, 0).contiguous()
    out = buffers.empty((sum(sizes), *xm.shape[1:]), xm)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    out.narrow(0, starts[g.pos], sizes[g.pos]).copy_(xm)
    ops = []
    for step in range(1, g.size):  # staggered peers, so no rank is everyone's first
        to, frm = (g.pos + step) % g.size, (g.pos - step) % g.size
        if sizes[g.pos]:
            ops.append(dist.P2POp(dist.isend, xm, g.ranks[to], g.pg))
        if sizes[frm]:
            ops.append(dist.P2POp(dist.irecv, out.narrow(0, starts[frm], sizes[frm]),
                                  g.ranks[frm], g.pg))
    if ops:
        _call("all_gather", g, lambda: A.wait_all(dist.batch_isend_irecv(ops)))
    return out.movedim(0, dim)


def all_reduce(x: torch.Tensor, g: Group, op: ReduceOp, tag: str = "") -> torch.Tensor:
    check_average(x, op)
    if g.size == 1:
        return buffers.empty(x.shape, x).copy_(x)
    if A.foldable(x, op) and A.STATE["on"] and not CHECK["enabled"]:  # data in the message
        fp = A.fingerprint("all_reduce", op, g.label, tuple(x.shape), x.dtype, tag)
        out: torch.Tensor = _call("all_reduce", g,
                                  lambda: A.agree(g.pg, g.ranks, g.label, fp, x, op))
        return out
    _agree("all_reduce", g, tuple(x.shape), x.dtype, tag, op, device=x.device)
    out = buffers.empty(x.shape, x).copy_(x)  # a clone (huge pages when large)
    _call("all_reduce", g, lambda: dist.all_reduce(out, _TORCH_OP[op], group=g.pg))
    return out


def reduce_scatter(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int],
                   op: ReduceOp, tag: str = "") -> torch.Tensor:
    """Reduce the members' full blocks and keep this member's piece along ``dim``."""
    if g.size == 1:
        return x.clone()
    check_average(x, op)
    _agree("reduce_scatter", g, tuple(x.shape), x.dtype, f"{tag} dim {dim}", op, tuple(sizes),
           x.device)
    if x.device.type == "cpu":
        return _reduce_scatter_by_exchange(x, dim, g, sizes, op)
    m = max(sizes)
    xm = x.movedim(dim, 0)
    if g.slot is None and all(s == m for s in sizes):
        inp = xm.contiguous()
    else:
        parts, off = [], 0
        for s in sizes:
            piece = xm.narrow(0, off, s)
            off += s
            if s < m:
                piece = torch.cat([piece, piece.new_zeros((m - s, *piece.shape[1:]))])
            parts.append(piece)
        inp = torch.cat(g.by_slot(parts))
    out = inp.new_empty((m, *inp.shape[1:]))
    _call("reduce_scatter", g, lambda: _reduce_scatter(out, inp, _TORCH_OP[op], group=g.pg))
    return out.narrow(0, 0, sizes[g.pos]).movedim(0, dim)


_LOCAL_REDUCE: dict[ReduceOp, Callable[[torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: lambda t: t.sum(0), ReduceOp.AVG: lambda t: t.mean(0),
    ReduceOp.MAX: lambda t: t.amax(0), ReduceOp.MIN: lambda t: t.amin(0),
    ReduceOp.PROD: lambda t: t.prod(0),
}


def _reduce_scatter_by_exchange(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int],
                                op: ReduceOp) -> torch.Tensor:
    """reduce_scatter as one all_to_all (member j gets everyone's piece j) and a local
    reduction. Why on CPU: Gloo's reduce_scatter is a clone, a whole-tensor ring
    all_reduce and a copy, which moves 2(n-1)/n of the tensor per rank; this moves
    (n-1)/n (measured 1.4-1.7x faster for 64 MiB on 4 ranks). No padding for uneven
    pieces: all_to_all takes per-peer sizes."""
    xm = x.movedim(dim, 0)
    rest = math.prod(xm.shape[1:])
    pieces = g.by_slot(list(xm.split(list(sizes), 0)))
    inp = (xm if g.slot is None else torch.cat(pieces)).contiguous()
    mine = sizes[g.pos]
    out = buffers.empty((g.size * mine * rest,), x)
    in_splits = [p.shape[0] * rest for p in pieces]
    _call("reduce_scatter", g, lambda: dist.all_to_all_single(
        out, inp.view(-1), [mine * rest] * g.size, in_splits, group=g.pg))
    return _LOCAL_REDUCE[op](out.view(g.size, mine, *xm.shape[1:])).movedim(0, dim)


def all_to_all(x: torch.Tensor, dim: int, dim2: int, g: Group, send: Sequence[int],
               recv: Sequence[int], tag: str = "") -> torch.Tensor:
    """Split ``x`` along ``dim2`` (``send[j]`` to member j); concatenate what
    arrives along ``dim`` (``recv[i]`` from member i).

    Each chunk is packed with ``dim`` outermost, in one copy into one buffer, so
    what arrives is already the concatenation along ``dim``: no unpack copy."""
    if g.size == 1:
        return x
    # send/recv are this member's row and column of the exchange: not rank-independent
    _agree("all_to_all", g, _shape(x.shape, {dim: -1, dim2: -1}), x.dtype,
           f"{tag} dim {dim}<-{dim2}", device=x.device)
    chunks = g.by_slot([c.movedim(dim, 0) for c in x.split(list(send), dim2)])
    in_splits = [c.numel() for c in chunks]
    flat_in = x.new_empty(sum(in_splits))
    off = 0
    for c, n in zip(chunks, in_splits):
        flat_in[off: off + n].view(c.shape).copy_(c)
        off += n
    # A received piece: ``dim`` outermost (recv[i] long), ``dim2`` is my own chunk's
    # length (``dim2`` may have shifted by the move; when dim == dim2 the received
    # length is recv[i] alone).
    moved = list(x.movedim(dim, 0).shape)
    if dim2 != dim:
        moved[dim2 + 1 if dim2 < dim else dim2] = send[g.pos]
    rest = 1
    for v in moved[1:]:
        rest *= v
    out_splits = g.by_slot([s * rest for s in recv])
    flat_out = buffers.empty((sum(out_splits),), x)
    _call("all_to_all", g, lambda: dist.all_to_all_single(
        flat_out, flat_in, out_splits, in_splits, group=g.pg))
    if g.slot is None:
        return flat_out.view(sum(recv), *moved[1:]).movedim(0, dim)
    pieces = g.by_member(list(flat_out.split(out_splits)))
    return torch.cat([p.view(r, *moved[1:]) for p, r in zip(pieces, recv)]).movedim(0, dim)


def permute(x: torch.Tensor | None, send_to: int | None, recv_from: int | None,
            like: torch.Tensor, g: Group | None = None, tag: str = "") -> torch.Tensor:
    """Send ``x`` to rank ``send_to`` and receive from ``recv_from`` (zeros if None).

    ``g``: the group of every process taking part (each calls this, also one that
    keeps its own block, so that all agree first); ``tag`` must be the same on all
    of them (e.g. the whole permutation), the block shape may differ."""
    if g is not None:
        agree_permute(g, like, tag)
    ops = []
    # Receivers are overwritten whole; only a device that receives nothing holds zeros.
    out = (torch.zeros_like(like, memory_format=torch.contiguous_format) if recv_from is None
           else torch.empty_like(like, memory_format=torch.contiguous_format))
    if send_to is not None and x is not None:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), send_to))
    if recv_from is not None:
        ops.append(dist.P2POp(dist.irecv, out, recv_from))
    if ops:
        peers = (send_to or 0, recv_from or 0)
        pair = g or Group(None, (), peers, 0, f"ranks {peers}")
        _call("ppermute", pair, lambda: A.wait_all(dist.batch_isend_irecv(ops)))
    return out


def agree_permute(g: Group, like: torch.Tensor, tag: str) -> None:
    """The control message of a point-to-point exchange among ``g``'s members
    (rank-independent fingerprint: dtype, ndim and ``tag``)."""
    if g.size > 1:
        _agree("ppermute", g, (like.dim(),), like.dtype, tag, device=like.device)


def broadcast(x: torch.Tensor, src_rank: int, g: Group, tag: str = "") -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if g.size > 1:
        _agree("broadcast", g, tuple(x.shape), x.dtype, f"{tag} from rank {src_rank}",
               device=x.device)
        _call("broadcast", g, lambda: dist.broadcast(out, src_rank, group=g.pg))
    return out
