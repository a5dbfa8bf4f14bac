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
- Each collective runs on ``collectives.group(mesh, axes)`` with the axes in the
  order the op names them: its members (and so the pieces) follow that axis
  order, as in the simulated runtime, whatever torch's rank order.
- Uneven sizes are exchanged first (one small all_gather or send/recv of the
  sizes) for tiled all_gather, all_to_all and ppermute; equal-shape calls skip it.
- Forward-mode tangents go through the same (linear) forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Function

from shardwise.runtime import collectives as D
from shardwise.runtime import functions as F
from shardwise.runtime import spmd
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_size

__all__ = ["DistEnv", "replicate", "run_spmd", "take_first"]


def sizes_of(n: int, grp: D.Group, device: torch.device) -> list[int]:
    """Every member's ``n`` (axis order), by one small all_gather."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    return [int(v) for v in D.all_gather(t, 0, grp, [1] * grp.size, "lax: sizes").tolist()]


def _sum(x: torch.Tensor, grp: D.Group) -> torch.Tensor:
    return D.all_reduce(x, grp, ReduceOp.SUM, "lax")


# --- the collectives, each with its transpose -----------------------------------------------
class _PSum(Function):
    """all_reduce(sum) in forward, all_reduce(sum) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group) -> torch.Tensor:
        ctx.grp = grp
        return _sum(x, grp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _sum(g, ctx.grp), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return _sum(t, ctx.grp)


class _PExtreme(Function):
    """all_reduce(max/min) in forward; the summed gradient to the devices holding
    the extreme, split among ties, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group, op: ReduceOp) -> torch.Tensor:
        out = D.all_reduce(x, grp, op, "lax")
        ctx.grp = grp
        ctx.save_for_backward(x, out)
        ctx.fw = (x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, out = ctx.saved_tensors
        mask = (x == out).to(g.dtype)
        return _sum(g, ctx.grp) * mask / _sum(mask, ctx.grp), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        x, out = ctx.fw
        mask = (x == out).to(t.dtype)
        return _sum(t * mask, ctx.grp) / _sum(mask, ctx.grp)


class _AllGather(Function):
    """all_gather in forward, reduce_scatter(sum) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group, dim: int,
                sizes: list[int]) -> torch.Tensor:
        ctx.spec = (grp, dim, sizes)
        return D.all_gather(x, dim, grp, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, dim, sizes = ctx.spec
        return D.reduce_scatter(g, dim, grp, sizes, ReduceOp.SUM), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        grp, dim, sizes = ctx.spec
        return D.all_gather(t, dim, grp, sizes)


class _PSumScatter(Function):
    """reduce_scatter(sum) in forward, all_gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group, dim: int,
                sizes: list[int]) -> torch.Tensor:
        ctx.spec = (grp, dim, sizes)
        return D.reduce_scatter(x, dim, grp, sizes, ReduceOp.SUM)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, dim, sizes = ctx.spec
        return D.all_gather(g, dim, grp, sizes), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        grp, dim, sizes = ctx.spec
        return D.reduce_scatter(t, dim, grp, sizes, ReduceOp.SUM)


class _AllToAll(Function):
    """all_to_all in forward, the inverse all_to_all in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group, split: int, concat: int,
                send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.spec = (grp, split, concat, send, recv)
        return D.all_to_all(x, concat, split, grp, send, recv)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, split, concat, send, recv = ctx.spec
        return D.all_to_all(g, split, concat, grp, recv, send), None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        grp, split, concat, send, recv = ctx.spec
        return D.all_to_all(t, concat, split, grp, send, recv)


class _PPermute(Function):
    """send/recv in forward, the inverse send/recv in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group, peers: tuple[int | None, int | None],
                recv_shape: tuple[int, ...], tag: str) -> torch.Tensor:
        ctx.spec = (grp, peers, tuple(x.shape), recv_shape, tag)
        return _exchange(x, grp, peers, recv_shape, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, (send_to, recv_from), shape, _, tag = ctx.spec
        return (_exchange(g, grp, (recv_from, send_to), shape, f"grad of {tag}"),
                None, None, None, None)

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        grp, peers, _, recv_shape, tag = ctx.spec
        return _exchange(t, grp, peers, recv_shape, f"tangent of {tag}")


_KEEP = -1  # peers (_KEEP, _KEEP): this member is its own source (identity)


def _exchange(x: torch.Tensor, grp: D.Group, peers: tuple[int | None, int | None],
              recv_shape: tuple[int, ...], tag: str) -> torch.Tensor:
    """One send/recv; every member of ``grp`` calls it (so all agree first), also one
    that keeps its block."""
    send_to, recv_from = peers
    if send_to == _KEEP:
        D.agree_permute(grp, x, tag)()
        return x.view_as(x)
    return D.permute(x, send_to, recv_from, x.new_empty(recv_shape), grp, tag)


def _ppermute(x: torch.Tensor, grp: D.Group, pairs: tuple[tuple[int, int], ...]
              ) -> torch.Tensor:
    dst = {s: d for s, d in pairs}.get(grp.pos)
    src = {d: s for s, d in pairs}.get(grp.pos)
    tag = f"lax.ppermute {pairs}"
    peers: tuple[int | None, int | None] = (
        (_KEEP, _KEEP) if src is not None and src == grp.pos else
        (None if dst is None else grp.ranks[dst], None if src is None else grp.ranks[src]))
    # The receiver learns the sender's shape first (blocks may be uneven).
    shape = torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)
    got = _exchange(shape, grp, peers, tuple(shape.shape), f"{tag}: shapes of {x.dtype} blocks")
    recv_shape = (tuple(int(v) for v in got.tolist()) if peers[1] not in (None, _KEEP)
                  else tuple(x.shape))
    out: torch.Tensor = _PPermute.apply(x, grp, peers, recv_shape, tag)
    return out


def _all_gather(x: torch.Tensor, grp: D.Group, params: tuple[Any, ...]) -> torch.Tensor:
    dim, even = params
    sizes = [x.shape[dim]] * grp.size if even else sizes_of(x.shape[dim], grp, x.device)
    return _AllGather.apply(x, grp, dim, sizes)


def _psum_scatter(x: torch.Tensor, grp: D.Group, params: tuple[Any, ...]) -> torch.Tensor:
    (dim,) = params
    sizes = [split_size(x.shape[dim], grp.size, i) for i in range(grp.size)]
    return _PSumScatter.apply(x, grp, dim, sizes)


def _all_to_all(x: torch.Tensor, grp: D.Group, params: tuple[Any, ...]) -> torch.Tensor:
    split, concat, even = params
    send = [split_size(x.shape[split], grp.size, j) for j in range(grp.size)]
    held = [x.shape[concat]] * grp.size if even else sizes_of(x.shape[concat], grp, x.device)
    recv = ([split_size(h, grp.size, grp.pos) for h in held] if split == concat else held)
    return _AllToAll.apply(x, grp, split, concat, send, recv)


_OPS = {
    "psum": lambda x, grp, p: _PSum.apply(x, grp),
    "pmax": lambda x, grp, p: _PExtreme.apply(x, grp, ReduceOp.MAX),
    "pmin": lambda x, grp, p: _PExtreme.apply(x, grp, ReduceOp.MIN),
    "all_gather": _all_gather,
    "psum_scatter": _psum_scatter,
    "ppermute": lambda x, grp, p: _ppermute(x, grp, p[0]),
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
        from shardwise.runtime import observe as comm

        if comm.active():
            comm.record(_KIND[op], x.numel() * x.element_size())
        out: torch.Tensor = _OPS[op](x, D.group(self.mesh, axes), params)
        return out


_KIND = {"psum": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
         "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
         "ppermute": "ppermute", "all_to_all": "all_to_all"}


# --- shard_map's boundaries ---------------------------------------------------------------
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
    # identity forward, all_reduce(sum) backward: the same Function as the Tensor
    # runtime's diverge
    out: torch.Tensor = F.Diverge.apply(x, D.group(mesh, axes))
    return out


def take_first(x: torch.Tensor, mesh: DeviceMesh, index: int, axes: tuple[int, ...]
               ) -> torch.Tensor:
    """An output block replicated over ``axes``: only coordinate 0 along them counts."""
    coord = mesh.coord_of(index)
    if all(coord[a] == 0 for a in axes) or not x.requires_grad:
        return x
    out: torch.Tensor = _TakeFirst.apply(x)
    return out


def process_index(mesh: DeviceMesh) -> int:
    """This process's device of ``mesh``, after creating every group a body may use."""
    # Group creation is collective over every process: make all the groups fn may
    # use now, on every process, in one order.
    for r in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), r):
            D.group(mesh, axes)
    k = D.my_index(mesh)
    if k is None:
        raise ShardingError(
            f"shard_map on {mesh!r} in process {D.rank()}, which holds none of its devices: "
            "fn has no block to run on here (this process did take part in creating the "
            "mesh's process groups, which every process must). Build the mesh over every "
            "process, or skip this call where D.my_index(mesh) is None after that."
        )
    return k


def run_spmd(fn: Callable[..., Any], mesh: DeviceMesh,
             inputs: Sequence[tuple[Sequence[torch.Tensor | None], Layout]], timeout_s: float
             ) -> tuple[list[Any], int | None]:
    """Run ``fn`` on this process's blocks (one per input), with the lax collectives
    over torch.distributed groups; returns the per-device outputs (None for the
    other processes' devices) and this process's device index."""
    k = process_index(mesh)
    blocks = []
    for shards, layout in inputs:
        block = shards[k]
        assert block is not None
        blocks.append(replicate(block, mesh, layout.replicated_axes()))
    prev = spmd.enter(DistEnv(mesh, k))
    try:
        out = fn(*blocks)
    finally:
        spmd.enter(prev)
    outs: list[Any] = [None] * mesh.num_devices
    outs[k] = out
    return outs, k

