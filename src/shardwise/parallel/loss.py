"""Loss parallel: ``F.cross_entropy`` over class-sharded logits without gathering them.

Inside ``with loss_parallel():``, ``F.cross_entropy(logits, target)`` with (N, C)
logits whose class dim is Sharded (a column-parallel head with
``output_layouts=Sharded(-1)``) computes, per row::

    m   = max over classes            (local max, all_reduce MAX of N numbers)
    s   = sum over classes exp(x - m) \\
    x_t = logit of the target         -  one all_reduce SUM of 2N numbers (3N with
    x_s = sum over classes of x - m   /  label smoothing); x_t from the owning shard
    loss = log s - (x_t - m)          (smoothed: (1-e)(...) + e(log s - x_s / C))

so each device holds only its N x C/n logits. Anything else (plain tensors, classes
whole, class weights, more than 2 dims) takes the ordinary path, with the same values.

Invariants:
- The result equals ``F.cross_entropy`` of the global logits (up to rounding):
  ``ignore_index`` rows count 0 and are left out of the mean; ``reduction`` and
  ``label_smoothing`` as torch.
- Gradients flow through the same ops (torch's autograd on the blocks); the max is
  detached (it cancels in the loss).
- Where logits and target hold whole values (a mesh this process holds wholly) the
  per-row losses are torch's own kernel run once on the wholes, laid out and counted
  as the block computation (the same collectives, bytes and result layout).
- Inside the outermost block the registry's ``F.cross_entropy`` handler is this
  module's (the registry's own is restored on leaving it; it runs everything that
  is not class-sharded). No other torch function pays for the block, and calls
  without a shardwise Tensor never reach the handler.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.parallel.blocks import check_targets, pick_classes
from shardwise.parallel.placing import relayout
from shardwise.planner import make_plan
from shardwise.runtime import observe
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.tensors import cache
from shardwise.tensors import tensor as core
from shardwise.tensors.tensor import Tensor, place

__all__ = ["loss_parallel"]


def _class_sharded(logits: Any, target: Any, weight: Any, size_average: Any, reduce: Any
                   ) -> bool:
    return (isinstance(logits, Tensor) and logits.ndim == 2 and bool(logits.dist_layout.dims[1])
            and weight is None and size_average is None and reduce is None
            and isinstance(target, torch.Tensor) and target.ndim == 1
            and not target.dtype.is_floating_point)


def _cross_entropy(logits: Any, target: Any, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> Any:
    if not _class_sharded(logits, target, weight, size_average, reduce):
        return _ordinary(logits, target, weight, size_average, ignore_index, reduce,
                         reduction, label_smoothing)
    x: Tensor = logits
    rows, classes = x.dist_layout.dims
    if x.dist_layout.is_partial:  # a nonlinear loss needs the value itself
        x = relayout(x, Layout(x.mesh, (rows, classes), (None,) * x.mesh.ndim))
    if not isinstance(target, Tensor):
        target = place(target, Layout.replicated(x.mesh, 1))
    if cache.runs_whole((x, target)):
        per = _per_row_whole(x, target, ignore_index, label_smoothing)
    else:
        m = torch.amax(x.detach(), dim=1, keepdim=True)   # Partial(MAX): reduced by the sub
        z: Tensor = x - m  # type: ignore[assignment]  # the registry returns a Tensor
        parts = [torch.exp(z).sum(1), pick_classes(z, target, ignore_index)]
        if label_smoothing:
            parts.append(z.sum(1))
        # every part is Partial(SUM) over the class axes: one all_reduce for all of them
        stacked: Tensor = torch.stack(parts)  # type: ignore[assignment]
        both = relayout(stacked, Layout(x.mesh, ((), rows), (None,) * x.mesh.ndim))
        lse = torch.log(both[0])
        per = lse - both[1]
        if label_smoothing:
            smooth = lse - both[2] / x.shape[1]
            per = per * (1.0 - label_smoothing) + smooth * label_smoothing
    valid = target != ignore_index
    per = torch.where(valid, per, 0.0)
    if reduction == "none":
        return per
    total = per.sum()
    if reduction == "sum":
        return total
    return total / valid.to(per.dtype).sum()


def _per_row_whole(x: Tensor, target: Tensor, ignore_index: int, label_smoothing: float
                   ) -> Any:
    """The per-row losses where logits and target hold whole values (a mesh this
    process holds wholly): torch's own kernel once on the wholes, laid out and counted
    as the block computation (the row max's all_reduce MAX, the parts' all_reduce SUM)."""
    t, w, shape = cache.whole_of(target), cache.whole_of(x), tuple(x.shape)
    assert t is not None and w is not None
    check_targets(t, shape[1], ignore_index)
    mesh, (rows, classes) = x.mesh, x.dist_layout.dims
    none = (None,) * mesh.ndim
    if observe.active():
        itemsize = x.dtype.itemsize
        for op, src, dst, size in (
                (ReduceOp.MAX, (rows, ()), (rows, ()), (shape[0], 1)),
                (ReduceOp.SUM, ((), rows), ((), rows), (3 if label_smoothing else 2,
                                                        shape[0]))):
            partial = tuple(op if a in classes else None for a in range(mesh.ndim))
            plan = make_plan(Layout(mesh, src, partial), Layout(mesh, dst, none), size,
                             itemsize)
            for step in plan.collectives:
                observe.record(step.kind, step.bytes_per_device, step)
    per = F.cross_entropy(w, t, ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    return Tensor.from_whole(per, Layout(mesh, (rows,), none))


_DEPTH = [0]  # open loss_parallel() blocks
_ORDINARY: list[Any] = []  # the registry's own F.cross_entropy handler while one is open


def _routed(*args: Any, **kwargs: Any) -> Any:
    """The registry's F.cross_entropy handler inside ``loss_parallel()``."""
    return _cross_entropy(*args, **kwargs)


def _ordinary(*args: Any, **kwargs: Any) -> Any:
    handler = _ORDINARY[0] if _ORDINARY else None
    if handler is None:  # no handler of its own: the registry's gathered fallback
        return core.FALLBACK[0](F.cross_entropy, args, kwargs)
    return handler(*args, **kwargs)


def _install() -> None:
    """Route F.cross_entropy on shardwise Tensors to :func:`_cross_entropy` (as DTensor's
    loss_parallel installs its custom op handlers): only that call pays, where a
    TorchFunctionMode would add a Python call to every torch function in the block."""
    if not core.FALLBACK:  # the registry fills the handlers on its first use
        importlib.import_module(core.REGISTRY)
    _ORDINARY[:] = [core.HANDLERS.get(F.cross_entropy)]
    core.HANDLERS[F.cross_entropy] = _routed


def _uninstall() -> None:
    ordinary = _ORDINARY.pop()
    if ordinary is None:
        core.HANDLERS.pop(F.cross_entropy, None)
    else:
        core.HANDLERS[F.cross_entropy] = ordinary


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside the block, ``F.cross_entropy`` over logits whose class dim is sharded
    keeps them sharded: each device works on its classes and only per-row numbers are
    reduced (DTensor's ``loss_parallel``; ``nn.CrossEntropyLoss`` calls the same
    function). Give the head ``ColwiseParallel(output_layouts=Sharded(-1))``. Unlike
    DTensor, ``backward()`` may run outside the block: the gradient is recorded on the
    blocks by the forward.

    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> logits = torch.randn(6, 8)
    >>> target = torch.tensor([0, 7, 3, 4, 1, 2])
    >>> x = shardwise.tensor(logits, sharding=PlacementMapping(mesh, [Sharded(1)]))
    >>> with loss_parallel(), shardwise.debug.CommCounter() as cc:
    ...     loss = F.cross_entropy(x, target)
    >>> torch.allclose(loss.to_torch(), F.cross_entropy(logits, target))
    True
    >>> dict(cc.counts)          # max, then sum-exp and target logits together
    {'all_reduce': 2}
    """
    if _DEPTH[0] == 0:
        _install()
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            _uninstall()
