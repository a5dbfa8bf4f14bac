"""torch's view, shape and reduction ops on shardwise Tensors (installed by
:mod:`shardwise.ops.torch_api`).

Invariants:
- Views keep each dim's sharding where the dim survives; merged, split or indexed
  dims are gathered first (the reshape/getitem rules).
- Reductions over sharded dims give Partial results where the rule allows (sum,
  mean, amax, amin, norms) and gather the reduced dims otherwise (var, prod, topk...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute as C
from shardwise.ops.execute import apply
from shardwise.ops.registry import (
    TensorMethod,
    _fallback,
    _on_mesh,
    _shape_args,
    _zeros,
    register,
)
from shardwise.ops.torch_elementwise import _to
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import HANDLERS, Tensor

__all__ = ["install"]


def _install_views() -> None:
    @register(TensorMethod.view, TensorMethod.reshape, torch.reshape)
    def reshape(x: Any, *shape: Any) -> Any:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise ShardingError("x.view(dtype) reinterprets bytes; use x.to(dtype) on a "
                                "shardwise.Tensor.")
        return C.reshape(x, _shape_args(shape))

    @register(TensorMethod.view_as, TensorMethod.reshape_as)
    def view_as(x: Any, other: Any) -> Any:
        return C.reshape(x, tuple(other.shape))

    @register(TensorMethod.permute, torch.permute)
    def permute(x: Any, *dims: Any) -> Any:
        return C.permute(x, _shape_args(dims))

    @register(TensorMethod.transpose, torch.transpose, TensorMethod.swapaxes, torch.swapaxes,
              TensorMethod.swapdims, torch.swapdims)
    def transpose(x: Any, dim0: int, dim1: int) -> Any:
        return C.transpose(x, dim0, dim1)

    @register(TensorMethod.t, torch.t)
    def t(x: Any) -> Any:
        return C.transpose(x, 0, 1) if x.ndim == 2 else x

    getter = "__get__"  # torch's property getters (not visible to mypy on the stubs)
    register(getattr(TensorMethod.T, getter))(
        lambda x: C.permute(x, tuple(reversed(range(x.ndim)))) if x.ndim != 0 else x)
    register(getattr(TensorMethod.mT, getter))(lambda x: C.transpose(x, -2, -1))

    @register(TensorMethod.flatten, torch.flatten)
    def flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
        if x.ndim == 0:
            return C.reshape(x, (1,))
        a = normalize_dim(start_dim, x.ndim, "flatten start_dim")
        b = normalize_dim(end_dim, x.ndim, "flatten end_dim")
        shape = (*x.shape[:a], math.prod(x.shape[a:b + 1]), *x.shape[b + 1:])
        return C.reshape(x, shape)

    @register(TensorMethod.unflatten, torch.unflatten)
    def unflatten(x: Any, dim: int, sizes: Sequence[int]) -> Any:
        d = normalize_dim(dim, x.ndim, "unflatten dim")
        sizes = list(sizes)
        if -1 in sizes:
            rest = math.prod(s for s in sizes if s != -1)
            sizes[sizes.index(-1)] = x.shape[d] // rest
        return C.reshape(x, (*x.shape[:d], *sizes, *x.shape[d + 1:]))

    @register(TensorMethod.squeeze, torch.squeeze)
    def squeeze(x: Any, dim: Any = None) -> Any:
        if dim is None:
            dims = {d for d, n in enumerate(x.shape) if n == 1}
        else:
            ds = dim if isinstance(dim, (list, tuple)) else (dim,)
            dims = {normalize_dim(d, max(x.ndim, 1), "squeeze dim") for d in ds}
            dims = {d for d in dims if x.ndim and x.shape[d] == 1}
        return C.reshape(x, tuple(n for d, n in enumerate(x.shape) if d not in dims))

    @register(TensorMethod.unsqueeze, torch.unsqueeze)
    def unsqueeze(x: Any, dim: int) -> Any:
        d = normalize_dim(dim, x.ndim + 1, "unsqueeze dim")
        return C.reshape(x, (*x.shape[:d], 1, *x.shape[d:]))

    @register(TensorMethod.expand)
    def expand(x: Any, *sizes: Any) -> Any:
        shape = _shape_args(sizes)
        lead = len(shape) - x.ndim
        full = tuple(x.shape[d - lead] if s == -1 else s for d, s in enumerate(shape))
        if full == tuple(x.shape):
            return x
        return C.add(x, _zeros(x, full))

    @register(TensorMethod.expand_as)
    def expand_as(x: Any, other: Any) -> Any:
        return expand(x, tuple(other.shape))

    @register(torch.cat, torch.concat, torch.concatenate)
    def cat(tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
        return C.cat(_on_mesh(tensors), dim)

    @register(torch.stack)
    def stack(tensors: Sequence[Any], dim: int = 0) -> Any:
        ts = _on_mesh(tensors)
        d = normalize_dim(dim, ts[0].ndim + 1, "stack dim")
        return C.cat([unsqueeze(t, d) for t in ts], d)

    @register(TensorMethod.narrow, torch.narrow)
    def narrow(x: Any, dim: int, start: int, length: int) -> Any:
        d = normalize_dim(dim, x.ndim, "narrow dim")
        return C.getitem(x, (slice(None),) * d + (slice(start, start + length),))

    @register(TensorMethod.select, torch.select)
    def select(x: Any, dim: int, index: int) -> Any:
        d = normalize_dim(dim, x.ndim, "select dim")
        return C.getitem(x, (slice(None),) * d + (index,))

    @register(TensorMethod.split, torch.split)
    def split(x: Any, split_size: Any, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "split dim")
        n = x.shape[d]
        sizes = ([split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
                 if isinstance(split_size, int) else list(split_size))
        out, start = [], 0
        for s in sizes:
            out.append(narrow(x, d, start, s))
            start += s
        return tuple(out)

    @register(TensorMethod.chunk, torch.chunk)
    def chunk(x: Any, chunks: int, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "chunk dim")
        return split(x, -(-x.shape[d] // chunks) if x.shape[d] else 1, d)

    @register(TensorMethod.unbind, torch.unbind)
    def unbind(x: Any, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "unbind dim")
        return tuple(select(x, d, i) for i in range(x.shape[d]))

    @register(TensorMethod.__iter__)
    def iterate(x: Any) -> Any:
        if x.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(unbind(x, 0))

    @register(TensorMethod.__getitem__)
    def getitem(x: Any, index: Any) -> Any:
        if C.is_basic_index(index):
            return C.getitem(x, index)
        picked = _one_integer_index(x, index)
        if picked is not None:  # x[ids], x[:, ids]: an index_select, never a gather of x
            return torch.index_select(x, *picked)
        return _fallback(TensorMethod.__getitem__, (x, index), {})

    for name in ("tril", "triu"):
        fn = getattr(torch, name)

        def handler(x: Any, diagonal: int = 0, _fn: Any = fn) -> Any:
            # the last two dims whole (the diagonal depends on global positions)
            return apply("normalize", (x,), lambda s: _fn(s, diagonal), 2)

        register(fn, getattr(TensorMethod, name))(handler)


def _one_integer_index(x: Any, index: Any) -> tuple[int, torch.Tensor] | None:
    """(dim, ids) when ``index`` picks along one dim by a 1-D integer tensor or list of
    ints (negatives counted from the end), every other entry a full slice; an index out
    of range raises torch's IndexError."""
    parts = index if isinstance(index, tuple) else (index,)
    at = [d for d, p in enumerate(parts) if not (isinstance(p, slice) and p == slice(None))]
    if len(at) != 1 or len(parts) > x.ndim:
        return None
    d, ids = at[0], parts[at[0]]
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        ids = torch.tensor(ids, device=x.device)
    if (not isinstance(ids, torch.Tensor) or isinstance(ids, Tensor) or ids.ndim != 1
            or ids.dtype not in (torch.int64, torch.int32) or not len(ids)):
        return None
    n = x.shape[d]
    bad = ids[(ids < -n) | (ids >= n)]
    if len(bad):  # torch's error, without gathering x
        raise IndexError(f"index {int(bad[0])} is out of bounds for dimension {d} with size {n}")
    return d, torch.where(ids < 0, ids + n, ids)


# --- reductions ---------------------------------------------------------------------------
def _reduce_dims(x: Any, dim: Any, what: str = "dim") -> tuple[int, ...]:
    """The dims ``dim`` names (an int, a sequence, or None: all), normalized, sorted."""
    if dim is None:
        return tuple(range(x.ndim))
    ds = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({normalize_dim(d, max(x.ndim, 1), what) for d in ds})) if x.ndim else ()


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


def _install_reductions() -> None:
    @register(torch.sum, TensorMethod.sum)
    def sum_(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        t = x if dtype is None else _to(x, dtype)
        return C.sum(t, dim, keepdim)

    @register(torch.mean, TensorMethod.mean)
    def mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        t = x if dtype is None else _to(x, dtype)
        return C.mean(t, dim, keepdim)

    register(torch.amax, TensorMethod.amax)(
        lambda x, dim=(), keepdim=False: C.amax(x, dim if dim != () else None, keepdim))
    register(torch.amin, TensorMethod.amin)(
        lambda x, dim=(), keepdim=False: C.amin(x, dim if dim != () else None, keepdim))

    def full_reduce(fn: Any) -> Callable[..., Any]:
        def handler(x: Any, dim: Any = None, keepdim: bool = False, *args: Any,
                    **kwargs: Any) -> Any:
            dims = _reduce_dims(x, dim)
            if dim is None:  # over everything: torch's no-dim overload
                return apply("reduce_full", (x,), lambda s: fn(s, *args, **kwargs), dims,
                             False)
            return apply("reduce_full", (x,), lambda s: fn(s, dim, keepdim, *args, **kwargs),
                         dims, keepdim)

        return handler

    for name in ("prod", "any", "all", "argmax", "argmin", "logsumexp", "median", "nansum",
                 "count_nonzero"):
        fn = getattr(torch, name)
        register(fn, getattr(TensorMethod, name, None))(full_reduce(fn))

    for name in ("var", "std"):
        fn = getattr(torch, name)

        def vs(x: Any, dim: Any = None, *args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
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
            dims = _reduce_dims(x, dim)
            return apply("reduce_full", (x,), lambda s: _fn(
                s, dims, correction=correction, keepdim=keepdim), dims, keepdim)

        register(fn, getattr(TensorMethod, name))(vs)

    def extreme(name: str, fn: Any, values: Any) -> Callable[..., Any]:
        def handler(x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
            if isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
                return HANDLERS[getattr(torch, "maximum" if name == "max" else "minimum")](
                    x, dim)
            if dim is None:
                return values(x, None, False)
            d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
            kind = torch.return_types.max if name == "max" else torch.return_types.min
            return kind(_values_and_indices("reduce_full", x, lambda s: fn(s, d, keepdim),
                                            (d,), keepdim))

        return handler

    register(torch.max, TensorMethod.max)(extreme("max", torch.max, C.amax))
    register(torch.min, TensorMethod.min)(extreme("min", torch.min, C.amin))

    @register(torch.topk, TensorMethod.topk)
    def topk(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        d = normalize_dim(dim, max(x.ndim, 1), "topk dim")

        return torch.return_types.topk(_values_and_indices(
            "topk", x, lambda s: torch.topk(s, k, d, largest, sorted), d, k))

    @register(torch.sort, TensorMethod.sort)
    def sort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
        d = normalize_dim(dim, max(x.ndim, 1), "sort dim")
        return torch.return_types.sort(_values_and_indices(
            "sort", x, lambda s: torch.sort(s, dim=d, descending=descending, stable=stable),
            d))

    @register(torch.argsort, TensorMethod.argsort)
    def argsort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
        return sort(x, dim, descending, stable)[1]

    # RoPE (torchtitan's Llama): the pairs become complex numbers and back, blockwise
    @register(torch.view_as_complex)
    def view_as_complex(x: Any) -> Any:
        return apply("view_as_complex", (x,), torch.view_as_complex)

    @register(torch.view_as_real)
    def view_as_real(x: Any) -> Any:
        return apply("view_as_real", (x,), torch.view_as_real)

    @register(torch.repeat_interleave, TensorMethod.repeat_interleave)
    def repeat_interleave(x: Any, repeats: Any, dim: Any = None, *,
                          output_size: Any = None) -> Any:
        # GQA's key/value heads: an int repeat along one dim is unsqueeze, expand and
        # merge (the layout follows reshape's rule); tensor repeats and dim=None fall back
        if not isinstance(repeats, int) or dim is None or isinstance(dim, Tensor):
            return _fallback(torch.repeat_interleave, (x, repeats),
                             {"dim": dim, "output_size": output_size})
        d = normalize_dim(dim, max(x.ndim, 1), "repeat_interleave dim")
        shape = tuple(x.shape)
        wide = (*shape[:d + 1], repeats, *shape[d + 1:])
        merged = (*shape[:d], shape[d] * repeats, *shape[d + 1:])
        return C.reshape(x.unsqueeze(d + 1).expand(wide), merged)

    @register(torch.flip, TensorMethod.flip)
    def flip(x: Any, *dims: Any, **kwargs: Any) -> Any:
        if "dims" in kwargs:
            dims = (kwargs.pop("dims"),)
        ds = _reduce_dims(x, dims[0] if len(dims) == 1 else dims, "flip dims")
        return apply("flip", (x,), lambda s: torch.flip(s, ds), ds)

    @register(torch.roll, TensorMethod.roll)
    def roll(x: Any, shifts: Any, dims: Any = None) -> Any:
        # dims=None rolls the flattened order: every dim whole
        ds = _reduce_dims(x, dims, "roll dims")
        return apply("roll", (x,), lambda s: torch.roll(s, shifts, dims), ds)

    for name in ("cumsum", "cumprod", "log_softmax", "softmax"):
        fn = getattr(torch, name)

        def dimwise(x: Any, dim: Any = None, *args: Any, _fn: Any = fn, _name: str = name,
                    **kwargs: Any) -> Any:
            if dim is None:
                raise ShardingError(f"{_name} needs dim= (torch's implicit dim is deprecated).")
            d = normalize_dim(dim, max(x.ndim, 1), f"{_name} dim")
            dtype = kwargs.pop("dtype", args[0] if args else None)
            kwargs.pop("_stacklevel", None)
            return apply(_name, (x,), lambda s: _fn(s, d, dtype=dtype), d)

        register(fn, getattr(TensorMethod, name), getattr(F, name, None))(dimwise)

    @register(torch.linalg.vector_norm, torch.norm, TensorMethod.norm)
    def vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                    dtype: Any = None, p: Any = None, **kwargs: Any) -> Any:
        if p is not None:
            ord = p
        if isinstance(ord, str):
            if ord != "fro":
                return _fallback(torch.linalg.vector_norm, (x, ord, dim, keepdim), {})
            ord = 2
        t = x if dtype is None else _to(x, dtype)
        a = C.abs_(t)
        if ord == math.inf:
            return C.amax(a, dim, keepdim)
        if ord == -math.inf:
            return C.amin(a, dim, keepdim)
        if ord == 0:
            return C.sum(_to(C.ne(t, 0), t.dtype), dim, keepdim)
        if ord == 1:
            return C.sum(a, dim, keepdim)
        if ord == 2:
            return C.sqrt(C.sum(C.mul(a, a), dim, keepdim))
        return C.pow(C.sum(C.pow(a, ord), dim, keepdim), 1.0 / ord)


def install() -> None:
    _install_views()
    _install_reductions()
