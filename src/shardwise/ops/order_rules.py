"""The whitelist of ops that keep sequence orders (``Layout.orders``), as data: torch
function -> rule (:data:`RULES`, read by :func:`shardwise.ops.orders.dispatch`); here
the rules of values (elementwise, linear, reductions, losses), in
:mod:`shardwise.ops.order_shapes` those of shapes.

A rule gets the call with at least one ordered operand and returns its result, or
:data:`NATURAL` where keeping the orders is not exact (the dispatch then brings the
operands to natural order). It runs the registry's handler once on stripped operands
(:func:`~shardwise.ops.order_calls.run_stripped`: the held values, in the held
coordinates) and relabels the results with the orders it knows to hold.

Invariants:
- Exact only: a rule keeps an order where the op on the held (permuted) values gives
  the permuted result: elementwise ops with every operand aligned first (a
  natural-order operand that spans an ordered dim is reordered: local where it is
  replicated), ops that leave the ordered dims whole (linear rows, embeddings, norms
  over other dims, softmax, matmul rows and columns, contractions over one shared
  order), views that keep the sequence factor whole (the order follows it, with an
  ``inner`` count where dims merged), transposes, chunks and joins along other dims,
  reductions (over an ordered dim the order goes), losses, autograd's entries (they
  lay seeds and gradients out with their tensors' orders).
- A rule never writes into an operand it reordered: a write in place keeps its
  target's orders or answers :data:`NATURAL` (then refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.elementwise import LINEAR, NONLINEAR, OPERATORS
from shardwise.ops.order_calls import (
    NATURAL,
    Orders,
    aligned,
    funcs,
    mesh_of,
    ordered,
    orders_of,
    run_stripped,
    writes,
)
from shardwise.ops.order_shapes import SHAPE_RULES
from shardwise.tensors.tensor import route

__all__ = ["RULES"]


def _elementwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Broadcasting elementwise ops: every operand aligned to the output's orders (the
    first ordered operand's win); a write in place keeps its target's."""
    values = (*args, *kwargs.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    nd = max(t.ndim for t in tensors)
    want: Orders = {}
    for t in tensors:
        for d, o in orders_of(t).items():
            want.setdefault(d + nd - t.ndim, o.at(d + nd - t.ndim))
    mesh = mesh_of(args, kwargs)
    in_place = writes(func)
    fixed = []
    for i, a in enumerate(values):
        if isinstance(a, torch.Tensor):
            b = aligned(a, want, nd - a.ndim, mesh)
            if b is NATURAL or (i == 0 and in_place and b is not a):
                return NATURAL
            a = b
        fixed.append(a)
    return run_stripped(func, fixed[:len(args)], dict(zip(kwargs, fixed[len(args):])),
                lambda r, k: {d - (nd - r.ndim): o.at(d - (nd - r.ndim))
                              for d, o in want.items() if d - (nd - r.ndim) >= 0})


def _lead(last: int) -> Callable[..., Any]:
    """Ops that keep every dim of operand 0 but its last ``last`` (``F.linear``,
    ``layer_norm``...) whole, with every other operand in natural order."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        n = len(args[1]) if last < 0 and len(args) > 1 else last  # layer_norm's shape
        if ordered(args[1:], kwargs) or any(d >= x.ndim - n for d in orders_of(x)):
            return NATURAL
        return run_stripped(func, args, kwargs, lambda r, k: orders_of(x) if k == 0 else {})

    return rule


def _keeps(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops whose result keeps operand 0's dims in place, each permuted with it (softmax
    permutes with its dim; an embedding's ids keep their dims), the others natural."""
    if ordered(args[1:], kwargs):
        return NATURAL
    return run_stripped(func, args, kwargs, lambda r, k: orders_of(args[0]))


def _reduction(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Sums, means, extremes: order-invariant; an order over a reduced dim goes."""
    x = args[0]
    if ordered(args[1:], kwargs):
        return NATURAL
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return run_stripped(func, args, kwargs, lambda r, k: {})
    if isinstance(dim, int):
        dims = {dim % x.ndim}
    elif isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        dims = {d % x.ndim for d in dim}
    else:
        return NATURAL
    want: Orders = {}
    for d, o in orders_of(x).items():
        if d not in dims:
            e = d if keep is True else d - sum(1 for r in dims if r < d)
            want[e] = o.at(e)
    return run_stripped(func, args, kwargs, lambda r, k: want)


def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a @ b`` (both at least 2-d): a's rows and b's columns keep their orders, batch
    dims align as elementwise ops do, the contracted dims (a's last, b's rows) are
    summed over, which any order both share leaves exact."""
    if kwargs or len(args) != 2 or not all(isinstance(t, torch.Tensor) and t.ndim >= 2
                                            for t in args):
        return NATURAL
    a, b = args
    nd = max(a.ndim, b.ndim)
    oa, ob = orders_of(a), orders_of(b)
    k_a, k_b = oa.get(a.ndim - 1), ob.get(b.ndim - 2)
    if (k_a.at(0) if k_a else None) != (k_b.at(0) if k_b else None):
        return NATURAL
    want: Orders = {}
    for t, marks in ((a, oa), (b, ob)):
        for d, o in marks.items():
            if d < t.ndim - 2:
                e = d + nd - t.ndim
                if want.setdefault(e, o.at(e)) != o.at(e):
                    return NATURAL
    for e, o in want.items():  # a batch dim ordered in one operand spans it in both
        for t, marks in ((a, oa), (b, ob)):
            d = e - (nd - t.ndim)
            if 0 <= d < t.ndim - 2 and t.shape[d] != 1 and marks.get(d) != o.at(d):
                return NATURAL
    if a.ndim - 2 in oa:
        want[nd - 2] = oa[a.ndim - 2].at(nd - 2)
    if b.ndim - 1 in ob:
        want[nd - 1] = ob[b.ndim - 1].at(nd - 1)
    return run_stripped(func, args, kwargs, lambda r, k: want)


def _cross_entropy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The loss per target position: over ordered positions the same mean, the
    per-position losses (``reduction='none'``) in the target's order. The class dim
    stays natural."""
    if len(args) < 2 or "target" in kwargs:
        return NATURAL
    x, target = args[0], args[1]
    soft = target.ndim == x.ndim
    if x.ndim < 2 or 1 in orders_of(x) or (soft and 1 in orders_of(target)) or ordered(
            args[2:], kwargs):
        return NATURAL
    pairs = [(d, d if soft or d == 0 else d - 1) for d in range(x.ndim) if d != 1]
    want: Orders = {}  # over the target's dims
    for xd, td in pairs:
        ox, ot = orders_of(x).get(xd), orders_of(target).get(td)
        if ox is not None and ot is not None and ox.at(td) != ot:
            return NATURAL
        if ox is not None or ot is not None:
            want[td] = ot if ot is not None else ox.at(td)  # type: ignore[union-attr]
    mesh = mesh_of(args, kwargs)
    x2 = aligned(x, {xd: want[td].at(xd) for xd, td in pairs if td in want}, 0, mesh)
    t2 = aligned(target, want, 0, mesh)
    if x2 is NATURAL or t2 is NATURAL:
        return NATURAL
    reduction = args[6] if len(args) > 6 else kwargs.get("reduction", "mean")
    return run_stripped(func, (x2, t2, *args[2:]), kwargs,
                lambda r, k: want if reduction == "none" else {})


def _order_aware(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Handlers that read each Tensor with its own layout, orders included (autograd's
    entries: a seed is laid out as its output, a gradient as its input)."""
    return route(func, args, kwargs)


# --- the whitelist -----------------------------------------------------------------------------
_ELEMENTWISE = [*LINEAR, *NONLINEAR, *(f"{n}_" for n in (*LINEAR, *NONLINEAR)),
                *OPERATORS, *(f"__i{d[2:]}" for d in OPERATORS if not d.startswith("__r")),
                "clone", "detach", "contiguous", "to", "float", "double", "half", "bfloat16",
                "int", "long", "bool", "type_as", "dropout", "masked_fill_", "zero_",
                "copy_", "fill_", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                "binary_cross_entropy", "binary_cross_entropy_with_logits"]
#: torch function -> its rule: the whitelist (the ops of shapes from ``order_shapes``)
RULES: dict[Any, Callable[..., Any]] = dict(SHAPE_RULES)
for _f in funcs(*_ELEMENTWISE):
    RULES[_f] = _elementwise
for _f in funcs("sum", "mean", "amax", "amin", "nansum", "nanmean", "logsumexp", "all",
                "any"):
    RULES[_f] = _reduction
for _f in funcs("softmax", "log_softmax"):
    RULES[_f] = _keeps
for _f in funcs("matmul", "mm", "bmm", "__matmul__"):
    RULES[_f] = _matmul
RULES[torch.autograd.backward] = RULES[torch.autograd.grad] = _order_aware
RULES[F.linear] = _lead(1)
RULES[F.layer_norm] = _lead(-1)
RULES[F.rms_norm] = _lead(-1)
RULES[F.embedding] = _keeps
RULES[F.cross_entropy] = _cross_entropy
