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

from shardwise.ops import compute
from shardwise.ops.conversions import to
from shardwise.ops.execute import apply, apply_outputs
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, reduce_dims, register
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import HANDLERS, Tensor

__all__: list[str] = []


@register(torch.sum, TensorMethod.sum)
def sum_(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    t = x if dtype is None else to(x, dtype)
    return compute.sum(t, dim, keepdim)


@register(torch.mean, TensorMethod.mean)
def mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    t = x if dtype is None else to(x, dtype)
    return compute.mean(t, dim, keepdim)


@register(torch.amax, TensorMethod.amax)
def amax(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return compute.amax(x, dim if dim != () else None, keepdim)


@register(torch.amin, TensorMethod.amin)
def amin(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return compute.amin(x, dim if dim != () else None, keepdim)


@register(torch.linalg.vector_norm, torch.norm, TensorMethod.norm)
def vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                dtype: Any = None, p: Any = None, **kwargs: Any) -> Any:
    if p is not None:
        ord = p
    if isinstance(ord, str):
        if ord != "fro":  # torch.norm(x, "nuc", dim): a matrix norm, its dims whole
            dims = reduce_dims(x, dim)
            return apply("reduce_full", (x,), lambda s: torch.norm(
                s, ord, dim, keepdim, dtype=dtype), dims, keepdim)
        ord = 2
    total, finish = norm_reduction(x, ord, dim, keepdim, dtype)
    return finish(total)


def norm_reduction(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False,
                   dtype: Any = None) -> tuple[Any, Callable[[Any], Any]]:
    """``vector_norm(x, ord, dim)`` as a reduction (sum of ``|x|**ord``, or amax/amin of
    ``|x|``), which stays Partial over the axes that shard the reduced dims, and the
    elementwise finish (the root) that gives the norm: ``_foreach_norm`` stacks the
    reductions of many tensors to reduce them in one collective."""
    t = x if dtype is None else to(x, dtype)
    a = compute.abs_(t)
    if ord == math.inf:
        return compute.amax(a, dim, keepdim), _same
    if ord == -math.inf:
        return compute.amin(a, dim, keepdim), _same
    if ord == 0:  # a count: torch's result still requires grad (no gradient flows)
        count = compute.with_zero_grad(to(compute.ne(t, 0), t.dtype), t, undefined=True)
        return compute.sum(count, dim, keepdim), _same
    if ord == 1:
        return compute.sum(a, dim, keepdim), _same
    if ord == 2:
        return compute.sum(compute.mul(a, a), dim, keepdim), compute.sqrt
    return (compute.sum(compute.pow(a, ord), dim, keepdim),
            lambda total: compute.pow(total, 1.0 / ord))


def _same(total: Any) -> Any:
    return total


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


def _variance_args(dim: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[Any, bool, Any]:
    """(dim, keepdim, correction) from torch's spellings of var/std/var_mean/std_mean:
    ``unbiased`` positional (``var(x, True)``, ``var(x, dim, True)``) or keyword, and
    ``correction=`` (default 1).

    >>> _variance_args(True, (), {}), _variance_args(1, (False, True), {})
    ((None, False, 1), (1, True, 0))
    """
    kwargs = dict(kwargs)
    unbiased = kwargs.pop("unbiased", None)
    if isinstance(dim, bool):  # var(x, unbiased)
        unbiased, dim = dim, None
    elif args and isinstance(args[0], bool) and dim is not None:
        unbiased, args = args[0], args[1:]
    keepdim = kwargs.pop("keepdim", args[0] if args else False)
    correction = kwargs.pop("correction", None)
    if unbiased is not None:
        correction = 1 if unbiased else 0
    return dim, keepdim, 1 if correction is None else correction


def _variance(fn: Any) -> Callable[..., Any]:
    """``torch.var``/``std`` in all of torch's spellings (``unbiased`` positional or
    keyword, ``correction=``), the reduced dims gathered."""

    def handler(x: Any, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        dim, keepdim, correction = _variance_args(dim, args, kwargs)
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
    return vals, vals.map_buffers(lambda v: indices[id(v)], dtype=torch.int64)


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


register(torch.max, TensorMethod.max)(_extreme("max", torch.max, compute.amax))
register(torch.min, TensorMethod.min)(_extreme("min", torch.min, compute.amin))


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
        n = x.ndim or 1
        # a dim in range, the common call, skips building the error's text
        d = dim % n if type(dim) is int and -n <= dim < n else normalize_dim(
            dim, n, f"{name} dim")
        if not (kwargs or args):  # no dtype: the local call passes none (torch's default)
            return apply(name, (x,), lambda s: fn(s, d), d)
        dtype = kwargs.get("dtype", args[0] if args else None)
        return apply(name, (x,), lambda s: fn(s, d, dtype=dtype), d)

    return handler


for _name in ("cumsum", "cumprod", "log_softmax", "softmax"):
    _fn = getattr(torch, _name)
    register(_fn, getattr(TensorMethod, _name), getattr(F, _name, None))(_along(_name, _fn))


# --- statistics with several outputs, quantiles, histograms (issue 20) ---------------------
def _all_if_empty(x: Any, dim: Any) -> tuple[int, ...]:
    """The reduced dims; ``dim=[]`` reduces every dim, as torch's var/nanmean do."""
    dims = reduce_dims(x, dim)
    return dims if dims or dim is None or x.ndim == 0 else tuple(range(x.ndim))


def _stat_mean(fn: Any, name: str) -> Callable[..., Any]:
    """``torch.var_mean``/``std_mean`` in torch's spellings: both results from one local
    call per block, the reduced dims whole (as ``var``/``std``)."""

    def handler(x: Any, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        dim, keepdim, correction = _variance_args(dim, args, kwargs)
        dims = _all_if_empty(x, dim)
        return apply_outputs("reduce_full", (x,), lambda s: fn(
            s, dims, correction=correction, keepdim=keepdim), dims, keepdim)

    handler.__name__ = name
    return handler


for _fn in (torch.var_mean, torch.std_mean):
    register(_fn)(_stat_mean(_fn, _fn.__name__))


@register(torch.aminmax, TensorMethod.aminmax)
def aminmax(x: Any, *, dim: Any = None, keepdim: bool = False) -> Any:
    dims = reduce_dims(x, dim)
    return torch.return_types.aminmax(apply_outputs(  # type: ignore[arg-type]
        "reduce_full", (x,), lambda s: torch.aminmax(s, dim=dim, keepdim=keepdim), dims,
        keepdim if dim is not None else False))


@register(torch.nanmean, TensorMethod.nanmean)
def nanmean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    dims = _all_if_empty(x, dim)
    return apply("reduce_full", (x,), lambda s: torch.nanmean(
        s, dims, keepdim, dtype=dtype), dims, keepdim)


def _kth(name: str) -> Callable[..., Any]:
    """``torch.kthvalue(x, k, dim)``/``torch.mode(x, dim)``: values and indices as torch's
    named tuple, the dim whole, the others kept."""
    fn = getattr(torch, name)

    def handler(x: Any, *args: Any, **kwargs: Any) -> Any:
        k: tuple[Any, ...] = ()
        if name == "kthvalue":
            k = (kwargs.pop("k") if "k" in kwargs else args[0],)
            args = args[1:]
        dim = kwargs.pop("dim", args[0] if args else -1)
        keepdim = kwargs.pop("keepdim", args[1] if len(args) > 1 else False)
        d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
        return getattr(torch.return_types, name)(apply_outputs(
            "reduce_full", (x,), lambda s: fn(s, *k, dim, keepdim), (d,) if x.ndim else (),
            keepdim))

    return handler


for _name in ("kthvalue", "mode"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(_kth(_name))


def _cumulative(name: str) -> Callable[..., Any]:
    """``torch.cummax``/``cummin``: values and indices along one whole dim."""
    fn = getattr(torch, name)

    def handler(x: Any, dim: int) -> Any:
        d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
        return getattr(torch.return_types, name)(apply_outputs(
            name, (x,), lambda s: fn(s, dim), (d,) if x.ndim else ()))

    return handler


for _name in ("cummax", "cummin"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(_cumulative(_name))


@register(torch.logcumsumexp, TensorMethod.logcumsumexp)
def logcumsumexp(x: Any, dim: int) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "logcumsumexp dim")
    return apply("logcumsumexp", (x,), lambda s: torch.logcumsumexp(s, dim),
                 (d,) if x.ndim else ())


@register(torch.msort, TensorMethod.msort)
def msort(x: Any) -> Any:
    return apply("msort", (x,), torch.msort, (0,) if x.ndim else ())


@register(F.softmin)
def softmin(x: Any, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
    if dim is None:
        raise ShardingError("softmin needs dim= (torch's implicit dim is deprecated).")
    d = normalize_dim(dim, max(x.ndim, 1), "softmin dim")
    return apply("softmin", (x,), lambda s: F.softmin(s, dim, dtype=dtype),
                 (d,) if x.ndim else ())


@register(torch.ops.aten._safe_softmax.default)
def safe_softmax(x: Any, dim: int, dtype: Any = None) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "_safe_softmax dim")
    return apply("safe_softmax", (x,), lambda s: torch.ops.aten._safe_softmax.default(
        s, dim, dtype), (d,) if x.ndim else ())


@register(torch._softmax_backward_data, torch.ops.aten._softmax_backward_data,
          torch.ops.aten._softmax_backward_data.default)
def softmax_backward_data(grad: Any, out: Any, dim: int, input_dtype: Any) -> Any:
    d = normalize_dim(dim, max(grad.ndim, 1), "_softmax_backward_data dim")
    shape = tuple(grad.shape)
    return apply("aligned", on_mesh([grad, out]), lambda g, o: torch._softmax_backward_data(
        g, o, dim, input_dtype), (d,) if shape else (), tuple(
        ("n", s) if q == d else ("b", q) for q, s in enumerate(shape)))


@register(torch.masked.softmin)
def masked_softmin(x: Any, dim: int, *, dtype: Any = None, mask: Any = None) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "masked.softmin dim")
    if mask is None:
        return apply("softmin", (x,), lambda s: torch.masked.softmin(s, dim, dtype=dtype),
                     (d,) if x.ndim else ())
    if tuple(mask.shape) != tuple(x.shape):  # a broadcast mask: fall back (exact)
        return fallback(torch.masked.softmin, (x, dim), {"dtype": dtype, "mask": mask})
    return apply("aligned", on_mesh([x, mask]), lambda s, m: torch.masked.softmin(
        s, dim, dtype=dtype, mask=m), (d,), tuple(
        ("n", s) if q == d else ("b", q) for q, s in enumerate(x.shape)))


@register(F.glu)
def glu(x: Any, dim: int = -1) -> Any:
    if x.ndim == 0 or x.shape[dim] % 2:
        return fallback(F.glu, (x, dim), {})  # torch's error
    d = normalize_dim(dim, x.ndim, "glu dim")
    return apply("glu", (x,), lambda s: F.glu(s, dim), d, x.shape[d] // 2)


def _quantile_of(name: str) -> Callable[..., Any]:
    """``torch.quantile(x, q, dim)``: ``dim`` whole (every dim when None), a 1-D ``q``
    whole, the other dims kept."""
    fn = getattr(torch, name)

    def handler(x: Any, q: Any, dim: Any = None, keepdim: bool = False, *,
                interpolation: str = "linear", out: Any = None) -> Any:
        if out is not None or (isinstance(q, torch.Tensor) and q.ndim > 1):
            return fallback(fn, (x, q, dim, keepdim), {"interpolation": interpolation,
                                                       "out": out})
        d = None if dim is None else normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
        d = None if x.ndim == 0 else d
        nq = q.shape[0] if isinstance(q, torch.Tensor) and q.ndim == 1 else None
        empty = x.numel() == 0  # then torch's own error; an empty block is no error

        def local(s: torch.Tensor, *rest: Any) -> torch.Tensor:
            *qs, shape = rest
            if s.numel() == 0 and not empty:  # torch refuses any empty input: a block
                # of no rows has no quantiles (kept on the graph, for autograd)
                return s.sum().mul(0).expand(shape).clone()
            return fn(s, qs[0] if qs else q, dim, keepdim, interpolation=interpolation)

        ops = on_mesh([x, q]) if isinstance(q, torch.Tensor) else [x]
        return apply("quantile", ops, local, d, keepdim, nq, shaped=True)

    return handler


for _name in ("quantile", "nanquantile"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(_quantile_of(_name))


@register(torch.histc, TensorMethod.histc)
def histc(x: Any, bins: int = 100, min: Any = 0, max: Any = 0, *, out: Any = None) -> Any:
    if out is not None:
        return fallback(torch.histc, (x, bins, min, max), {"out": out})
    # a range from the data (min == max) needs every element: the dims whole
    return apply("histc", (x,), lambda s: torch.histc(s, bins, min, max), bins, min == max)
