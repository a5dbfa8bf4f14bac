"""The process backend's one autograd family: a single Function, :class:`Collective`,
runs every collective of this backend (the planner's steps and shard_map's lax ops
alike), given a small immutable *spec* that holds the collective, its arguments and
its transpose. Each spec has a one-line contract:

    Narrow          narrow in forward,                 all_gather in backward
    AllGather       all_gather in forward,             narrow (per_device: reduce_scatter)
    AllToAll        all_to_all dim<-dim2 in forward,   the inverse all_to_all in backward
    AllReduce       all_reduce(op) in forward,         dG/dp_i (per_device: of the psum of g)
    ReduceScatter   reduce_scatter(op) in forward,     all_gather, then dG/dp_i, in backward
    Permute         send/recv in forward,              the inverse send/recv in backward
    Broadcast       broadcast in forward,              the owner's own gradient in backward
    MakePartial     identity / identity element,       identity (sum) or a sum over replicas
    Relabel         identity (psum prelude),           a sum over the replicas it splits
    Diverge         identity (compute prelude),        all_reduce(sum) over the replicas
    TakeFirst       identity in forward,               zeros in backward (off coordinate 0)

Two gradient conventions, one family. The Tensor runtime's: Replicated axes hold the
full gradient on every replica, Sharded axes their piece, Partial axes dL/dp_i (so its
gradients equal the simulated runtime's, the exact derivatives of the global value).
shard_map's: every device's block is its own value, so the gradient arriving at an
output that a collective replicated over its group is first summed over the group
(JAX's psum transpose). They differ only for the collectives whose output is
replicated over the group (all_gather, all_reduce): ``per_device=True`` picks
shard_map's.

Invariants:
- Specs are immutable values (the backend caches them per step); the transport and
  its agreement check are :mod:`shardwise.runtime.process.collectives`' alone.
- Forward-mode tangents apply ``spec.tangent``: the forward itself for linear specs.
- :func:`run` skips ``Function.apply`` when autograd records nothing (its cost buys
  nothing there).
- Every member of a group runs the same spec (also one that keeps its block), so the
  members' collectives, forward and backward, pair up.
- A tensor that a torch.func transform wrapped never enters a collective (:func:`run`
  raises before any message): c10d has no rule for the transforms' wrappers.
- A backward runs at the program position of its forward, marked as its backward
  (:func:`shardwise.runtime.position.backward_of`): its collectives carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd import Function

from shardwise.runtime.position import HERE, backward_of, current
from shardwise.runtime.process import collectives
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.placements import ReduceOp

__all__ = [
    "KEEP", "AllGather", "AllReduce", "AllToAll", "Broadcast", "Collective", "Diverge",
    "MakePartial", "Narrow", "Permute", "ReduceScatter", "Relabel", "Spec", "TakeFirst", "run",
]

_LINEAR = (ReduceOp.SUM, ReduceOp.AVG)


class Spec:
    """A collective (or local map) on this process's block, with its transpose."""

    __slots__ = ()

    @property
    def saves(self) -> bool:
        """Whether the transpose needs the forward's input and output."""
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        raise NotImplementedError

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return self.forward(t)  # linear maps: the tangent goes through the forward


class Collective(Function):
    """``spec.forward`` in forward, ``spec.transpose`` in backward, ``spec.tangent`` in jvp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: Spec) -> torch.Tensor:
        out = spec.forward(x)
        ctx.spec = spec
        ctx.at = current()  # the backward's program position
        if spec.saves:
            ctx.save_for_backward(x, out)
            ctx.fw = (x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        spec = ctx.spec
        x, out = ctx.saved_tensors if spec.saves else (None, None)
        before = HERE.site, HERE.op
        site, op = ctx.at
        HERE.site, HERE.op = backward_of(site), op
        try:
            return spec.transpose(g, x, out), None
        finally:
            HERE.site, HERE.op = before

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        spec = ctx.spec
        x, out = ctx.fw if spec.saves else (None, None)
        return spec.tangent(t, x, out)


def run(spec: Spec, x: torch.Tensor) -> torch.Tensor:
    """``spec`` on ``x``: through :class:`Collective` when autograd records (a
    grad-requiring input, or a forward-mode level), else its forward as a plain call.

    >>> run(TakeFirst(), torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        raise ShardingError(
            f"A tensor wrapped by a torch.func transform reached a collective ({spec!r}) "
            "of the multi-process runtime, which cannot run under the transform: the "
            "transformed function mixed a tensor of the transform (its input or a value "
            "made from it) with a shardwise.Tensor it does not transform (a module's "
            "parameter, a closure). Under torchrun, pass those shardwise Tensors through "
            "the transform too (torch.func.functional_call(model, params, args) with "
            "params transformed or in_dims=None), or use torch.autograd.grad / "
            "shardwise.grad / vjp / jvp.")
    if fwAD._current_level >= 0 or (x.requires_grad and torch.is_grad_enabled()):
        out: torch.Tensor = Collective.apply(x, spec)
        return out
    return spec.forward(x)


def _reduce_grad(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, grp: collectives.Group,
                 op: ReduceOp) -> torch.Tensor:
    """dL/dx for out = op over the group of x, given dL/dout = g (same on every member)."""
    if op is ReduceOp.SUM:
        return g
    if op is ReduceOp.AVG:
        return g / grp.size
    if op is ReduceOp.PROD:
        return g * out / x
    mask = (x == out).to(g.dtype)  # MAX/MIN: ties split the gradient evenly
    return g * mask / collectives.all_reduce(mask, grp, ReduceOp.SUM)


def _reduce_tangent(t: torch.Tensor, x: torch.Tensor, out: torch.Tensor, grp: collectives.Group,
                    op: ReduceOp) -> torch.Tensor:
    if op in _LINEAR:
        return collectives.all_reduce(t, grp, op)
    if op is ReduceOp.PROD:
        return out * collectives.all_reduce(t / x, grp, ReduceOp.SUM)
    mask = (x == out).to(t.dtype)
    return (collectives.all_reduce(t * mask, grp, ReduceOp.SUM)
            / collectives.all_reduce(mask, grp, ReduceOp.SUM))


# --- the collectives ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class Narrow(Spec):
    """narrow in forward, all_gather in backward."""

    dim: int
    start: int
    length: int
    grp: collectives.Group
    sizes: Sequence[int]
    tag: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(self.dim, self.start, self.length)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return collectives.all_gather(g, self.dim, self.grp, self.sizes,
                                      f"grad of slice {self.tag}")


@dataclass(frozen=True, slots=True, eq=False)
class AllGather(Spec):
    """all_gather in forward; narrow in backward (per_device: reduce_scatter(sum))."""

    dim: int
    grp: collectives.Group
    sizes: Sequence[int]
    tag: str
    per_device: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather(x, self.dim, self.grp, self.sizes, self.tag)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        grp, sizes = self.grp, self.sizes
        if self.per_device:  # = my piece of the psum of g
            return collectives.reduce_scatter(g, self.dim, grp, sizes, ReduceOp.SUM,
                                              f"grad of {self.tag}")
        return g.narrow(self.dim, sum(sizes[: grp.pos]), sizes[grp.pos])

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return collectives.all_gather(t, self.dim, self.grp, self.sizes, f"tangent of {self.tag}")


@dataclass(frozen=True, slots=True, eq=False)
class AllToAll(Spec):
    """all_to_all dim<-dim2 in forward, the inverse all_to_all in backward."""

    dim: int
    dim2: int
    grp: collectives.Group
    send: Sequence[int]
    recv: Sequence[int]
    tag: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_to_all(x, self.dim, self.dim2, self.grp, self.send, self.recv,
                                      self.tag)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return collectives.all_to_all(g, self.dim2, self.dim, self.grp, self.recv, self.send,
                                      f"grad of {self.tag}")

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return collectives.all_to_all(t, self.dim, self.dim2, self.grp, self.send, self.recv,
                                      f"tangent of {self.tag}")


@dataclass(frozen=True, slots=True, eq=False)
class AllReduce(Spec):
    """all_reduce(op) in forward; dG/dp_i (sum: identity) in backward, of the psum of
    the gradient when per_device."""

    grp: collectives.Group
    op: ReduceOp
    tag: str
    per_device: bool = False

    @property
    def saves(self) -> bool:
        return self.op not in _LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(x, self.grp, self.op, self.tag)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        if self.per_device:
            g = collectives.all_reduce(g, self.grp, ReduceOp.SUM, f"grad of {self.tag}")
        return _reduce_grad(g, x, out, self.grp, self.op)

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return _reduce_tangent(t, x, out, self.grp, self.op)


@dataclass(frozen=True, slots=True, eq=False)
class ReduceScatter(Spec):
    """reduce_scatter(op) in forward; all_gather, then dG/dp_i, in backward."""

    dim: int
    grp: collectives.Group
    sizes: Sequence[int]
    op: ReduceOp
    tag: str

    @property
    def saves(self) -> bool:
        return self.op is not ReduceOp.SUM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.reduce_scatter(x, self.dim, self.grp, self.sizes, self.op, self.tag)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        g_full = collectives.all_gather(g, self.dim, self.grp, self.sizes, f"grad of {self.tag}")
        if self.op is ReduceOp.SUM:
            return g_full
        out_full = collectives.all_gather(out, self.dim, self.grp, self.sizes,
                                          f"grad of {self.tag}")
        return _reduce_grad(g_full, x, out_full, self.grp, self.op)

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        if self.op in _LINEAR:
            return collectives.reduce_scatter(t, self.dim, self.grp, self.sizes, self.op,
                                              f"tangent of {self.tag}")
        full = collectives.all_reduce(x, self.grp, self.op)
        tan = _reduce_tangent(t, x, full, self.grp, self.op)
        return tan.narrow(self.dim, sum(self.sizes[: self.grp.pos]), self.sizes[self.grp.pos])


KEEP = -1  # Permute peers (KEEP, KEEP): the member is its own source (identity)


@dataclass(frozen=True, slots=True, eq=False)
class Permute(Spec):
    """send/recv in forward, the inverse send/recv in backward. ``shapes``: (this
    block's, the received block's) when they differ (shard_map's uneven blocks)."""

    send_to: int | None
    recv_from: int | None
    grp: collectives.Group
    tag: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recv = None if self.shapes is None else self.shapes[1]
        return _exchange(x, self.send_to, self.recv_from, recv, self.grp, self.tag)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        back = None if self.shapes is None else self.shapes[0]
        return _exchange(g, self.recv_from, self.send_to, back, self.grp, f"grad of {self.tag}")

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        recv = None if self.shapes is None else self.shapes[1]
        return _exchange(t, self.send_to, self.recv_from, recv, self.grp,
                         f"tangent of {self.tag}")


def _exchange(x: torch.Tensor, send_to: int | None, recv_from: int | None,
              recv_shape: tuple[int, ...] | None, grp: collectives.Group, tag: str) -> torch.Tensor:
    """One send/recv among ``grp``'s members; a member that keeps its block (KEEP)
    still takes part in the agreement."""
    if send_to == KEEP:
        if torch.compiler.is_compiling():  # every member takes part in the graph's exchange
            return x + collectives.traced_permute(None, None, None, x.new_empty(0), grp).sum()
        collectives.agree_permute(grp, x, tag)()
        return x.view_as(x)
    like = x if recv_shape is None or recv_shape == tuple(x.shape) else x.new_empty(recv_shape)
    return collectives.permute(x, send_to, recv_from, like, grp, tag)


@dataclass(frozen=True, slots=True, eq=False)
class Broadcast(Spec):
    """broadcast from the owner in forward; the owner's own gradient in backward
    (every process holds the same replicated gradient)."""

    src: int
    grp: collectives.Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.broadcast(x, self.src, self.grp)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return g

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        # Only the owner runs this Function (the others receive into a plain buffer), so
        # a tangent broadcast would have no partner on the others.
        raise ShardingError(
            "Forward-mode AD cannot read the global value of a tensor whose mesh leaves out "
            "some processes (its owner broadcasts it to the others, which hold no tangent). "
            "Use reverse mode (backward), or build the mesh over every process.")


# --- local maps whose transpose is a collective --------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class MakePartial(Spec):
    """identity (root) or the identity element (others) in forward; identity for sum,
    a sum over the replicas otherwise, in backward."""

    grp: collectives.Group
    op: ReduceOp
    root: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op in (ReduceOp.SUM, ReduceOp.PROD) and not self.root:
            return torch.full_like(x, 1 if self.op is ReduceOp.PROD else 0)
        return x.view_as(x)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        op = self.op
        if op is ReduceOp.SUM:
            return g
        if op is ReduceOp.AVG:
            return g * self.grp.size
        if op is ReduceOp.PROD and not self.root:
            g = torch.zeros_like(g)
        return collectives.all_reduce(g, self.grp, ReduceOp.SUM)

    def tangent(self, t: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        if self.op in (ReduceOp.SUM, ReduceOp.PROD) and not self.root:
            return torch.zeros_like(t)
        return t.view_as(t)


@dataclass(frozen=True, slots=True, eq=False)
class Relabel(Spec):
    """identity in forward (local values become partials); in backward the sum of the
    partials' gradients over the replicas that were split."""

    grp: collectives.Group | None
    op: ReduceOp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        grp = self.grp
        if grp is None or grp.size == 1:
            return g
        if self.op in _LINEAR:
            # Linear ops: dL/dp_i is the same on every replica, so their sum is a product.
            return g * grp.size
        return collectives.all_reduce(g, grp, ReduceOp.SUM)


@dataclass(frozen=True, slots=True, eq=False)
class Diverge(Spec):
    """identity in forward, all_reduce(sum) of the gradient over the replicas in backward
    (also shard_map's input boundary: a block every device of the group uses)."""

    grp: collectives.Group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return collectives.all_reduce(g, self.grp, ReduceOp.SUM)


@dataclass(frozen=True, slots=True, eq=False)
class TakeFirst(Spec):
    """identity in forward, zeros in backward (shard_map's output boundary: a replica
    off coordinate 0 of the axes it is replicated over does not count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    def transpose(self, g: torch.Tensor, x: Any, out: Any) -> torch.Tensor:
        return torch.zeros_like(g)
