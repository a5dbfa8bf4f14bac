"""More views of shardwise Tensors (issue 20): diagonals, windows, scatters into views,
splits, dim moves, and the ``*_copy`` twins of every view.

Invariants:
- Arguments are checked, and output sizes found, by running torch's own op on a
  ``meta`` tensor of the global shape first: bad arguments raise torch's error, and a
  size is torch's, never re-derived here.
- A dim whose positions an op reads globally (a diagonal's two dims, an unfolded dim,
  the dim a scatter writes into) is whole (``!`` in the rule: the planner gathers it
  first); every other dim keeps its sharding. Splits and slices are basic indexing
  (the getitem rule), dim moves are permutes.
- ``torch.X_copy`` is the view ``X`` followed by a clone: never an alias of its input
  (a later write to one does not show in the other, as in torch).
- ``as_strided`` reads a storage (``as_strided_scatter`` writes one), and a Tensor's
  storage is its own elements in row-major order (``stride()`` contiguous,
  ``storage_offset()`` 0): the elements it reads are taken (``take``, a rule; the
  writes are torch's own op on the whole value), or it raises ``ShardingError`` where
  torch would read others or it cannot tell: past those elements, where the one tensor
  holding the value here lies otherwise in memory (a view into a larger storage, a
  non-contiguous value), or where no one tensor holds it (blocks in separate buffers,
  Partial sums).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops import compute, shapes
from shardwise.ops.execute import apply
from shardwise.ops.free_dims import apply_free_dims
from shardwise.ops.registry import TensorMethod, describe, on_mesh, register
from shardwise.runtime.blocks import tiling_view
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


def meta(x: Any) -> torch.Tensor:
    """A ``meta`` tensor of ``x``'s global shape and dtype: torch's op on it checks the
    arguments and gives the output's shape and dtype, and moves no data."""
    return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")


def _clone(out: Any) -> Any:
    if isinstance(out, Tensor):
        return apply("clone", (out,), torch.clone)
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


# --- diagonals ---------------------------------------------------------------------------
@register(torch.diagonal, TensorMethod.diagonal)
def diagonal(x: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    length = torch.diagonal(meta(x), offset, dim1, dim2).shape[-1]
    d1, d2 = normalize_dim(dim1, x.ndim, "diagonal dim1"), normalize_dim(dim2, x.ndim, "dim2")
    return apply("diagonal", (x,), lambda s: torch.diagonal(s, offset, d1, d2), d1, d2,
                 length)


@register(torch.linalg.diagonal)
def linalg_diagonal(a: Any, *, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Any:
    return diagonal(a, offset, dim1, dim2)


@register(torch.diag_embed, TensorMethod.diag_embed)
def diag_embed(x: Any, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Any:
    out = torch.diag_embed(meta(x), offset, dim1, dim2)
    d1, d2 = normalize_dim(dim1, out.ndim, "diag_embed dim1"), normalize_dim(dim2, out.ndim,
                                                                             "dim2")
    return apply("diag_embed", (x,), lambda s: torch.diag_embed(s, offset, dim1, dim2), d1,
                 d2, out.shape[d1])


@register(torch.diag, TensorMethod.diag)
def diag(x: Any, diagonal: int = 0) -> Any:
    """1-D: the matrix with ``x`` on a diagonal; 2-D: that diagonal (a copy)."""
    out = torch.diag(meta(x), diagonal)
    if x.ndim == 1:
        return apply("diag_embed", (x,), lambda s: torch.diag(s, diagonal), 0, 1,
                     out.shape[0])
    return apply("diagonal", (x,), lambda s: torch.diag(s, diagonal), 0, 1, out.shape[0])


@register(torch.diagflat, TensorMethod.diagflat)
def diagflat(x: Any, offset: int = 0) -> Any:
    out = torch.diagflat(meta(x), offset)
    flat = compute.reshape(x, (x.numel(),))
    return apply("diag_embed", (flat,), lambda s: torch.diagflat(s, offset), 0, 1,
                 out.shape[0])


@register(torch.trace, TensorMethod.trace)
def trace(x: Any) -> Any:
    """The whole matrix on every device (``trace``'s own summation order: torch's bits)."""
    torch.trace(meta(x))
    return apply("reduce_full", (x,), torch.trace, (0, 1), False)


# --- windows and writes into views --------------------------------------------------------
@register(TensorMethod.unfold)
def unfold(x: Any, dimension: int, size: int, step: int) -> Any:
    out = meta(x).unfold(dimension, size, step)
    if x.ndim == 0:
        return compute.reshape(x, tuple(out.shape))
    d = normalize_dim(dimension, x.ndim, "unfold dimension")
    return apply("unfold", (x,), lambda s: s.unfold(d, size, step), d, out.shape[d], size)


@register(torch.select_scatter)
def select_scatter(x: Any, src: Any, dim: int, index: int) -> Any:
    torch.select_scatter(meta(x), meta(src), dim, index)
    d = normalize_dim(dim, x.ndim, "select_scatter dim")
    return apply("scatter", (x, src), lambda a, b: torch.select_scatter(a, b, d, index),
                 "select", d, d)


@register(torch.slice_scatter)
def slice_scatter(x: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None,
                  step: int = 1) -> Any:
    torch.slice_scatter(meta(x), meta(src), dim, start, end, step)
    d = normalize_dim(dim, x.ndim, "slice_scatter dim")
    return apply("scatter", (x, src),
                 lambda a, b: torch.slice_scatter(a, b, d, start, end, step), "slice", d, d)


@register(torch.diagonal_scatter)
def diagonal_scatter(x: Any, src: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    torch.diagonal_scatter(meta(x), meta(src), offset, dim1, dim2)
    d1, d2 = normalize_dim(dim1, x.ndim, "diagonal_scatter dim1"), normalize_dim(
        dim2, x.ndim, "dim2")
    return apply("scatter", (x, src),
                 lambda a, b: torch.diagonal_scatter(a, b, offset, d1, d2), "diagonal",
                 d1, d2)


# --- splits and slices: basic indexing ----------------------------------------------------
def _slices(x: Any, dim: int, bounds: Sequence[tuple[int | None, int | None]]) -> tuple[Any, ...]:
    d = normalize_dim(dim, x.ndim, "split dim")
    return tuple(compute.getitem(x, (slice(None),) * d + (slice(a, b),)) for a, b in bounds)


def _pieces(x: Any, dim: int, pieces: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """``x`` cut along ``dim`` into consecutive pieces of the sizes torch's own split
    gave on the meta tensor (``pieces``)."""
    d = normalize_dim(dim, max(x.ndim, 1), "split dim")
    bounds, start = [], 0
    for p in pieces:
        bounds.append((start, start + p.shape[d]))
        start += p.shape[d]
    return _slices(x, d, bounds)


def _splitter(func: Any) -> Callable[..., Any]:
    """split_with_sizes, unsafe_split and kin: consecutive pieces of torch's sizes."""

    def handler(x: Any, sizes: Any, dim: int = 0) -> Any:
        return _pieces(x, dim, func(meta(x), sizes, dim))

    return handler


for _f in (torch.split_with_sizes, TensorMethod.split_with_sizes, torch.unsafe_split,
           TensorMethod.unsafe_split, torch.unsafe_split_with_sizes,
           TensorMethod.unsafe_split_with_sizes, torch.unsafe_chunk, TensorMethod.unsafe_chunk):
    register(_f)(_splitter(_f))


def _indices(arg: Any) -> Any:
    """A split argument as torch reads it: an int, or a list of ints. A tensor of
    indices is a host value to torch (it must live on the CPU): its few ints are read."""
    if isinstance(arg, Tensor):
        arg = arg.to_torch()
    if isinstance(arg, torch.Tensor):
        return arg.item() if arg.ndim == 0 else arg.tolist()
    return arg


@register(torch.tensor_split, TensorMethod.tensor_split)
def tensor_split(x: Any, indices_or_sections: Any, dim: int = 0) -> Any:
    arg = _indices(indices_or_sections)
    pieces = torch.tensor_split(meta(x), arg, dim)
    if isinstance(arg, int):
        return _pieces(x, dim, pieces)
    # indices: each piece from one index to the next, as torch slices them (an index
    # below its predecessor gives an empty piece, negative ones count from the end)
    bounds = list(zip([0, *arg], [*arg, None]))
    return _slices(x, dim, bounds)


def _dim_split(name: str, dim_of: Callable[[int], int]) -> Callable[..., Any]:
    """hsplit/vsplit/dsplit: torch's checks, then tensor_split along their dim."""
    func = getattr(torch, name)

    def handler(x: Any, indices_or_sections: Any) -> Any:
        arg = _indices(indices_or_sections)
        func(meta(x), arg)
        return tensor_split(x, arg, dim_of(x.ndim))

    return handler


for _name, _dim_of in (("hsplit", lambda n: 1 if n > 1 else 0), ("vsplit", lambda n: 0),
                       ("dsplit", lambda n: 2)):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(_dim_split(_name, _dim_of))


@register(torch.ops.aten.slice.Tensor)
def aten_slice(x: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Any:
    torch.ops.aten.slice.Tensor(meta(x), dim, start, end, step)
    d = normalize_dim(dim, x.ndim, "slice dim")
    return compute.getitem(x, (slice(None),) * d + (slice(start, end, step),))


# --- dims that move -----------------------------------------------------------------------
def _as_list(dims: Any) -> list[int]:
    return [dims] if isinstance(dims, int) else list(dims)


@register(torch.movedim, TensorMethod.movedim, torch.moveaxis, TensorMethod.moveaxis)
def movedim(x: Any, source: Any, destination: Any) -> Any:
    torch.movedim(meta(x), source, destination)
    n = x.ndim
    src = [normalize_dim(d, max(n, 1), "movedim source") for d in _as_list(source)]
    dst = [normalize_dim(d, max(n, 1), "movedim destination") for d in _as_list(destination)]
    order: list[int | None] = [None] * n
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(n) if d not in src)
    perm = tuple(o if o is not None else next(rest) for o in order)
    return compute.permute(x, perm) if n else x


@register(torch.fliplr, TensorMethod.fliplr)
def fliplr(x: Any) -> Any:
    torch.fliplr(meta(x))
    return shapes.flip(x, [1])


@register(torch.flipud, TensorMethod.flipud)
def flipud(x: Any) -> Any:
    torch.flipud(meta(x))
    return shapes.flip(x, [0])


@register(torch.rot90, TensorMethod.rot90)
def rot90(x: Any, k: int = 1, dims: tuple[int, ...] | list[int] = (0, 1)) -> Any:
    """torch's own composition: a flip of one or both dims, then a transpose."""
    torch.rot90(meta(x), k, dims)
    a, b = dims
    k %= 4
    if k == 1:
        return compute.transpose(shapes.flip(x, [b]), a, b)
    if k == 2:
        return shapes.flip(x, list(dims))
    if k == 3:
        return compute.transpose(shapes.flip(x, [a]), a, b)
    return apply("clone", (x,), torch.clone)


_GETTER = "__get__"  # torch's property getters (not visible to mypy on the stubs)


@register(getattr(TensorMethod.H, _GETTER))
def conj_transpose(x: Any) -> Any:
    """``x.H``: a matrix's conjugate transpose (a 0-d tensor's conjugate)."""
    _ = meta(x).H  # torch's check: matrices (or 0-d) only
    return torch.conj(compute.transpose(x, 0, 1) if x.ndim == 2 else x)


@register(getattr(TensorMethod.mH, _GETTER), torch.adjoint, TensorMethod.adjoint)
def matrix_conj_transpose(x: Any) -> Any:
    """``x.mH``, ``torch.adjoint``: the last two dims swapped and conjugated."""
    _ = meta(x).mH  # torch's check: at least 2 dims
    return torch.conj(compute.transpose(x, -2, -1))


# --- as_strided: a read of the Tensor's own elements ---------------------------------------
@register(torch.as_strided, TensorMethod.as_strided, torch.as_strided_copy)
def as_strided(x: Any, size: Sequence[int], stride: Sequence[int],
               storage_offset: int | None = None) -> Any:
    """torch's ``as_strided`` on the Tensor's own elements, row-major, as its storage:
    the elements read, taken (gradients summed where one is read twice, as torch's);
    a ShardingError where torch would read other elements (module doc). A copy, as
    ``as_strided_copy``: a write to it does not reach ``x``."""
    return torch.take(x, _reads("as_strided", x, tuple(size), tuple(stride), storage_offset))


@register(torch.as_strided_scatter, TensorMethod.as_strided_scatter)
def as_strided_scatter(x: Any, src: Any, size: Sequence[int], stride: Sequence[int],
                       storage_offset: int | None = None) -> Any:
    """``x`` with ``src`` written where ``as_strided`` reads (refused where that read
    is): torch's own op, its values and gradients, on the whole value, row-major."""
    x, src = on_mesh([x, src])
    _reads("as_strided_scatter", x, tuple(size), tuple(stride), storage_offset)
    return apply_free_dims("as_strided_scatter", lambda a, b: torch.as_strided_scatter(
        a.contiguous(), b, size, stride, storage_offset), [x, src],
        [(-1,) * x.ndim, (-1,) * src.ndim])


def _reads(name: str, x: Any, size: tuple[int, ...], stride: tuple[int, ...],
           storage_offset: int | None) -> torch.Tensor:
    """The row-major indices of ``x``'s elements that ``as_strided`` reads, shaped
    ``size``; raises (naming the op ``name``) where torch would read others."""
    offset = 0 if storage_offset is None else int(storage_offset)
    # one past the last position read (torch checks the arguments first, then bounds)
    end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    torch.as_strided(torch.empty(max(end, 0), dtype=x.dtype, device="meta"), size, stride,
                     storage_offset)
    call = f"size={list(size)}, stride={list(stride)}, storage_offset={storage_offset}"
    if end > x.numel():
        raise ShardingError(
            f"Cannot {name} a shardwise Tensor ({describe([x])}) with {call}: a "
            f"shardwise Tensor's storage is its own {x.numel()} elements, row-major "
            "(storage_offset() 0, a contiguous stride()), and a sharded value has no "
            f"other. Got a read of storage position {end - 1}; count positions from the "
            f"Tensor's first element, or {name} the tensor it was viewed from.")
    reads = torch.arange(max(end, 0)).as_strided(size, stride, offset).contiguous()
    if not reads.numel():
        return reads
    held = _held(x)
    if held is None:
        # blocks in separate buffers (or Partial sums): how torch would lay the value out
        # in memory is nowhere to be seen, so what it would read is unknown
        raise ShardingError(
            f"Cannot {name} a shardwise Tensor ({describe([x])}) with {call}: it "
            "reads the storage of one tensor, and no one tensor holds this value here "
            "(its blocks live in separate buffers, or are Partial sums). Got a sharded "
            f"value; {name} its gathered value, row-major, instead "
            f"(torch.{name}(x.to_torch().contiguous(), ...)).")
    if held.is_contiguous() and held.storage_offset() == 0:
        return reads  # (laid out as the Tensor reports itself: torch reads these too)
    base = int(held.storage_offset())
    at = torch.tensor(base)  # each element's position in held's storage, row-major
    for n, s in zip(held.shape, held.stride()):
        at = at.unsqueeze(-1) + torch.arange(n) * s
    torch_reads = reads if storage_offset is not None else reads + base
    if not torch.equal(at.reshape(-1)[reads], torch_reads):
        raise _laid_out(name, x, call, held)
    return reads


def _held(x: Any) -> torch.Tensor | None:
    """The one torch tensor holding ``x``'s value here, laid out in memory as torch laid
    it out: its whole value, or the buffer its blocks tile; None where no one does
    (Partial, blocks in separate buffers)."""
    if x.dist_layout.is_partial:
        return None
    blocks = x.shards
    shape = tuple(x.shape)
    held = next((b for b in blocks if b is not None and tuple(b.shape) == shape), None)
    return held if held is not None else tiling_view(blocks, x.dist_layout, shape)


def _laid_out(name: str, x: Any, call: str, held: torch.Tensor) -> ShardingError:
    return ShardingError(
        f"Cannot {name} a shardwise Tensor ({describe([x])}) with {call}: a shardwise "
        "Tensor's storage is its own elements, row-major (storage_offset() 0, a "
        "contiguous stride()), but this value lies in memory as torch laid it out "
        f"(storage offset {held.storage_offset()}, strides {tuple(held.stride())}), where "
        "torch would read other elements. Got a view or a non-contiguous value; "
        f"{name} its gathered value, row-major, instead (torch.{name}(x.to_torch()."
        "contiguous(), ...)), counting positions from its first element.")


# --- the *_copy twins: the view, then a clone ---------------------------------------------
def _copy_of(view: Callable[..., Any]) -> Callable[..., Any]:
    def handler(x: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("implicit", None)  # expand_copy's: no meaning for the values
        return _clone(view(x, *args, **kwargs))

    return handler


COPIES: dict[Any, Callable[..., Any]] = {
    torch.view_copy: shapes.reshape, torch.permute_copy: shapes.permute, torch.t_copy: shapes.t,
    torch.transpose_copy: shapes.transpose, torch.squeeze_copy: shapes.squeeze,
    torch.unsqueeze_copy: shapes.unsqueeze, torch.expand_copy: shapes.expand,
    torch.alias_copy: lambda x: x, torch.diagonal_copy: diagonal,
    torch.narrow_copy: shapes.narrow, TensorMethod.narrow_copy: shapes.narrow,
    torch.unbind_copy: shapes.unbind, torch.unfold_copy: unfold, torch.select_copy: shapes.select,
    torch.split_copy: shapes.split, torch.split_with_sizes_copy: _splitter(torch.split_with_sizes),
    torch.slice_copy: aten_slice, torch.view_as_real_copy: shapes.view_as_real,
    torch.view_as_complex_copy: shapes.view_as_complex,
}
for _f, _view in COPIES.items():
    register(_f)(_copy_of(_view))
