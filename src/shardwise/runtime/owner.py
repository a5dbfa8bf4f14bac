"""Who sums a value's gradient over which mesh axes: one record, read by the runtime
and by the counters alike.

An operand replicated over mesh axes that its op's output is not gets only a share
of its gradient on each device; the backend's ``diverge`` sums the shares
(all_reduce in backward). A producer that sums them itself (a ``fully_shard`` unit:
one reduce_scatter per flat buffer) says so once, with a :class:`GradOwner` on the
value it makes.

Invariants:
- One record per value, set once by its producer when it makes the value (the
  Tensor's ``_grad_owner`` slot; None everywhere else) and never changed: frozen.
- ``axes``: the mesh axes whose gradient the owner sums. ``diverge`` over them
  neither all_reduces (the process backend hands this process's share to the owner
  through ``hand_off``) nor is counted as an all_reduce (CommCounter sees the
  owner's own collective); the other axes diverge as usual.
- ``hand_off`` is None where no process needs it (a mesh this process holds wholly:
  replicas share one buffer, so autograd already sums the shares).
- The record holds no Tensor (floor 2 knows none): only axes and a function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GradOwner"]


@dataclass(frozen=True, slots=True)
class GradOwner:
    """The mesh ``axes`` over which a value's producer sums its gradient itself, and
    ``hand_off(k, block)``: device ``k``'s block as an identity whose gradient goes
    to the producer (the multi-process route), or None.

    >>> owner = GradOwner((0,))
    >>> owner.others((0, 1)), owner.others((1,))
    ((1,), (1,))
    """

    axes: tuple[int, ...]
    hand_off: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    def others(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """The axes of ``axes`` left to ``diverge`` (not summed by the owner)."""
        return tuple(a for a in axes if a not in self.axes)
