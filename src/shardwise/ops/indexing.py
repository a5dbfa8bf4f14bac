"""Indexing shardwise Tensors: ``x[...]``, ``x[...] = v``, ``torch.index_select``, gather,
scatter, the ``index_*`` writers, take, put, searchsorted, bucketize, isin.

Invariants:
- Basic indexing (ints, slices, None, Ellipsis) goes through the getitem rule: full
  slices keep their dim's sharding; a dim indexed by an int or a partial slice is
  gathered first.
- ``x[ids]`` / ``x[:, ids]`` with one 1-D integer index (tensor or list) is an
  ``index_select``: only the indexed dim is gathered, never the whole of x; an index
  out of range raises torch's IndexError without gathering x.
- Any other advanced index falls back (exact values, a Replicated result, a warning).
- The index of ``index_select`` is an operand: a plain torch tensor is Replicated; a
  0-d index is one id, as in torch.
- gather, scatter, ``index_*``, take, put... run on the ``"free_dims"`` rule: a dim shards
  freely where every operand has it at one size and the op reads or writes each of its
  indices alone; the indexed dim, a dim whose sizes differ, and the flat-indexed or
  order-dependent operands (take's source, put, index_put, masked_scatter) stay whole.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.ops import compute
from shardwise.ops.execute import apply
from shardwise.ops.free_dims import apply_free_dims
from shardwise.ops.inplace import write_into
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, register
from shardwise.propagation.binding import normalize_index
from shardwise.sharding.errors import ShardingTypeError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


@register(TensorMethod.__getitem__)
def getitem(x: Any, index: Any) -> Any:
    if compute.is_basic_index(index):
        return compute.getitem(x, index)
    picked = _one_integer_index(x, index)
    if picked is not None:  # x[ids], x[:, ids]: an index_select, never a gather of x
        return torch.index_select(x, *picked)
    return fallback(TensorMethod.__getitem__, (x, index), {})


def _one_integer_index(x: Any, index: Any) -> tuple[int, torch.Tensor] | None:
    """(dim, ids) when ``index`` picks along one dim by a 1-D integer tensor (plain or
    shardwise: transformers' MoE ``hidden[perm // k]``) or list of ints (negatives
    counted from the end), every other entry a full slice; an index out of range raises
    torch's IndexError."""
    parts = index if isinstance(index, tuple) else (index,)
    at = [d for d, p in enumerate(parts) if not (isinstance(p, slice) and p == slice(None))]
    if len(at) != 1 or len(parts) > x.ndim:
        return None
    d, ids = at[0], parts[at[0]]
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        ids = torch.tensor(ids, device=x.device)
    if (not isinstance(ids, torch.Tensor) or ids.ndim != 1
            or ids.dtype not in (torch.int64, torch.int32) or not len(ids)):
        return None
    n = x.shape[d]
    outside = (ids < -n) | (ids >= n)
    if bool(outside.any()):  # torch's error, without gathering x (a shardwise index:
        bad = ids.to_torch() if isinstance(ids, Tensor) else ids  # its values, once)
        first = int(bad[(bad < -n) | (bad >= n)][0])
        raise IndexError(f"index {first} is out of bounds for dimension {d} with size {n}")
    return d, torch.where(ids < 0, ids + n, ids)


@register(torch.index_select, TensorMethod.index_select)
def index_select(x: Any, dim: int, index: Any) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "index_select dim")
    ops = on_mesh([x, index])
    if not x.ndim or not index.ndim:  # a 0-d source or index: no dim to keep
        return apply_free_dims("index_select", lambda s, i: torch.index_select(s, d, i), ops,
                               [_whole(x), _whole(index)])
    return apply("index_select", ops, lambda s, i: torch.index_select(s, d, i), d)


# --- gather, scatter, index_*, take, put, search: the "free_dims" rule ----------------------------
# A dim shards freely where every operand has it at one size and the op reads or writes
# each of its indices alone; the indexed dim and any dim whose sizes differ stay whole.
def _shared(tensors: list[Any], dim: int | None) -> list[tuple[int, ...] | None]:
    """Per operand (None: not a tensor, or 0-d): factor ``d`` at dim ``d`` where every
    tensor of ``tensors`` has one size there, whole (-1) at ``dim`` and elsewhere."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor) and t.ndim]
    if not ts:
        return [None] * len(tensors)
    # ranks may differ (torch takes an empty index of any rank): then nothing is shared
    n = max(t.ndim for t in ts)
    same = [d != dim and all(t.ndim == n and t.shape[d] == ts[0].shape[d] for t in ts)
            for d in range(n)]
    return [tuple(d if same[d] else -1 for d in range(t.ndim))
            if isinstance(t, torch.Tensor) and t.ndim else None for t in tensors]


def _dim(x: Any, dim: int, op: str) -> int:
    return normalize_dim(dim, max(x.ndim, 1), f"{op} dim")


@register(torch.gather, TensorMethod.gather)
def gather(x: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    """``out[i][j] = x[index[i][j]][j]`` (dim 0): the index shards freely along ``dim``
    (its position there reads nothing of x)."""
    d = _dim(x, dim, "gather")
    return _along("gather", lambda s, i: torch.gather(s, d, i, sparse_grad=sparse_grad),
                  x, d, index)


def _along(name: str, fn: Any, x: Any, d: int, index: Any) -> Any:
    """gather and take_along_dim: x's ``d`` whole, the dims x and the index share shard
    freely together, and the index's ``d`` too (its position there reads nothing of x)."""
    fx, fi = _shared([x, index], d)
    if fi is not None:
        fi = tuple(d if e == d else f for e, f in enumerate(fi))
    return apply_free_dims(name, fn, [x, index], [fx, fi], [fi or ()])


def _scatter(name: str, fn: Any) -> Any:
    def handler(x: Any, dim: int, index: Any, src: Any = None, *args: Any, **kwargs: Any
                ) -> Any:
        if src is None:
            src = kwargs.pop("value", kwargs.pop("src", None))
        d = _dim(x, dim, name)
        free = _shared([x, index, src], d)
        return apply_free_dims(name, lambda s, i, v: fn(s, d, i, v, *args, **kwargs),
                               [x, index, src], free, [free[0] or ()])

    return handler


for _name in ("scatter", "scatter_add", "scatter_reduce"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(
        _scatter(_name, getattr(torch, _name)))


def _index_family(name: str, fn: Any) -> Any:
    """``x.index_add(dim, index, source)`` and kin: x's and source's other dims shard
    freely together; ``dim`` and the 1-D index stay whole."""
    def handler(x: Any, dim: int, index: Any, source: Any, *args: Any, **kwargs: Any
                ) -> Any:
        d = _dim(x, dim, name)
        fx, _, fs = _shared([x, index, source], d)
        fi = None if not isinstance(index, torch.Tensor) or not index.ndim else (-1,)
        return apply_free_dims(name, lambda s, i, v: fn(s, d, i, v, *args, **kwargs),
                               [x, index, source], [fx, fi, fs], [fx or ()])

    return handler


for _name in ("index_add", "index_copy", "index_fill", "index_reduce"):
    register(getattr(torch, _name), getattr(TensorMethod, _name))(
        _index_family(_name, getattr(torch, _name)))


def _whole(t: Any) -> tuple[int, ...] | None:
    return (-1,) * t.ndim if isinstance(t, torch.Tensor) else None


@register(torch.take, TensorMethod.take)
def take(x: Any, index: Any) -> Any:
    """Flat indices into the whole of x: the index shards freely."""
    free = tuple(range(index.ndim))
    return apply_free_dims("take", torch.take, on_mesh([x, index]), [_whole(x), free], [free])


@register(torch.take_along_dim, TensorMethod.take_along_dim)
def take_along_dim(x: Any, indices: Any, dim: Any = None) -> Any:
    """gather's layout, torch's own op on each block (it broadcasts x and the indices,
    and counts negative indices from the end along ``dim``); without ``dim`` on both
    flattened, as torch flattens them."""
    if dim is None:
        x, indices = (compute.reshape(t, (t.numel(),)) for t in on_mesh([x, indices]))
        return _along("take_along_dim", torch.take_along_dim, x, 0, indices)
    d = _dim(x, dim, "take_along_dim")
    return _along("take_along_dim", lambda s, i: torch.take_along_dim(s, i, d), x, d,
                  indices)


@register(torch.put, TensorMethod.put)
def put(x: Any, index: Any, source: Any, accumulate: bool = False) -> Any:
    return apply_free_dims("put", lambda s, i, v: torch.put(s, i, v, accumulate),
                           [x, index, source], [_whole(x), _whole(index), _whole(source)])


@register(torch.index_put, TensorMethod.index_put)
def index_put(x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    idx = list(indices)
    at = [k for k, i in enumerate(idx) if i is not None]

    def call(s: torch.Tensor, v: Any, *ix: torch.Tensor) -> torch.Tensor:
        full: list[Any] = list(idx)
        for k, i in zip(at, ix):
            full[k] = i
        return torch.index_put(s, full, v, accumulate)

    ops = [x, values, *[idx[k] for k in at]]
    return apply_free_dims("index_put", call, ops, [_whole(t) for t in ops])


@register(torch.masked_scatter, TensorMethod.masked_scatter)
def masked_scatter(x: Any, mask: Any, source: Any) -> Any:
    """The source is read in the order of the mask over the whole tensor: all whole."""
    ops = [x, mask, source]
    return apply_free_dims("masked_scatter", torch.masked_scatter, ops, [_whole(t) for t in ops])


for _fn in (torch._unsafe_masked_index, torch._unsafe_masked_index_put_accumulate):
    def _masked(x: Any, mask: Any, indices: Any, fill: Any, _f: Any = _fn) -> Any:
        idx = list(indices)
        at = [k for k, i in enumerate(idx) if i is not None]

        def call(s: torch.Tensor, m: torch.Tensor, f: Any, *ix: torch.Tensor) -> torch.Tensor:
            full: list[Any] = list(idx)
            for k, i in zip(at, ix):
                full[k] = i
            return _f(s, m, full, f)

        ops = [x, mask, fill, *[idx[k] for k in at]]
        return apply_free_dims(_f.__name__, call, ops, [_whole(t) for t in ops])

    register(_fn)(_masked)


@register(torch.searchsorted)
def searchsorted(sorted_sequence: Any, values: Any, **kwargs: Any) -> Any:
    """A 1-D sequence stays whole and the values shard freely; an N-D one shares its
    leading dims with the values (each row searched alone), its last dim whole."""
    sorter = kwargs.pop("sorter", None)
    if not isinstance(values, torch.Tensor) or not values.ndim:
        free_v: tuple[int, ...] | None = None
        out: tuple[int, ...] = ()
        free_s = _whole(sorted_sequence)
    elif sorted_sequence.ndim == 1:
        free_v = out = tuple(range(values.ndim))
        free_s = (-1,)
    else:
        lead_ok = tuple(sorted_sequence.shape[:-1]) == tuple(values.shape[:-1])
        free_v = out = tuple(d if lead_ok and d < values.ndim - 1 else -1
                             for d in range(values.ndim))
        free_s = (*free_v[:-1], -1)
    return apply_free_dims("searchsorted", lambda s, v, so: torch.searchsorted(
        s, v, sorter=so, **kwargs), [sorted_sequence, values, sorter],
        [free_s, free_v, free_s if sorter is not None else None], [out])


@register(torch.bucketize)
def bucketize(values: Any, boundaries: Any, **kwargs: Any) -> Any:
    free = tuple(range(values.ndim)) if isinstance(values, torch.Tensor) else None
    return apply_free_dims("bucketize", lambda v, b: torch.bucketize(v, b, **kwargs),
                           [values, boundaries], [free, _whole(boundaries)], [free or ()])


@register(torch.isin)
def isin(elements: Any, test_elements: Any, **kwargs: Any) -> Any:
    """Each element alone against the whole set: the elements shard freely."""
    free = tuple(range(elements.ndim)) if isinstance(elements, torch.Tensor) else None
    return apply_free_dims("isin", lambda e, t: torch.isin(e, t, **kwargs),
                           [elements, test_elements], [free, _whole(test_elements)], [free or ()])


# --- x[index] = value ----------------------------------------------------------------------
@register(TensorMethod.__setitem__)
def setitem(x: Any, index: Any, value: Any) -> None:
    """``x[index] = value`` as torch does it, written into x's own buffers: the new value
    is ``x`` with the write applied (the ``"free_dims"`` rule: the dims a basic index keeps
    whole, ``x[:, 1] = v`` shards dim 0 freely; an advanced index keeps every dim
    whole), then copied into x (``copy_``: autograd records the write as torch does)."""
    if not isinstance(x, Tensor):
        raise ShardingTypeError(
            f"x[...] = value: x is a {type(x).__name__} and the value a shardwise.Tensor; "
            "write into a shardwise.Tensor, or gather the value with .to_torch() first.")
    items = index if isinstance(index, tuple) else (index,)
    at = [k for k, it in enumerate(items) if isinstance(it, torch.Tensor)]
    free_x = _setitem_free(x, index, value) if not at and compute.is_basic_index(index) else None

    def call(s: torch.Tensor, v: Any, *ix: torch.Tensor) -> torch.Tensor:
        full = list(items)
        for k, i in zip(at, ix):
            full[k] = i
        out = s.clone()
        out[tuple(full) if isinstance(index, tuple) else full[0]] = v
        return out

    ops = [x, value, *[items[k] for k in at]]
    if free_x is None:
        free: list[tuple[int, ...] | None] = [_whole(t) for t in ops]
    else:
        free = [free_x[0], free_x[1]]
    new = apply_free_dims("setitem", call, ops, free, [free[0] or ()])
    write_into(x, new, "x[...] = value")


def _setitem_free(x: Tensor, index: Any, value: Any
                  ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(x's factors, the value's) for a basic index: a dim of x taken whole by the index
    shards freely, with the value's dim that meets it (right-aligned) when of its size."""
    norm = normalize_index(compute._index_key(index), tuple(x.shape))
    fx = [-1] * x.ndim
    out: list[int] = []  # per dim of x[index]: x's dim (>= 0) or -1
    d = 0
    for it in norm:
        if it[0] == "new":
            out.append(-1)
            continue
        if it[0] == "full":
            fx[d] = d
            out.append(d)
        elif it[0] == "slice":
            out.append(-1)
        d += 1
    if not isinstance(value, torch.Tensor) or not value.ndim:
        return tuple(fx), None
    if value.ndim > len(out):  # torch's error, raised by the local call
        return (-1,) * x.ndim, (-1,) * value.ndim
    fv = []
    for j, n in enumerate(value.shape):
        xd = out[len(out) - value.ndim + j]
        fv.append(xd if xd >= 0 and n == x.shape[xd] else -1)
    return tuple(fx), tuple(fv)
