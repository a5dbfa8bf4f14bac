"""Gradient clipping across pipeline stages, whose parameters live on different meshes.

Invariants:
- The norm is the global one: that of every stage's gradients together, as
  ``torch.nn.utils.clip_grad_norm_`` on the unsplit model computes it. Each mesh's
  gradients are normed by torch's own ``get_total_norm`` (a shardwise Tensor's norm
  is its global value's), the per-mesh norms are combined on the host, and under
  torchrun the pipeline ranks' shares are reduced over the ``pp`` axis of
  ``pipe.mesh`` (each process holds only its stages).
- Every gradient is scaled in place by ``min(1, max_norm / (norm + 1e-6))``, torch's
  coefficient; the returned norm is a plain torch scalar, equal on every process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.pipelining.stage import Pipe
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mappings import PlacementMapping
from shardwise.sharding.placements import Partial, Placement, ReduceOp, Replicated
from shardwise.tensors.tensor import Tensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, pipe: Pipe | None = None, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters on several meshes (the
    stages of a pipeline): clips by the global norm of all their gradients.

    Args:
        parameters: the parameters (of every local stage: ``pipe.parameters()``).
        max_norm: the largest norm the gradients keep.
        norm_type: the p of the p-norm (``float('inf')`` for the max norm).
        pipe: the pipeline; required under torchrun (an error without it), where each
            process holds only its stages' gradients and the norm is reduced over
            ``pipe.mesh``'s pp axis by every process (a collective: call it on all).
        error_if_nonfinite: raise if the norm is nan or inf, as torch's.

    Returns:
        the global norm (a plain torch scalar) before clipping.

    >>> mesh = DeviceMesh.cpu((2, 1), ("pp", "tp"))
    >>> a = shardwise.tensor(torch.tensor([3.0]), sharding=PlacementMapping(
    ...     mesh.submesh(pp=0), [Replicated()]), requires_grad=True)
    >>> b = shardwise.tensor(torch.tensor([4.0]), sharding=PlacementMapping(
    ...     mesh.submesh(pp=1), [Replicated()]), requires_grad=True)
    >>> (a * a / 2).sum().backward(); (b * b / 2).sum().backward()
    >>> float(clip_grad_norm_([a, b], 1.0)), round(float(b.grad.to_torch()), 4)
    (5.0, 0.8)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.mesh if isinstance(g, Tensor) else None, []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False)
        norms.append(n.to_torch() if isinstance(n, Tensor) else n)
    if norms:
        total = torch.nn.utils.get_total_norm(norms, norm_type).to(torch.float32)
    else:
        total = torch.tensor(0.0)
    if pipe is None and torch.distributed.is_available() and \
            torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ShardingError(
            "clip_grad_norm_ in a multi-process run needs the pipeline: each process holds "
            "only its stages' gradients, so the norm is reduced over the pp axis. Pass "
            "pipe=pipe (the Pipe from shardwise.pipelining.pipeline).")
    if pipe is not None and len(pipe.local_stages) < pipe.n_stages:
        total = _over_pp(total, pipe, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise ShardingError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{float(total)}, so they cannot be clipped. Pass error_if_nonfinite=False to "
            "clip anyway (as torch does), or find the nan/inf gradient.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(float(coef))
    return total


def _over_pp(total: torch.Tensor, pipe: Pipe, norm_type: float) -> torch.Tensor:
    """This process's share of the norm, reduced with the other pipeline ranks'."""
    from shardwise.api.creation import from_local

    mesh = pipe.mesh
    a = mesh.axis_names.index(pipe.axis)
    inf = norm_type == float("inf")
    share = total if inf else total ** norm_type
    place: list[Placement] = [Replicated()] * mesh.ndim
    place[a] = Partial(ReduceOp.MAX if inf else ReduceOp.SUM)
    # every device of this process's stage holds the share; the Partial axis sums them
    owned = set(_owned(mesh))
    shares = [share.reshape(1) if k in owned else None for k in range(mesh.num_devices)]
    reduced = from_local(shares, PlacementMapping(mesh, tuple(place)), shape=(1,)).to_torch()[0]
    return reduced if inf else reduced ** (1.0 / norm_type)


def _owned(mesh: Any) -> list[int]:
    from shardwise.runtime import backend_for

    return list(backend_for(mesh).owned(mesh))
