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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardwise.parallel.blocks import pick_classes
from shardwise.parallel.placing import relayout
from shardwise.sharding.layout import Layout
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
        return F.cross_entropy(logits, target, weight, size_average, ignore_index, reduce,
                               reduction, label_smoothing)
    x: Tensor = logits
    rows, classes = x.dist_layout.dims
    if x.dist_layout.is_partial:  # a nonlinear loss needs the value itself
        x = relayout(x, Layout(x.mesh, (rows, classes), (None,) * x.mesh.ndim))
    if not isinstance(target, Tensor):
        target = place(target, Layout.replicated(x.mesh, 1))
    m = torch.amax(x.detach(), dim=1, keepdim=True)   # Partial(MAX): reduced by the sub
    z: Tensor = x - m  # type: ignore[assignment]  # the registry returns a shardwise Tensor
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


class _LossParallel(TorchFunctionMode):
    """Routes ``F.cross_entropy`` to the class-sharded computation; every other torch
    function runs as usual (the mode is off inside its own handler)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is F.cross_entropy:
            return _cross_entropy(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


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
    with _LossParallel():
        yield
