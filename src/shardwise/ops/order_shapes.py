"""The sequence-order rules of ops that move, cut or join dims (reshapes, transposes,
indexing, chunks, joins, expands): an order follows its dim, or its sequence factor,
where the op keeps that whole; anything else answers :data:`NATURAL`.

Invariants:
- Output dims are read from torch itself on meta values (shapes, or strides for
  transposes), never re-derived per op.
- A reshape keeps an order only where one output dim holds the whole sequence factor
  (merged dims add an ``inner`` count or an outer one); indexing keeps it only where
  every ordered dim is taken whole (``:``); chunks, joins and repeats only along other
  dims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops.order_calls import (
    NATURAL,
    Orders,
    aligned,
    funcs,
    mesh_of,
    ordered,
    orders_of,
    run_stripped,
    tree_map,
)
from shardwise.ops.registry import TensorMethod
from shardwise.tensors.tensor import Tensor

__all__ = ["SHAPE_RULES"]


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Reshapes: each order follows its sequence factor to the output dim that holds
    it whole (``(B, T) -> B*T`` keeps it with a larger outer count, ``T*D`` with
    ``inner = D``); a reshape that splits the sequence factor is not exact."""
    x = args[0]
    if not isinstance(x, Tensor) or not orders_of(x) or ordered(args[1:], kwargs):
        return NATURAL
    out_shape = _meta_call(func, args, kwargs)
    if out_shape is None:
        return NATURAL
    want: Orders = {}
    for d, o in orders_of(x).items():
        seq_stride = o.inner * math.prod(x.shape[d + 1:])
        e = _holding(out_shape, seq_stride, o.length)
        if e is None:
            return NATURAL
        want[e] = o.at(e, seq_stride // math.prod(out_shape[e + 1:]))
    return run_stripped(func, args, kwargs, lambda r, k: want)


def _holding(shape: Sequence[int], stride: int, length: int) -> int | None:
    """The dim of contiguous ``shape`` that holds the flat range ``[stride, stride *
    length)`` factor whole, or None."""
    for e in range(len(shape)):
        below = math.prod(shape[e + 1:])
        if stride % below == 0 and (below * shape[e]) % (stride * length) == 0:
            return e
    return None


def _permuted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Transposes and permutes: each order follows its dim (read from the strides of a
    meta value whose dims have distinct strides)."""
    x = args[0]
    if not isinstance(x, Tensor) or ordered(args[1:], kwargs):
        return NATURAL
    strides = tuple(2 ** d for d in range(x.ndim))
    meta = torch.empty_strided(tuple(x.shape), strides, dtype=x.dtype, device="meta")
    try:
        out = func(meta, *args[1:], **kwargs)
    except Exception:  # torch's error, raised by the op on natural values
        return NATURAL
    source = {s: d for d, s in enumerate(strides)}
    want = {e: o.at(e) for e, s in enumerate(out.stride()) if (o := orders_of(x).get(
        source.get(s, -1))) is not None}
    return run_stripped(func, args, kwargs, lambda r, k: want)


def _meta_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty(tuple(a.shape), dtype=a.dtype, device="meta")
        return a
    try:
        out = func(*tree_map((args, kwargs), meta)[0], **tree_map(kwargs, meta))
    except Exception:  # torch's error, raised again by the op on natural values
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def _dim_arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, ndim: int,
             default: int | None = 0) -> int | None:
    dim = args[at] if len(args) > at else kwargs.get("dim", default)
    return dim % ndim if isinstance(dim, int) and not isinstance(dim, bool) and ndim else None


def _pieces(at: int, drops: bool = False, default: int | None = 0) -> Callable[..., Any]:
    """``chunk``/``split``/``unbind``/``repeat_interleave`` along a dim (argument
    ``at``) that is not ordered: every piece keeps the orders (``unbind`` drops its
    dim); no dim (``repeat_interleave``'s flattening) is not exact."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        dim = _dim_arg(args, kwargs, at, x.ndim, default)
        if dim is None or dim in orders_of(x) or ordered(args[1:], kwargs):
            return NATURAL
        want = {d - (drops and d > dim): o.at(d - (drops and d > dim))
                for d, o in orders_of(x).items()}
        return run_stripped(func, args, kwargs, lambda r, k: want)

    return rule


def _join(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cat``/``stack`` along a dim that is not ordered: the operands aligned to the
    first ordered one's orders (``stack`` adds its dim)."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or ordered(args[1:], {
            k: v for k, v in kwargs.items() if k != "tensors"}):
        return NATURAL
    nd = tensors[0].ndim
    stack = "stack" in getattr(func, "__name__", "")
    dim = _dim_arg(args, kwargs, 1, nd + stack)
    want: Orders = {}
    for t in tensors:
        for d, o in orders_of(t).items():
            want.setdefault(d, o)
    if dim is None or any(t.ndim != nd for t in tensors) or (not stack and dim in want):
        return NATURAL
    mesh = mesh_of(tensors, {})
    fixed = [aligned(t, want, 0, mesh) for t in tensors]
    if any(t is NATURAL for t in fixed):
        return NATURAL
    out = {d + (stack and d >= dim): o.at(d + (stack and d >= dim)) for d, o in want.items()}
    rest = {k: v for k, v in kwargs.items() if k != "tensors"}
    return run_stripped(func, (type(tensors)(fixed), *args[1:]), rest, lambda r, k: out)


def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[...]`` with ints, slices, ``None`` and ``...`` that take every ordered dim
    whole (RoPE's halves of the last dim, a head's columns): the orders follow their
    dims; any other index of an ordered dim is not exact."""
    x, index = args[0], args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if kwargs or not isinstance(x, Tensor) or not all(
            i is None or i is Ellipsis or isinstance(i, slice) or (
                isinstance(i, int) and not isinstance(i, bool)) for i in items):
        return NATURAL
    named = sum(1 for i in items if i is not None and i is not Ellipsis)
    if named > x.ndim or sum(1 for i in items if i is Ellipsis) > 1:
        return NATURAL
    marks, want = orders_of(x), {}
    d = e = 0
    for i in items:
        if i is Ellipsis:
            for _ in range(x.ndim - named):
                if d in marks:
                    want[e] = marks[d].at(e)
                d, e = d + 1, e + 1
        elif i is None:
            e += 1
        elif isinstance(i, int):
            if d in marks:
                return NATURAL
            d += 1
        else:
            if d in marks and i.indices(x.shape[d]) != (0, x.shape[d], 1):
                return NATURAL
            if d in marks:
                want[e] = marks[d].at(e)
            d, e = d + 1, e + 1
    for rest in range(d, x.ndim):
        if rest in marks:
            want[e + rest - d] = marks[rest].at(e + rest - d)
    return run_stripped(func, args, kwargs, lambda r, k: want)


def _expand(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``expand``/``broadcast_to``: new dims lead, the ordered dims keep their size."""
    x = args[0]
    out_shape = _meta_call(func, args, kwargs)
    if out_shape is None or not isinstance(x, Tensor) or ordered(args[1:], kwargs):
        return NATURAL
    lead = len(out_shape) - x.ndim
    want = {d + lead: o.at(d + lead) for d, o in orders_of(x).items()}
    if any(out_shape[e] != x.shape[e - lead] for e in want):
        return NATURAL
    return run_stripped(func, args, kwargs, lambda r, k: want)


# --- the table ------------------------------------------------------------------------------
#: torch function -> its rule, for the ops of shapes (merged into ``order_rules.RULES``)
SHAPE_RULES: dict[Any, Callable[..., Any]] = {}
for _f in funcs("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
                "reshape_as"):
    SHAPE_RULES[_f] = _view
for _f in funcs("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"):
    SHAPE_RULES[_f] = _permuted
for _f in funcs("chunk", "split", "tensor_split"):
    SHAPE_RULES[_f] = _pieces(2)
for _f in funcs("repeat_interleave"):
    SHAPE_RULES[_f] = _pieces(2, default=None)
for _f in funcs("expand", "broadcast_to"):
    SHAPE_RULES[_f] = _expand
for _f in funcs("unbind"):
    SHAPE_RULES[_f] = _pieces(1, drops=True)
for _f in funcs("cat", "concat", "concatenate", "stack"):
    SHAPE_RULES[_f] = _join
SHAPE_RULES[TensorMethod.__getitem__] = _getitem
