"""Views and shape ops on shardwise Tensors: reshape and its kin, permute and transpose,
expand, cat and stack, narrow, select, split, chunk, unbind, flip, roll, tril and triu.

Invariants:
- A dim that survives an op keeps its sharding: permute and transpose carry it along;
  the reshape-like ops (view, flatten, squeeze, unsqueeze, unflatten, expand-and-merge
  repeat_interleave) resolve their target shape here and go through the one reshape
  rule (:func:`shardwise.ops.compute.reshape`), which gathers only the dims it must.
- Slicing ops (narrow, select, split, chunk, unbind) are basic indexing (the getitem
  rule): a sliced dim is gathered first unless taken whole, the others keep theirs.
- A dim along which elements move (flip, roll, tril's and triu's last two) is whole.
- ``expand`` is a view per block (the expand rule: no arithmetic, torch's bits); plain
  torch tensors among cat/stack operands are Replicated on the first Tensor's mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.ops import compute
from shardwise.ops.execute import apply
from shardwise.ops.registry import (
    TensorMethod,
    fallback,
    on_mesh,
    reduce_dims,
    register,
    shape_args,
)
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


@register(TensorMethod.view, TensorMethod.reshape, torch.reshape)
def reshape(x: Any, *shape: Any) -> Any:
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise ShardingError("x.view(dtype) reinterprets bytes; use x.to(dtype) on a "
                            "shardwise.Tensor.")
    return compute.reshape(x, shape_args(shape))


@register(TensorMethod.view_as, TensorMethod.reshape_as)
def view_as(x: Any, other: Any) -> Any:
    return compute.reshape(x, tuple(other.shape))


@register(TensorMethod.flatten, torch.flatten)
def flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    if x.ndim == 0:
        return compute.reshape(x, (1,))
    a = normalize_dim(start_dim, x.ndim, "flatten start_dim")
    b = normalize_dim(end_dim, x.ndim, "flatten end_dim")
    shape = (*x.shape[:a], math.prod(x.shape[a:b + 1]), *x.shape[b + 1:])
    return compute.reshape(x, shape)


@register(TensorMethod.unflatten, torch.unflatten)
def unflatten(x: Any, dim: int, sizes: Sequence[int]) -> Any:
    d = normalize_dim(dim, x.ndim, "unflatten dim")
    sizes = list(sizes)
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.shape[d] // rest
    return compute.reshape(x, (*x.shape[:d], *sizes, *x.shape[d + 1:]))


@register(TensorMethod.squeeze, torch.squeeze)
def squeeze(x: Any, dim: Any = None) -> Any:
    if dim is None:
        dims = {d for d, n in enumerate(x.shape) if n == 1}
    else:
        ds = dim if isinstance(dim, (list, tuple)) else (dim,)
        dims = {normalize_dim(d, max(x.ndim, 1), "squeeze dim") for d in ds}
        dims = {d for d in dims if x.ndim and x.shape[d] == 1}
    return compute.reshape(x, tuple(n for d, n in enumerate(x.shape) if d not in dims))


@register(TensorMethod.unsqueeze, torch.unsqueeze)
def unsqueeze(x: Any, dim: int) -> Any:
    d = normalize_dim(dim, x.ndim + 1, "unsqueeze dim")
    return compute.reshape(x, (*x.shape[:d], 1, *x.shape[d:]))


@register(torch.repeat_interleave, TensorMethod.repeat_interleave)
def repeat_interleave(x: Any, repeats: Any, dim: Any = None, *,
                      output_size: Any = None) -> Any:
    # GQA's key/value heads: an int repeat along one dim is unsqueeze, expand and
    # merge (the layout follows reshape's rule); dim=None repeats the flattened tensor.
    # Repeats in a tensor pick rows (index_select; the planner gathers the dim). They
    # give the output's size, so torch reads them on the host (a CPU tensor); so do we,
    # from a shardwise Tensor too (a few ints, as x.tolist() reads them)
    if isinstance(dim, Tensor):
        return fallback(torch.repeat_interleave, (x, repeats),
                        {"dim": dim, "output_size": output_size})
    if isinstance(repeats, Tensor):
        repeats = repeats.to_torch()
    if dim is None:
        x, dim = compute.reshape(x, (x.numel(),)), 0
    if isinstance(repeats, torch.Tensor):
        d = normalize_dim(dim, max(x.ndim, 1), "repeat_interleave dim")
        rows = torch.repeat_interleave(torch.arange(max(x.shape[d] if x.ndim else 1, 1)),
                                       repeats, output_size=output_size)
        return torch.index_select(x, d, rows)
    torch.repeat_interleave(torch.empty(tuple(x.shape), device="meta"), repeats, dim)
    d = normalize_dim(dim, max(x.ndim, 1), "repeat_interleave dim")
    shape = tuple(x.shape)
    wide = (*shape[:d + 1], repeats, *shape[d + 1:])
    merged = (*shape[:d], shape[d] * repeats, *shape[d + 1:])
    return compute.reshape(x.unsqueeze(d + 1).expand(wide), merged)


# RoPE (torchtitan's Llama): the pairs become complex numbers and back, blockwise
@register(torch.view_as_complex)
def view_as_complex(x: Any) -> Any:
    return apply("view_as_complex", (x,), torch.view_as_complex)


@register(torch.view_as_real)
def view_as_real(x: Any) -> Any:
    return apply("view_as_real", (x,), torch.view_as_real)


# --- dim order ---------------------------------------------------------------------------
@register(TensorMethod.permute, torch.permute)
def permute(x: Any, *dims: Any) -> Any:
    return compute.permute(x, shape_args(dims))


@register(TensorMethod.transpose, torch.transpose, TensorMethod.swapaxes, torch.swapaxes,
          TensorMethod.swapdims, torch.swapdims)
def transpose(x: Any, dim0: int, dim1: int) -> Any:
    return compute.transpose(x, dim0, dim1)


@register(TensorMethod.t, torch.t)
def t(x: Any) -> Any:
    return compute.transpose(x, 0, 1) if x.ndim == 2 else x


_GETTER = "__get__"  # torch's property getters (not visible to mypy on the stubs)


@register(getattr(TensorMethod.T, _GETTER))
def reversed_dims(x: Any) -> Any:
    """``x.T``: every dim in reverse order."""
    return compute.permute(x, tuple(reversed(range(x.ndim)))) if x.ndim != 0 else x


@register(getattr(TensorMethod.mT, _GETTER))
def matrix_transpose(x: Any) -> Any:
    """``x.mT``: the last two dims swapped."""
    return compute.transpose(x, -2, -1)


# --- broadcast and join ------------------------------------------------------------------
@register(TensorMethod.expand)
def expand(x: Any, *sizes: Any) -> Any:
    """A broadcast view per block: kept dims keep their sharding, a broadcast dim (size
    1 before) is whole, new dims are the rule's; torch's checks on a meta tensor."""
    full = tuple(torch.empty(tuple(x.shape), device="meta").expand(shape_args(sizes)).shape)
    if full == tuple(x.shape):
        return x
    return apply("expand", (x,), lambda s, local: s.expand(local), full, shaped=True)


@register(TensorMethod.expand_as)
def expand_as(x: Any, other: Any) -> Any:
    return expand(x, tuple(other.shape))


@register(torch.cat, torch.concat, torch.concatenate)
def cat(tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat``, with torch's legacy rule: 1-D empty tensors (shape ``(0,)``) beside
    tensors of another rank are skipped. (``out=`` never reaches a handler: the router
    writes it, :func:`shardwise.ops.registry.write_out`.)"""
    kwargs.pop("out", None)  # out=None: no write
    if "axis" in kwargs:  # torch.concatenate's spelling
        dim = kwargs.pop("axis")
    if kwargs:
        raise TypeError(f"cat() got an unexpected keyword argument {next(iter(kwargs))!r}")
    ts = list(tensors)
    kept = [t for t in ts if not (t.ndim == 1 and t.shape[0] == 0)]
    if kept and len(kept) < len(ts) and any(t.ndim != 1 for t in kept):
        ts = kept
    return compute.cat(on_mesh(ts), dim)


@register(torch.stack)
def stack(tensors: Sequence[Any], dim: int = 0) -> Any:
    ts = on_mesh(tensors)
    d = normalize_dim(dim, ts[0].ndim + 1, "stack dim")
    return compute.cat([unsqueeze(t, d) for t in ts], d)


# --- pieces ------------------------------------------------------------------------------
@register(TensorMethod.narrow, torch.narrow)
def narrow(x: Any, dim: int, start: Any, length: int) -> Any:
    d = normalize_dim(dim, x.ndim, "narrow dim")
    if isinstance(start, torch.Tensor):  # torch takes a 0-d integer tensor start too
        if start.ndim or start.is_floating_point() or start.is_complex():
            raise RuntimeError("start must be an 0-dim integral Tensor.")
        start = int(start)
        if not isinstance(x, Tensor):  # only the start was a shardwise Tensor
            return torch.narrow(x, d, start, length)
    n = x.shape[d]
    if not -n <= start <= n:  # torch's checks and messages (a slice would clamp silently)
        raise IndexError(f"start out of range (expected to be in range of [{-n}, {n}], but "
                         f"got {start})")
    start += n if start < 0 else 0
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    if start + length > n:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({n}).")
    return compute.getitem(x, (slice(None),) * d + (slice(start, start + length),))


@register(TensorMethod.select, torch.select)
def select(x: Any, dim: int, index: int) -> Any:
    d = normalize_dim(dim, x.ndim, "select dim")
    return compute.getitem(x, (slice(None),) * d + (index,))


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


# --- elements that move: the dims they move along are gathered ---------------------------
@register(torch.flip, TensorMethod.flip)
def flip(x: Any, *dims: Any, **kwargs: Any) -> Any:
    if "dims" in kwargs:
        dims = (kwargs.pop("dims"),)
    ds = reduce_dims(x, dims[0] if len(dims) == 1 else dims, "flip dims")
    return apply("flip", (x,), lambda s: torch.flip(s, ds), ds)


@register(torch.roll, TensorMethod.roll)
def roll(x: Any, shifts: Any, dims: Any = None) -> Any:
    # dims=None rolls the flattened order: every dim whole
    ds = reduce_dims(x, dims, "roll dims")
    return apply("roll", (x,), lambda s: torch.roll(s, shifts, dims), ds)


def _triangle(fn: Any) -> Any:
    """``torch.tril``/``triu``: the last two dims whole (the diagonal depends on global
    positions)."""

    def handler(x: Any, diagonal: int = 0) -> Any:
        return apply("normalize", (x,), lambda s: fn(s, diagonal), 2)

    return handler


for _fn in (torch.tril, torch.triu):
    register(_fn, getattr(TensorMethod, _fn.__name__))(_triangle(_fn))
