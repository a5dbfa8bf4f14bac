"""The torch.distributed primitives as autograd Functions, each beside its gradient.

Every Function has a one-line contract. Gradient convention (see
``collectives.py``): Replicated axes hold the full gradient on every replica,
Sharded axes their piece, Partial axes dL/dp_i.

    Slice            narrow in forward,            all_gather in backward
    AllGather        all_gather in forward,        narrow in backward
    AllToAll         all_to_all in forward,        inverse all_to_all in backward
    AllReduce        all_reduce in forward,        dG/dp_i (sum: identity) in backward
    ReduceScatter    reduce_scatter in forward,    all_gather (then dG/dp_i) in backward
    MakePartial      identity/identity-element,    identity (sum) or sum over replicas
    Relabel          identity (psum prelude),      sum over the replicas it splits
    Diverge          identity (compute prelude),   sum over the replicas it splits
    Permute          send/recv in forward,         inverse send/recv in backward
    Broadcast        broadcast in forward,         the owner's gradient in backward
Forward-mode tangents apply the same (linear) forward to the tangent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from shardwise.runtime import collectives as D
from shardwise.sharding.placements import ReduceOp

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "Broadcast", "Diverge", "MakePartial", "Permute",
    "ReduceScatter", "Relabel", "Slice",
]


def _reduce_grad(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, grp: D.Group,
                 op: ReduceOp) -> torch.Tensor:
    """dL/dx for out = op over the group of x, given dL/dout = g (same on every member)."""
    if op is ReduceOp.SUM:
        return g
    if op is ReduceOp.AVG:
        return g / grp.size
    if op is ReduceOp.PROD:
        return g * out / x
    mask = (x == out).to(g.dtype)
    count = D.all_reduce(mask, grp, ReduceOp.SUM)
    return g * mask / count


def _reduce_tangent(t: torch.Tensor, x: torch.Tensor, out: torch.Tensor, grp: D.Group,
                    op: ReduceOp) -> torch.Tensor:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return D.all_reduce(t, grp, op)
    if op is ReduceOp.PROD:
        return out * D.all_reduce(t / x, grp, ReduceOp.SUM)
    mask = (x == out).to(t.dtype)
    return D.all_reduce(t * mask, grp, ReduceOp.SUM) / D.all_reduce(mask, grp, ReduceOp.SUM)


class Slice(Function):
    """narrow in forward, all_gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        dim, start, length, _grp, _sizes, _tag = spec
        ctx.spec = spec
        return x.narrow(dim, start, length)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        dim, _, _, grp, sizes, tag = ctx.spec
        return D.all_gather(g, dim, grp, sizes, f"grad of slice {tag}"), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        dim, start, length, _, _, _ = ctx.spec
        return t.narrow(dim, start, length)


class AllGather(Function):
    """all_gather in forward, narrow in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        ctx.spec = spec
        dim, grp, sizes, tag = spec
        return D.all_gather(x, dim, grp, sizes, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        dim, grp, sizes, _ = ctx.spec
        return g.narrow(dim, sum(sizes[: grp.pos]), sizes[grp.pos]), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        dim, grp, sizes, tag = ctx.spec
        return D.all_gather(t, dim, grp, sizes, f"tangent of {tag}")


class AllToAll(Function):
    """all_to_all dim->dim2 in forward, the inverse all_to_all in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        ctx.spec = spec
        dim, dim2, grp, send, recv, tag = spec
        return D.all_to_all(x, dim, dim2, grp, send, recv, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        dim, dim2, grp, send, recv, tag = ctx.spec
        return D.all_to_all(g, dim2, dim, grp, recv, send, f"grad of {tag}"), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        dim, dim2, grp, send, recv, tag = ctx.spec
        return D.all_to_all(t, dim, dim2, grp, send, recv, f"tangent of {tag}")


class AllReduce(Function):
    """all_reduce in forward; dG/dp_i (identity for sum) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        grp, op, tag = spec
        out = D.all_reduce(x, grp, op, tag)
        ctx.spec = spec
        ctx.save_for_backward(x, out)
        ctx.fw = (x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, out = ctx.saved_tensors
        grp, op, _ = ctx.spec
        return _reduce_grad(g, x, out, grp, op), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        grp, op, _ = ctx.spec
        x, out = ctx.fw
        return _reduce_tangent(t, x, out, grp, op)


class ReduceScatter(Function):
    """reduce_scatter in forward; all_gather, then dG/dp_i, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        dim, grp, sizes, op, tag = spec
        ctx.spec = spec
        out = D.reduce_scatter(x, dim, grp, sizes, op, tag)
        ctx.save_for_backward(x, out)
        ctx.fw = (x,)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, out = ctx.saved_tensors
        dim, grp, sizes, op, _ = ctx.spec
        g_full = D.all_gather(g, dim, grp, sizes)
        if op is ReduceOp.SUM:
            return g_full, None
        out_full = D.all_gather(out, dim, grp, sizes)
        return _reduce_grad(g_full, x, out_full, grp, op), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        dim, grp, sizes, op, _ = ctx.spec
        (x,) = ctx.fw
        full = D.all_reduce(x, grp, op)
        tan = _reduce_tangent(t, x, full, grp, op)
        start = sum(sizes[: grp.pos])
        return tan.narrow(dim, start, sizes[grp.pos])


class MakePartial(Function):
    """identity (root) or identity element (others) in forward; identity for sum,
    a sum over the replicas otherwise, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        _grp, op, root = spec
        ctx.spec = spec
        if op in (ReduceOp.SUM, ReduceOp.PROD) and not root:
            value = 1 if op is ReduceOp.PROD else 0
            return torch.full_like(x, value)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, op, root = ctx.spec
        if op is ReduceOp.SUM:
            return g, None
        if op is ReduceOp.AVG:
            return g * grp.size, None
        if op is ReduceOp.PROD:
            return D.all_reduce(g if root else torch.zeros_like(g), grp, ReduceOp.SUM), None
        return D.all_reduce(g, grp, ReduceOp.SUM), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        _grp, op, root = ctx.spec
        if op in (ReduceOp.SUM, ReduceOp.PROD) and not root:
            return torch.zeros_like(t)
        return t.view_as(t)


class Relabel(Function):
    """identity in forward (local values become partials); in backward the sum of
    the partials' gradients over the replicas that were split."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        ctx.spec = spec
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        grp, op = ctx.spec
        if grp is None or grp.size == 1:
            return g, None
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            # Linear ops: dL/dp_i is the same on every replica, so their sum is a product.
            return g * grp.size, None
        return D.all_reduce(g, grp, ReduceOp.SUM), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t.view_as(t)


class Permute(Function):
    """send/recv in forward, the inverse send/recv in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        ctx.spec = spec
        return _permute(x, spec, False)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _permute(g, ctx.spec, True), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return _permute(t, ctx.spec, False)


KEEP = -1  # Permute peers (KEEP, KEEP): the member is its own source (identity)


def _permute(x: torch.Tensor, spec: tuple[Any, ...], inverse: bool) -> torch.Tensor:
    """A member that keeps its block still takes part in the agreement."""
    send_to, recv_from, grp, tag = spec
    if inverse:
        send_to, recv_from, tag = recv_from, send_to, f"grad of {tag}"
    if send_to == KEEP:
        D.agree_permute(grp, x, tag)()
        return x.view_as(x)
    return D.permute(x, send_to, recv_from, x, grp, tag)


class Diverge(Function):
    """identity in forward, all_reduce(SUM) of the gradient over the replicas in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: D.Group) -> torch.Tensor:
        ctx.grp = grp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return D.all_reduce(g, ctx.grp, ReduceOp.SUM), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t.view_as(t)


class Broadcast(Function):
    """broadcast from the owner in forward; the owner's own gradient in backward
    (every process holds the same replicated gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        src, grp = spec
        return D.broadcast(x, src, grp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g, None
