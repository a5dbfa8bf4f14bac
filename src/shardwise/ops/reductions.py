"""Reductions and scans on shardwise Tensors: sum, mean, amax, amin, norms, prod, var,
std, max, min, topk, sort, cumsum, softmax...

Invariants:
- Reductions over sharded dims give Partial results where the rule allows (sum, mean,
  amax, amin and the vector norms built on them) and gather the reduced dims otherwise
  (prod, var, std, median, argmax, max/min over a dim, topk, sort...); dims that are not
  reduced keep their sharding.
- An op with two results (max/min over a dim, topk, sort) makes one layout decision and
  one local call per block for both, so values and indices always share a layout.
- Scans and softmax (cumsum, cumprod, softmax, log_softmax) keep their dim whole and
  require it named (torch's implicit dim is deprecated).
- ``dtype=`` of sum, mean and the norms casts the input first, as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute as C
from shardwise.ops.conversions import to
from shardwise.ops.execute import apply
from shardwise.ops.registry import TensorMethod, fallback, reduce_dims, register
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import HANDLERS, Tensor

__all__: list[str] = []


@register(torch.sum, TensorMethod.sum)
def sum_(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    t = x if dtype is None else to(x, dtype)
    return C.sum(t, dim, keepdim)


@register(torch.mean, TensorMethod.mean)
def mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    t = x if dtype is None else to(x, dtype)
    return C.mean(t, dim, keepdim)


@register(torch.amax, TensorMethod.amax)
def amax(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return C.amax(x, dim if dim != () else None, keepdim)


@register(torch.amin, TensorMethod.amin)
def amin(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return C.amin(x, dim if dim != () else None, keepdim)


@register(torch.linalg.vector_norm, torch.norm, TensorMethod.norm)
def vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                dtype: Any = None, p: Any = None, **kwargs: Any) -> Any:
    if p is not None:
        ord = p
    if isinstance(ord, str):
        if ord != "fro":  # "nuc": only torch.norm takes a string p
            return fallback(torch.norm, (x,), {"p": ord, "dim": dim, "keepdim": keepdim,
                                              "dtype": dtype})
        ord = 2
    t = x if dtype is None else to(x, dtype)
    a = C.abs_(t)
    if ord == math.inf:
        return C.amax(a, dim, keepdim)
    if ord == -math.inf:
        return C.amin(a, dim, keepdim)
    if ord == 0:
        return C.sum(to(C.ne(t, 0), t.dtype), dim, keepdim)
    if ord == 1:
        return C.sum(a, dim, keepdim)
    if ord == 2:
        return C.sqrt(C.sum(C.mul(a, a), dim, keepdim))
    return C.pow(C.sum(C.pow(a, ord), dim, keepdim), 1.0 / ord)


# --- reductions that need their dims whole ------------------------------------------------
def _reduced(x: Any, dim: Any, fn: Any) -> tuple[int, ...]:
    """The dims ``fn(x, dim)`` reduces: an empty list reduces every dim, as in torch
    (except ``any``/``all``, for which it reduces none)."""
    if isinstance(dim, (list, tuple)) and not dim and fn not in (torch.any, torch.all):
        return tuple(range(x.ndim))
    return reduce_dims(x, dim)


def _full_reduce(fn: Any) -> Callable[..., Any]:
    """``torch.prod(x, dim)`` and kin: the reduced dims gathered, the others kept."""

    def handler(x: Any, dim: Any = None, keepdim: bool = False, *args: Any,
                **kwargs: Any) -> Any:
        dims = _reduced(x, dim, fn)
        if dim is None:  # over everything: torch's no-dim overload
            return apply("reduce_full", (x,), lambda s: fn(s, *args, **kwargs), dims,
                         False)
        return apply("reduce_full", (x,), lambda s: fn(s, dim, keepdim, *args, **kwargs),
                     dims, keepdim)

    return handler


for _name in ("prod", "any", "all", "argmax", "argmin", "logsumexp", "nansum"):
    _fn = getattr(torch, _name)
    register(_fn, getattr(TensorMethod, _name, None))(_full_reduce(_fn))


@register(torch.count_nonzero, TensorMethod.count_nonzero)
def count_nonzero(x: Any, dim: Any = None) -> Any:
    """``torch.count_nonzero(x, dim)`` (no ``keepdim``): the counted dims gathered."""
    dims = _reduced(x, dim, torch.count_nonzero)
    return apply("reduce_full", (x,), lambda s: torch.count_nonzero(s, dim), dims, False)


def _variance(fn: Any) -> Callable[..., Any]:
    """``torch.var``/``std`` in all of torch's spellings (``unbiased`` positional or
    keyword, ``correction=``), the reduced dims gathered."""

    def handler(x: Any, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        unbiased = kwargs.pop("unbiased", None)
        if args and isinstance(args[0], bool) and dim is not None and not isinstance(
                dim, bool):
            unbiased, args = args[0], args[1:]
        if isinstance(dim, bool):  # var(x, unbiased)
            unbiased, dim = dim, None
        keepdim = kwargs.pop("keepdim", args[0] if args else False)
        correction = kwargs.pop("correction", None)
        if unbiased is not None:
            correction = 1 if unbiased else 0
        if correction is None:
            correction = 1
        dims = _reduced(x, dim, fn)
        return apply("reduce_full", (x,), lambda s: fn(
            s, dims, correction=correction, keepdim=keepdim), dims, keepdim)

    return handler


for _fn in (torch.var, torch.std):
    register(_fn, getattr(TensorMethod, _fn.__name__))(_variance(_fn))


# --- values and indices --------------------------------------------------------------------
def _values_and_indices(op: str, x: Any, fn: Callable[[torch.Tensor], Any], *params: Any
                        ) -> tuple[Tensor, Tensor]:
    """An op whose local call returns (values, indices) (max/min over a dim, topk):
    one layout decision and one local call per block give both results."""
    indices: dict[int, torch.Tensor] = {}

    def values(block: torch.Tensor) -> torch.Tensor:
        v, i = fn(block)
        indices[id(v)] = i
        return v

    vals = apply(op, (x,), values, *params)
    if vals._whole is not None:  # ran once on the whole value
        return vals, Tensor.from_whole(indices[id(vals._whole)], vals.dist_layout, vals._open)
    idx = Tensor([None if v is None else indices[id(v)] for v in vals._shards],
                 vals.dist_layout, vals._shape, torch.int64, open_dims=vals._open)
    return vals, idx


def _with_indices(name: str, fn: Any, x: Any, dim: Any, keepdim: bool) -> Any:
    """``torch.<name>(x, dim)``'s values and indices as torch's named tuple
    (``torch.return_types.<name>``): the dim gathered, the others kept."""
    d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
    return getattr(torch.return_types, name)(_values_and_indices(
        "reduce_full", x, lambda s: fn(s, d, keepdim), (d,), keepdim))


def _extreme(name: str, fn: Any, values: Any) -> Callable[..., Any]:
    """``torch.max(x)`` (a Partial-friendly amax), ``torch.max(x, dim)`` (values and
    indices, the dim gathered) and ``torch.max(a, b)`` (elementwise maximum)."""

    def handler(x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
        if isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
            return HANDLERS[getattr(torch, "maximum" if name == "max" else "minimum")](
                x, dim)
        if dim is None:
            return values(x, None, False)
        return _with_indices(name, fn, x, dim, keepdim)

    return handler


def _median(name: str) -> Callable[..., Any]:
    """``torch.median(x)`` (one value, every dim gathered) and ``torch.median(x, dim)``
    (values and indices, as torch's named tuple; the dim gathered, the others kept)."""
    fn = getattr(torch, name)
    whole = _full_reduce(fn)

    def handler(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
        if dim is None:
            return whole(x)
        return _with_indices(name, fn, x, dim, keepdim)

    return handler


for _name in ("median", "nanmedian"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(_median(_name))


register(torch.max, TensorMethod.max)(_extreme("max", torch.max, C.amax))
register(torch.min, TensorMethod.min)(_extreme("min", torch.min, C.amin))


@register(torch.topk, TensorMethod.topk)
def topk(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "topk dim")
    return torch.return_types.topk(_values_and_indices(
        "topk", x, lambda s: torch.topk(s, k, d, largest, sorted), d, k))


@register(torch.sort, TensorMethod.sort)
def sort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "sort dim")
    return torch.return_types.sort(_values_and_indices(
        "sort", x, lambda s: torch.sort(s, dim=d, descending=descending, stable=stable), d))


@register(torch.argsort, TensorMethod.argsort)
def argsort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
    return sort(x, dim, descending, stable)[1]


# --- scans and softmax: one dim whole ------------------------------------------------------
def _along(name: str, fn: Any) -> Callable[..., Any]:
    """``torch.cumsum(x, dim)`` and kin: ``dim`` whole, the others kept."""

    def handler(x: Any, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dim is None:
            raise ShardingError(f"{name} needs dim= (torch's implicit dim is deprecated).")
        d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
        dtype = kwargs.pop("dtype", args[0] if args else None)
        kwargs.pop("_stacklevel", None)
        return apply(name, (x,), lambda s: fn(s, d, dtype=dtype), d)

    return handler


for _name in ("cumsum", "cumprod", "log_softmax", "softmax"):
    _fn = getattr(torch, _name)
    register(_fn, getattr(TensorMethod, _name), getattr(F, _name, None))(_along(_name, _fn))
