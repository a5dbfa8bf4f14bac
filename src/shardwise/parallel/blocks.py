"""Per-block ops that need their block's position: vocab-parallel embedding lookups
and picking one class per row from class-sharded logits.

Both look up indices that live on one shard only: each device looks up the indices
that fall in its own range (its block's offset along the sharded dim), writes 0
elsewhere, and the result is ``Partial(SUM)`` over the mesh axes of that dim (one
device contributes each entry). Nothing is gathered.

Invariants:
- :func:`blockwise` runs its torch function once per distinct (block position,
  input blocks) and keeps replicas sharing one result buffer, as every compute op.
- A value replicated over a mesh axis where the output is sharded or Partial gets
  only a share of its gradient on each device: the backend's ``diverge`` sums the
  shares (the simulated runtime's replicas share one buffer, so it is identity).
- Autograd runs on the blocks: the gradients are torch's own.
- Where the runtime runs the op on whole values (``cache.runs_whole``: a mesh this
  process holds wholly),
  :func:`blockwise` runs ``fn`` once on the wholes at the position of the whole
  (the result's whole is the global value, its Partial axes reduced); layout
  changes and ``diverge`` are counted as the block run would run them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from shardwise.parallel.placing import relayout
from shardwise.runtime import backend_for
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_bounds
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor, place

__all__ = ["blockwise", "check_targets", "pick_classes", "vocab_embedding"]


def blockwise(fn: Callable[..., torch.Tensor], operands: Sequence[Tensor], layout: Layout,
              shape: Sequence[int], dtype: torch.dtype,
              where: Callable[[tuple[int, ...]], Hashable], whole: Hashable = None
              ) -> Tensor:
    """A Tensor laid out as ``layout`` whose block on the device at ``coord`` is
    ``fn(where(coord), *blocks)``; the operands must already be laid out as ``fn``
    expects. ``whole``: the position of the whole value, where ``fn(whole, *wholes)``
    is the global value (module doc)."""
    mesh = layout.mesh
    spread = set(layout.sharded_axes) | set(layout.partial_axes)
    if whole is not None and cache.runs_whole(operands):
        wholes = []
        for x in operands:
            lay = x.dist_layout
            used = set(lay.sharded_axes) | set(lay.partial_axes)
            axes = tuple(a for a in sorted(spread) if a not in used)
            wholes.append(cache.whole(x, lay, axes if x.requires_grad else ()))
        return Tensor.from_whole(fn(whole, *wholes), layout)
    cols: list[Sequence[torch.Tensor | None]] = []
    for x in operands:
        lay = x.dist_layout
        used = set(lay.sharded_axes) | set(lay.partial_axes)
        axes = tuple(a for a in sorted(spread) if a not in used)
        shards: Sequence[torch.Tensor | None] = x.shards
        if axes and x.requires_grad:
            shards = backend_for(mesh).diverge(shards, lay, axes,  # type: ignore[arg-type]
                                               owner=x.grad_owner)
        cols.append(shards)
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for k in range(mesh.num_devices):
        row = [c[k] for c in cols]
        if any(r is None for r in row):  # a device another process holds
            out.append(None)
            continue
        pos = where(mesh.coord_of(k))
        key = (pos, *map(id, row))
        r = memo.get(key)
        if r is None:
            r = memo[key] = fn(pos, *row)
        out.append(r)
    return Tensor(out, layout, tuple(shape), dtype)


def _plain(x: Tensor, dims: tuple[tuple[int, ...], ...]) -> Tensor:
    """``x`` laid out with ``dims`` and no Partial axes."""
    target = Layout(x.mesh, dims, (None,) * x.mesh.ndim)
    return relayout(x, target)


def _free(axes: tuple[int, ...], taken: set[int]) -> tuple[int, ...]:
    return tuple(a for a in axes if a not in taken)


def vocab_embedding(ids: torch.Tensor, weight: Tensor, padding_idx: int | None = None
                    ) -> Tensor:
    """``F.embedding(ids, weight)`` for a table sharded on its vocabulary dim: each
    device looks up the ids in its rows; the result is Partial(SUM) over those axes.

    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> table = shardwise.tensor(torch.arange(8.).reshape(4, 2),
    ...                          sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> out = vocab_embedding(torch.tensor([3, 0]), table)
    >>> out.placements, out.to_torch().tolist()
    ((Partial(reduce_op='sum'),), [[6.0, 7.0], [0.0, 1.0]])
    """
    if not isinstance(ids, Tensor):  # plain ids: the global value, Replicated
        ids = place(ids, Layout.replicated(weight.mesh, ids.ndim))
    vocab_axes, emb_axes = weight.dist_layout.dims
    if weight.dist_layout.is_partial:
        weight = _plain(weight, weight.dist_layout.dims)
    taken = set(vocab_axes) | set(emb_axes)
    ids = _plain(ids, tuple(_free(axes, taken) for axes in ids.dist_layout.dims))
    partial: list[ReduceOp | None] = [None] * ids.mesh.ndim
    for a in vocab_axes:
        partial[a] = ReduceOp.SUM
    layout = Layout(ids.mesh, (*ids.dist_layout.dims, emb_axes), tuple(partial))
    wlay, wshape = weight.dist_layout, tuple(weight.shape)

    def rows(coord: tuple[int, ...]) -> tuple[int, int]:
        return local_bounds(wshape, wlay, coord)[0]

    def lookup(span: tuple[int, int], i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lo, hi = span
        if hi == lo:  # an empty block of the vocabulary finds nothing
            return w.new_zeros((*i.shape, w.shape[1]))
        outside = (i < lo) | (i >= hi)
        pad = padding_idx % wshape[0] if padding_idx is not None else None
        local_pad = pad - lo if pad is not None and lo <= pad < hi else None
        found = F.embedding((i - lo).masked_fill(outside, 0), w, local_pad)
        return found.masked_fill(outside.unsqueeze(-1), 0.0)

    return blockwise(lookup, [ids, weight], layout, (*ids.shape, wshape[1]), weight.dtype,
                     rows, whole=(0, wshape[0]))


def check_targets(target: torch.Tensor, classes: int, ignore_index: int | None) -> None:
    """Raise torch's IndexError, naming the class count and the rule, unless every
    entry of ``target`` is a class index in ``[0, classes)`` or ``ignore_index``.

    >>> check_targets(torch.tensor([0, 2, -100]), 3, -100)
    >>> check_targets(torch.tensor([3]), 3, -100)
    Traceback (most recent call last):
    ...
    IndexError: cross_entropy: target 3 is out of bounds for 3 classes. ...
    """
    if target.is_meta or is_fake(target):
        return  # (no data to check: shardwise.estimate's fake step, a meta model)
    bad = (target < 0) | (target >= classes)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bool(bad.any()):
        raise IndexError(f"cross_entropy: target {int(target[bad][0])} is out of bounds for "
                         f"{classes} classes. Targets are class indices in "
                         f"[0, {classes}) or ignore_index ({ignore_index}).")


def pick_classes(logits: Tensor, target: torch.Tensor, ignore_index: int | None = None
                 ) -> Tensor:
    """``logits[i, target[i]]`` per row of (N, C) ``logits`` whose classes may be
    sharded: each device picks the targets in its classes; Partial(SUM) over the class
    axes. ``ignore_index`` targets pick 0; other targets outside ``[0, C)`` raise
    IndexError (as torch's cross_entropy).

    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> lg = shardwise.tensor(torch.arange(8.).reshape(2, 4),
    ...                       sharding=PlacementMapping(mesh, [Sharded(1)]))
    >>> pick_classes(lg, torch.tensor([3, 0])).to_torch().tolist()
    [3.0, 4.0]
    """
    if logits.ndim != 2:
        raise ShardingError(f"pick_classes takes (N, C) logits. Got shape "
                            f"{list(logits.shape)}; flatten the leading dims first.")
    rows, classes = logits.dist_layout.dims
    logits = _plain(logits, (rows, classes))
    if not isinstance(target, Tensor):
        target = place(target, Layout.replicated(logits.mesh, target.ndim))
    target = _plain(target, (rows,))
    partial: list[ReduceOp | None] = [None] * logits.mesh.ndim
    for a in classes:
        partial[a] = ReduceOp.SUM
    layout = Layout(logits.mesh, (rows,), tuple(partial))
    lay, shape = logits.dist_layout, tuple(logits.shape)

    def span(coord: tuple[int, ...]) -> tuple[int, int]:
        return local_bounds(shape, lay, coord)[1]

    def pick(cols: tuple[int, int], z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        lo, hi = cols
        check_targets(t, shape[1], ignore_index)
        if hi == lo:  # an empty block of classes picks nothing
            return z.new_zeros(z.shape[:1])
        local = t - lo
        inside = (local >= 0) & (local < hi - lo)
        got = z.gather(1, local.clamp(0, hi - lo - 1).unsqueeze(1)).squeeze(1)
        return got.masked_fill(~inside, 0.0)

    return blockwise(pick, [logits, target], layout, shape[:1], logits.dtype, span,
                     whole=(0, shape[1]))
