"""The collectives of values this process holds, written once: what one group of devices
computes from its members' values (a list in member order), every member's value here.
The simulated backend's steps (``simulated/backend.py``), shard_map's device threads
(``simulated/spmd.py``) and the per-device graph ops (``shardwise.graph``) all compute
their collectives here; no backend chooses anything in them, so they sit beside the
protocol, not inside a backend.

    reduce          op over the members' values (one result)
    all_gather      the members' values concatenated along a dim
    reduce_scatter  member ``pos``'s piece of the reduction along a dim
    all_to_all      member ``pos``'s piece of every member, concatenated
    ragged_all_to_all  the same with pieces of any sizes (a matrix of them)
    ppermute        the value of member ``pos``'s source (zeros when none)

Invariants:
- Results are computed with differentiable torch ops (add, maximum, amax, cat, narrow,
  clone), so torch's autograd (reverse and forward mode) gives the exact gradient of
  the global computation; inputs are never mutated (in-place ops write only into a
  buffer made here). Gradients through MAX/MIN split ties evenly (as on the process
  backend).
- ``exact=True`` sums in member order, ``((x0 + x1) + x2) + ...``, bit for bit (the
  graph ops' contract). Otherwise small floating sums of more than 3 values with no
  gradient recorded take one ``stack().sum(0)`` (two torch calls instead of n - 1;
  torch's accumulation order: equal within rounding).
- Pieces follow the split rule of :func:`shardwise.sharding.shapes.split_bounds`.
- Values are on one torch device: a caller whose members live on several moves them
  first (the graph ops, real accelerators).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.runtime import buffers, check_reduce
from shardwise.runtime.blocks import recording
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import split_bounds

__all__ = ["all_gather", "all_to_all", "ppermute", "ragged_all_to_all", "reduce",
           "reduce_scatter"]

_PAIRWISE = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}


def reduce(vals: Sequence[torch.Tensor], op: ReduceOp, exact: bool = False) -> torch.Tensor:
    """Reduce ``vals`` by ``op`` left to right into ONE fresh buffer (one value: that
    value itself). The first op allocates (above 32 MiB from the result pool when
    nothing records, see :func:`buffers.out_buffer`: a fresh large buffer page-faults
    every page), the rest accumulate in place. While a gradient is
    recorded, MAX/MIN are one ``stack().amax(0)`` (ties split evenly) and PROD stays
    out of place (no ``out=`` under autograd).

    >>> xs = [torch.tensor([1., 5.]), torch.tensor([3., 2.]), torch.tensor([2., 2.])]
    >>> reduce(xs, ReduceOp.SUM).tolist(), reduce(xs, ReduceOp.MAX).tolist()
    ([6.0, 9.0], [3.0, 5.0])
    """
    first = vals[0]
    check_reduce(first, op)  # on one device too: the same error on every mesh size
    if len(vals) == 1:
        return first
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        if (not exact and len(vals) > 3 and (first.is_floating_point() or first.is_complex())
                and first.nbytes * len(vals) <= buffers.SMALL_BYTES and not recording(vals)):
            # Small: 2 torch calls instead of len(vals) - 1 (call overhead dominates). Not
            # while recording: the input gradients would be views of one expanded buffer,
            # which torch's AccumulateGrad keeps as .grad and later accumulates in place.
            out = torch.stack(list(vals)).sum(0)
            return out.div_(len(vals)) if op is ReduceOp.AVG else out
        out = torch.add(first, vals[1], out=buffers.out_buffer(first.shape, first, vals))
        for v in vals[2:]:
            out.add_(v)
        if op is ReduceOp.AVG:
            out.div_(len(vals))
        return out
    tracked = recording(vals)  # (forward-mode AD has no out= variants either)
    if tracked and op is not ReduceOp.PROD:
        stacked = torch.stack(list(vals))
        return stacked.amax(0) if op is ReduceOp.MAX else stacked.amin(0)
    fn = _PAIRWISE[op]
    out = fn(first, vals[1], out=buffers.out_buffer(first.shape, first, vals))
    for v in vals[2:]:
        out = fn(out, v) if tracked else fn(out, v, out=out)
    return out


def all_gather(vals: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The members' values concatenated along ``dim`` (sizes there may differ).

    >>> all_gather([torch.ones(1, 2), torch.zeros(2, 2)], 0).shape
    torch.Size([3, 2])
    """
    return torch.cat(list(vals), dim)


def reduce_scatter(vals: Sequence[torch.Tensor], dim: int, pos: int,
                   op: ReduceOp = ReduceOp.SUM, exact: bool = False) -> torch.Tensor:
    """Member ``pos``'s piece along ``dim`` of the reduction of ``vals`` (each member's
    piece reduced on its own: no full-size intermediate).

    >>> xs = [torch.tensor([1., 2., 3.]), torch.tensor([10., 20., 30.])]
    >>> reduce_scatter(xs, 0, 0).tolist(), reduce_scatter(xs, 0, 1).tolist()
    ([11.0, 22.0], [33.0])
    """
    lo, hi = split_bounds(vals[0].shape[dim], len(vals), pos)
    pieces = [v.narrow(dim, lo, hi - lo) for v in vals]
    if len(pieces) == 1:
        return pieces[0].clone()  # a fresh result, as with more members
    return reduce(pieces, op, exact)


def all_to_all(vals: Sequence[torch.Tensor], split: int, concat: int, pos: int
               ) -> torch.Tensor:
    """Member ``pos``'s piece (along ``split``) of every member, concatenated along
    ``concat``.

    >>> xs = [torch.tensor([[1., 2.]]), torch.tensor([[3., 4.]])]
    >>> all_to_all(xs, 1, 0, 0).tolist()
    [[1.0], [3.0]]
    """
    pieces = []
    for v in vals:
        lo, hi = split_bounds(v.shape[split], len(vals), pos)
        pieces.append(v.narrow(split, lo, hi - lo))
    return torch.cat(pieces, concat)


def ragged_all_to_all(vals: Sequence[torch.Tensor], dim: int, pos: int,
                      sizes: Sequence[Sequence[int]]) -> torch.Tensor:
    """What member ``pos`` receives when member ``i`` sends its next ``sizes[i][j]``
    entries along ``dim`` to member ``j`` (in order): those pieces of every member,
    concatenated along ``dim`` in member order.

    >>> xs = [torch.tensor([1., 2., 3.]), torch.tensor([4.])]
    >>> ragged_all_to_all(xs, 0, 0, [[1, 2], [1, 0]]).tolist()
    [1.0, 4.0]
    """
    pieces = []
    for v, row in zip(vals, sizes):
        lo = sum(row[:pos])
        pieces.append(v.narrow(dim, lo, row[pos]))
    return torch.cat(pieces, dim)


def ppermute(vals: Sequence[torch.Tensor], pos: int, pairs: Sequence[tuple[int, int]]
             ) -> torch.Tensor:
    """The value of the member that ``pairs`` (source, destination) sends to ``pos``;
    zeros when none does.

    >>> ppermute([torch.ones(2), torch.zeros(2)], 1, [(0, 1)]).tolist()
    [1.0, 1.0]
    """
    src = {d: s for s, d in pairs}.get(pos)
    if src is None:
        return torch.zeros_like(vals[pos])
    return vals[src] if src == pos else vals[src].clone()
