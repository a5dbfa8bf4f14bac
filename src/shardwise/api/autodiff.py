"""Functional autodiff over shardwise Tensors: grad, value_and_grad, vjp, jvp.

Built on torch's autograd (reverse mode) and forward-mode AD. Every op of
shardwise is made of differentiable torch ops applied once per distinct
buffer, so derivatives are those of the single-device computation.
Gradients and tangents come back as Tensors in the layout of their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.sharding.errors import ShardingError, ShardingTypeError, check_items
from shardwise.sharding.placements import ReduceOp
from shardwise.tensors.tensor import Tensor, as_layout_of

__all__ = ["grad", "jvp", "value_and_grad", "vjp"]


def _argnums(argnums: int | Sequence[int], n: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in nums:
        if not -n <= i < n:
            raise ShardingError(f"argnums {argnums!r} is out of range for {n} arguments.")
    return tuple(i % n for i in nums)


def _fresh(t: Any, where: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise ShardingTypeError(
            f"{where} must be a shardwise.Tensor to differentiate with respect to it; got "
            f"{type(t).__name__}. Wrap it with shardwise.tensor(...)."
        )
    return t.map_blocks(lambda s: s.detach().requires_grad_(True))


def _scalar_roots(out: Any, what: str) -> Tensor:
    if not isinstance(out, Tensor):
        raise ShardingTypeError(f"{what}: the function must return a shardwise.Tensor, got "
                                f"{type(out).__name__}.")
    if out.shape:
        raise ShardingError(
            f"{what} needs a function with a scalar output; it returned {out!r}. "
            "Reduce it (e.g. .sum()) or use vjp."
        )
    return out.reduced()


def _grads_for(inputs: Sequence[Tensor], outs: Tensor, cot: Tensor | None,
               retain: bool) -> list[Tensor]:
    reps, roots = outs.unique_shards()
    seeds = ([torch.ones_like(r) for r in roots] if cot is None
             else [cot.shards[k] for k in reps])
    leaves: dict[int, torch.Tensor] = {}
    for t in inputs:
        for s in t.shards:
            if s is not None:
                leaves[id(s)] = s
    needed = [r for r in roots if r.requires_grad]
    if not needed:
        grads: Sequence[torch.Tensor | None] = [None] * len(leaves)
    else:
        grads = torch.autograd.grad(
            [r for r in roots if r.requires_grad],
            list(leaves.values()),
            [g for r, g in zip(roots, seeds) if r.requires_grad],
            retain_graph=retain, allow_unused=True,
        )
    by_id = dict(zip(leaves.keys(), grads))
    return [t.grads_of([by_id.get(id(b)) for b in t.held.buffers()]) for t in inputs]


def value_and_grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable[..., Any]:
    """``fn``'s value and its gradient w.r.t. the arguments ``argnums``.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> w = shardwise.tensor([1.0, 2.0, 3.0, 4.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> value, g = value_and_grad(lambda w: (w * w).sum())(w)
    >>> value.to_torch().item(), g.to_torch().tolist(), g.dist_layout == w.dist_layout
    (30.0, [2.0, 4.0, 6.0, 8.0], True)
    """
    _need_callable(fn, "value_and_grad")

    def wrapped(*args: Any) -> Any:
        nums = _argnums(argnums, len(args))
        inputs = list(args)
        for i in nums:
            inputs[i] = _fresh(args[i], f"argument {i}")
        with torch.enable_grad():
            res = fn(*inputs)
        out, aux = res if has_aux else (res, None)
        roots = _scalar_roots(out, "value_and_grad")
        gs = _grads_for([inputs[i] for i in nums], roots, None, retain=False)
        g: Any = gs[0] if isinstance(argnums, int) else tuple(gs)
        value = out.detach()
        return ((value, aux), g) if has_aux else (value, g)

    return wrapped


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of scalar-valued ``fn`` w.r.t. ``argnums``, in each input's layout.

    >>> w = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(DeviceMesh.cpu(2, "x"),
    ...                                                            [Sharded(0)]))
    >>> dw = grad(lambda w: (w * w).sum())(w)
    >>> dw.to_torch().tolist(), dw.dist_layout == w.dist_layout
    ([2.0, 4.0], True)
    """
    vg = value_and_grad(fn, argnums, has_aux)

    def wrapped(*args: Any) -> Any:
        (_value, aux), g = vg(*args) if has_aux else ((None, None), vg(*args)[1])
        return (g, aux) if has_aux else g

    return wrapped


def vjp(fn: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[[Any], tuple[Tensor, ...]]]:
    """``(fn(*primals), vjp_fn)``: ``vjp_fn(cotangent)`` gives one Tensor per primal.

    The cotangent may be a Tensor in any layout (or data) of the output's global shape.
    """
    _need_callable(fn, "vjp")
    inputs = [_fresh(p, f"primal {i}") for i, p in enumerate(primals)]
    with torch.enable_grad():
        out = fn(*inputs)
    if not isinstance(out, Tensor):
        raise ShardingTypeError(f"vjp: the function must return a shardwise.Tensor, got "
                                f"{type(out).__name__}.")
    roots = out.reduced()

    def vjp_fn(cotangent: Any) -> tuple[Tensor, ...]:
        cot = as_layout_of(cotangent, roots)
        return tuple(_grads_for(inputs, roots, cot, retain=True))

    return out.detach(), vjp_fn


def jvp(fn: Callable[..., Any], primals: Sequence[Any],
        tangents: Sequence[Any]) -> tuple[Tensor, Tensor]:
    """Forward mode: ``(fn(*primals), J @ tangents)``; the output tangent is in the
    output's layout. Each tangent may be a Tensor in any layout, or data, of its
    primal's global shape.
    """
    _need_callable(fn, "jvp")
    primals = check_items(primals, "jvp primals", "a sequence of inputs, e.g. (x,)")
    tangents = check_items(tangents, "jvp tangents", "a sequence of tangents, e.g. (t,)")
    if len(primals) != len(tangents):
        raise ShardingError(
            f"jvp got {len(primals)} primals and {len(tangents)} tangents: give one tangent "
            "per primal."
        )
    with fwAD.dual_level():
        duals = []
        for i, (p, tan) in enumerate(zip(primals, tangents)):
            if not isinstance(p, Tensor):
                raise ShardingTypeError(f"jvp primal {i} must be a shardwise.Tensor, got "
                                        f"{type(p).__name__}.")
            tl = as_layout_of(tan, _tangent_like(p))
            pairs = dict(zip((id(s) for s in p.shards), tl.shards))
            duals.append(p.map_blocks(
                lambda s, pairs=pairs: fwAD.make_dual(s.detach(), pairs[id(s)].detach())))
        out = fn(*duals)
        if not isinstance(out, Tensor):
            raise ShardingTypeError(f"jvp: the function must return a shardwise.Tensor, got "
                                    f"{type(out).__name__}.")
        primal_out = out.map_blocks(lambda s: fwAD.unpack_dual(s).primal.detach())
        tangent_out = out.map_blocks(lambda s: _tangent(s),
                                      _tangent_like(out).dist_layout)
    return primal_out, tangent_out


def _tangent_like(t: Tensor) -> Tensor:
    """``t`` relabelled with the layout its tangents take: a Partial(PROD) axis
    linearises to a sum (off-root factors are the identity 1, whose tangent is 0, not
    1), so its tangents are Partial(SUM); every other axis keeps ``t``'s layout."""
    partial = t.dist_layout.partial
    if ReduceOp.PROD not in partial:
        return t
    layout = t.dist_layout.with_partial(
        tuple(ReduceOp.SUM if op is ReduceOp.PROD else op for op in partial))
    return Tensor(t.shards, layout, t.shape)


def _tangent(s: torch.Tensor) -> torch.Tensor:
    tan = fwAD.unpack_dual(s).tangent
    return torch.zeros_like(s).detach() if tan is None else tan.detach()


def _need_callable(fn: Any, op: str) -> None:
    if not callable(fn):
        raise ShardingTypeError(f"{op} needs a function fn. Got {fn!r} ({type(fn).__name__}).")

