"""Indexing shardwise Tensors: ``x[...]`` and ``torch.index_select``.

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
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.ops import compute as C
from shardwise.ops.execute import apply
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, register
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


@register(TensorMethod.__getitem__)
def getitem(x: Any, index: Any) -> Any:
    if C.is_basic_index(index):
        return C.getitem(x, index)
    picked = _one_integer_index(x, index)
    if picked is not None:  # x[ids], x[:, ids]: an index_select, never a gather of x
        return torch.index_select(x, *picked)
    return fallback(TensorMethod.__getitem__, (x, index), {})


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


@register(torch.index_select, TensorMethod.index_select)
def index_select(x: Any, dim: int, index: Any) -> Any:
    d = normalize_dim(dim, max(x.ndim, 1), "index_select dim")
    if x.ndim == 0:  # torch picks the value itself (index 0): no dim to lay out
        return fallback(torch.index_select, (x, dim, index), {})
    if isinstance(index, torch.Tensor) and index.ndim == 0:
        index = index.reshape(1)  # torch reads a 0-d index as one id: the dim keeps size 1
    ops = on_mesh([x, index])
    return apply("index_select", ops, lambda s, i: torch.index_select(s, d, i), d)
