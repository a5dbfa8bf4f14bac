"""shard_map on the torch.distributed runtime: each lax collective is one native
collective on the process group of its mesh axes, as a tiny autograd Function
whose backward is the math transpose.

    psum          all_reduce(sum) in forward,     all_reduce(sum) in backward
    pmax / pmin   all_reduce(max/min) in forward, summed gradient to the argmax (ties split)
    all_gather    all_gather in forward,          reduce_scatter(sum) in backward
    psum_scatter  reduce_scatter(sum) in forward, all_gather in backward
    ppermute      send/recv in forward,           inverse send/recv in backward
    all_to_all    all_to_all in forward,          inverse all_to_all in backward
    replicate     identity in forward,            all_reduce(sum) over the axes in backward
    take_first    identity in forward,            zeros in backward (off coordinate 0)

The last two are shard_map's boundaries: an input replicated over mesh axes R
feeds every device of R (its gradient is the sum of theirs); an output
replicated over R is taken from coordinate 0 along R (the others get no
gradient). Together they give the gradients of the simulated runtime exactly.

Invariants:
- torch process groups number their members by sorted global rank; a group
  named by axes in another order (or a mesh over permuted devices) is reordered
  here, so pieces always follow the axis order, as in the simulated runtime.
- Uneven sizes are exchanged first (one small all_gather or send/recv of the
  sizes) for tiled all_gather, all_to_all and ppermute; equal-shape calls skip it.
- Forward-mode tangents go through the same (linear) forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from shardwise.runtime import collectives as D
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_size

__all__ = ["DistEnv", "OrderedGroup", "ordered_group", "replicate", "take_first"]


class OrderedGroup:
    """This process's group over some mesh axes: the torch group (``grp``, members
    in process-group order), this process's position in axis order (``pos``), the
    members' global ranks in axis order, and ``to_pg[i]`` = the process-group
    position of member ``i`` (None when the orders agree)."""

    __slots__ = ("grp", "pos", "ranks", "size", "to_pg")

    def __init__(self, grp: D.Group, pos: int, ranks: tuple[int, ...],
                 to_pg: tuple[int, ...] | None) -> None:
        self.grp, self.pos, self.ranks, self.to_pg = grp, pos, ranks, to_pg
        self.size = len(ranks)

    def pg_order(self, items: Sequence[Any]) -> list[Any]:
        """Per-member items (axis order) -> process-group order."""
        if self.to_pg is None:
            return list(items)
        out: list[Any] = [None] * self.size
        for i, item in enumerate(items):
            out[self.to_pg[i]] = item
        return out

    def axis_order(self, items: Sequence[Any]) -> list[Any]:
        """Per-member items (process-group order) -> axis order."""
        return list(items) if self.to_pg is None else [items[j] for j in self.to_pg]


_ORDERED: dict[tuple[DeviceMesh, tuple[int, ...]], OrderedGroup] = {}


def ordered_group(mesh: DeviceMesh, axes: tuple[int, ...]) -> OrderedGroup:
    key = (mesh, axes)
    base = D.group(mesh, tuple(sorted(axes)))  # same members, whatever the order
    hit = _ORDERED.get(key)
    if hit is not None and hit.grp.pg is base.pg:  # (not a group of an earlier world)
        return hit
    me = D.my_index(mesh)
    assert me is not None, "shard_map checks that this process is in the mesh"
    members = next(g for g in mesh.groups(axes) if me in g)
    ranks = tuple(mesh.devices[m].id for m in members)
    pg_ranks = sorted(ranks)
    to_pg = tuple(pg_ranks.index(r) for r in ranks)
    grp = D.Group(base.pg, tuple(members[to_pg.index(j)] for j in range(len(ranks))),
                  tuple(pg_ranks), pg_ranks.index(D.rank()))
    out = OrderedGroup(grp, members.index(me), ranks,
                       None if to_pg == tuple(range(len(ranks))) else to_pg)
    _ORDERED[key] = out
    return out


# --- primitives in axis order (no autograd) -----------------------------------------------
def gather(x: torch.Tensor, dim: int, og: OrderedGroup, sizes: Sequence[int]) -> torch.Tensor:
    if og.to_pg is None:
        return D.all_gather(x, dim, og.grp, sizes)
    sizes_pg = og.pg_order(sizes)
    parts = D.all_gather(x, dim, og.grp, sizes_pg).split(sizes_pg, dim)
    return torch.cat(og.axis_order(parts), dim)


def scatter(x: torch.Tensor, dim: int, og: OrderedGroup, sizes: Sequence[int]) -> torch.Tensor:
    """reduce_scatter(sum): this member's piece (``sizes``, axis order) of the sum."""
    if og.to_pg is not None:
        x = torch.cat(og.pg_order(x.split(list(sizes), dim)), dim)
        sizes = og.pg_order(sizes)
    return D.reduce_scatter(x, dim, og.grp, sizes, ReduceOp.SUM)


def exchange(x: torch.Tensor, split: int, concat: int, og: OrderedGroup, send: Sequence[int],
             recv: Sequence[int]) -> torch.Tensor:
    """all_to_all: ``send[j]`` of dim ``split`` to member j; concatenate ``recv[i]``
    from member i along ``concat`` (all in axis order)."""
    if split == concat != 0:  # one dim both ways: exchange it outermost
        return exchange(x.movedim(split, 0), 0, 0, og, send, recv).movedim(0, split)
    if og.to_pg is None:
        return D.all_to_all(x, concat, split, og.grp, send, recv)
    x = torch.cat(og.pg_order(x.split(list(send), split)), split)
    recv_pg = og.pg_order(recv)
    out = D.all_to_all(x, concat, split, og.grp, og.pg_order(send), recv_pg)
    return torch.cat(og.axis_order(out.split(recv_pg, concat)), concat)


def sizes_of(n: int, og: OrderedGroup, device: torch.device) -> list[int]:
    """Every member's ``n`` (axis order), by one small all_gather."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    return [int(v) for v in gather(t, 0, og, [1] * og.size).tolist()]


def _sum(x: torch.Tensor, og: OrderedGroup) -> torch.Tensor:
    return D.all_reduce(x, og.grp, ReduceOp.SUM)


# --- the collectives, each with its transpose -----------------------------------------------
class _PSum(Function):
    """all_reduce(sum) in forward, all_reduce(sum) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup) -> torch.Tensor:
        ctx.og = og
        return _sum(x, og)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _sum(g, ctx.og), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return _sum(t, ctx.og)


class _PExtreme(Function):
    """all_reduce(max/min) in forward; the summed gradient to the devices holding
    the extreme, split among ties, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup, op: ReduceOp) -> torch.Tensor:
        out = D.all_reduce(x, og.grp, op)
        ctx.og = og
        ctx.save_for_backward(x, out)
        ctx.fw = (x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, out = ctx.saved_tensors
        mask = (x == out).to(g.dtype)
        return _sum(g, ctx.og) * mask / _sum(mask, ctx.og), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        x, out = ctx.fw
        mask = (x == out).to(t.dtype)
        return _sum(t * mask, ctx.og) / _sum(mask, ctx.og)


class _AllGather(Function):
    """all_gather in forward, reduce_scatter(sum) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup, dim: int,
                sizes: list[int]) -> torch.Tensor:
        ctx.spec = (og, dim, sizes)
        return gather(x, dim, og, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        og, dim, sizes = ctx.spec
        return scatter(g, dim, og, sizes), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        og, dim, sizes = ctx.spec
        return gather(t, dim, og, sizes)


class _PSumScatter(Function):
    """reduce_scatter(sum) in forward, all_gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup, dim: int,
                sizes: list[int]) -> torch.Tensor:
        ctx.spec = (og, dim, sizes)
        return scatter(x, dim, og, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        og, dim, sizes = ctx.spec
        return gather(g, dim, og, sizes), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        og, dim, sizes = ctx.spec
        return scatter(t, dim, og, sizes)


class _AllToAll(Function):
    """all_to_all in forward, the inverse all_to_all in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup, split: int, concat: int,
                send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.spec = (og, split, concat, send, recv)
        return exchange(x, split, concat, og, send, recv)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        og, split, concat, send, recv = ctx.spec
        return exchange(g, concat, split, og, recv, send), None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        og, split, concat, send, recv = ctx.spec
        return exchange(t, split, concat, og, send, recv)


class _PPermute(Function):
    """send/recv in forward, the inverse send/recv in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send_to: int | None, recv_from: int | None,
                recv_shape: tuple[int, ...]) -> torch.Tensor:
        ctx.spec = (send_to, recv_from, tuple(x.shape), recv_shape)
        return D.permute(x, send_to, recv_from, x.new_empty(recv_shape))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        send_to, recv_from, shape, _ = ctx.spec
        return D.permute(g, recv_from, send_to, g.new_empty(shape)), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        send_to, recv_from, _, recv_shape = ctx.spec
        return D.permute(t, send_to, recv_from, t.new_empty(recv_shape))


def _ppermute(x: torch.Tensor, og: OrderedGroup, pairs: tuple[tuple[int, int], ...]
              ) -> torch.Tensor:
    dst = {s: d for s, d in pairs}.get(og.pos)
    src = {d: s for s, d in pairs}.get(og.pos)
    if src is not None and src == og.pos:
        return x
    send_to = None if dst is None else og.ranks[dst]
    recv_from = None if src is None else og.ranks[src]
    # The receiver learns the sender's shape first (blocks may be uneven).
    shape = torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)
    got = D.permute(shape, send_to, recv_from, shape)
    recv_shape = tuple(int(v) for v in got.tolist()) if src is not None else tuple(x.shape)
    return _PPermute.apply(x, send_to, recv_from, recv_shape)


def _all_gather(x: torch.Tensor, og: OrderedGroup, params: tuple[Any, ...]) -> torch.Tensor:
    dim, even = params
    sizes = [x.shape[dim]] * og.size if even else sizes_of(x.shape[dim], og, x.device)
    return _AllGather.apply(x, og, dim, sizes)


def _psum_scatter(x: torch.Tensor, og: OrderedGroup, params: tuple[Any, ...]) -> torch.Tensor:
    (dim,) = params
    sizes = [split_size(x.shape[dim], og.size, i) for i in range(og.size)]
    return _PSumScatter.apply(x, og, dim, sizes)


def _all_to_all(x: torch.Tensor, og: OrderedGroup, params: tuple[Any, ...]) -> torch.Tensor:
    split, concat, even = params
    send = [split_size(x.shape[split], og.size, j) for j in range(og.size)]
    held = [x.shape[concat]] * og.size if even else sizes_of(x.shape[concat], og, x.device)
    recv = ([split_size(h, og.size, og.pos) for h in held] if split == concat else held)
    return _AllToAll.apply(x, og, split, concat, send, recv)


_OPS = {
    "psum": lambda x, og, p: _PSum.apply(x, og),
    "pmax": lambda x, og, p: _PExtreme.apply(x, og, ReduceOp.MAX),
    "pmin": lambda x, og, p: _PExtreme.apply(x, og, ReduceOp.MIN),
    "all_gather": _all_gather,
    "psum_scatter": _psum_scatter,
    "ppermute": lambda x, og, p: _ppermute(x, og, p[0]),
    "all_to_all": _all_to_all,
}


class DistEnv:
    """The axis environment of this process (mesh device ``index``)."""

    __slots__ = ("coord", "index", "mesh")

    def __init__(self, mesh: DeviceMesh, index: int) -> None:
        self.mesh = mesh
        self.index = index
        self.coord = mesh.coord_of(index)

    def collective(self, op: str, x: torch.Tensor, axes: tuple[int, ...],
                   params: tuple[Any, ...]) -> torch.Tensor:
        from shardwise.debug import comm

        if comm.active():
            comm.record(_KIND[op], x.numel() * x.element_size())
        out: torch.Tensor = _OPS[op](x, ordered_group(self.mesh, axes), params)
        return out


_KIND = {"psum": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
         "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
         "ppermute": "ppermute", "all_to_all": "all_to_all"}


# --- shard_map's boundaries ---------------------------------------------------------------
class _Replicate(Function):
    """identity in forward, all_reduce(sum) over the replicated axes in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, og: OrderedGroup) -> torch.Tensor:
        ctx.og = og
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _sum(g, ctx.og), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t.view_as(t)


class _TakeFirst(Function):
    """identity in forward, zeros in backward (a replica off coordinate 0)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return torch.zeros_like(g)

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)


def replicate(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[int, ...]) -> torch.Tensor:
    """An input block that every device of ``axes`` uses (gradient summed over them)."""
    if not axes or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    out: torch.Tensor = _Replicate.apply(x, ordered_group(mesh, axes))
    return out


def take_first(x: torch.Tensor, mesh: DeviceMesh, index: int, axes: tuple[int, ...]
               ) -> torch.Tensor:
    """An output block replicated over ``axes``: only coordinate 0 along them counts."""
    coord = mesh.coord_of(index)
    if all(coord[a] == 0 for a in axes) or not x.requires_grad:
        return x
    out: torch.Tensor = _TakeFirst.apply(x)
    return out
