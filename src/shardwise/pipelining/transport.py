"""How activations and their gradients travel between pipeline stages.

The executor (:mod:`shardwise.pipelining.executor`) calls ``send`` right after a stage's
forward (or backward) when the receiving stage is held by another pipeline rank, and
``recv`` right before the receiving stage's forward (or backward). A ``value`` is a
pytree (tuple/list/dict) of shardwise Tensors, torch tensors, None and Python scalars;
``tag`` is ``"F<mb>"`` (the activation of microbatch ``mb``) or ``"B<mb>"`` (its
gradient).

Invariants:
- ``recv`` returns a value detached from the sender's autograd graph (tensors that
  required grad require grad again, as leaves): each stage's backward is its own, as
  torch's stages are.
- A shardwise Tensor arrives with its layout, on the receiving stage's mesh (the same
  ``(dp, tp)`` coordinates: :func:`~shardwise.tensors.tensor.rehome`).
- :class:`SimTransport` (every stage in this process) is a mailbox: ``recv`` of a
  message never sent raises (the executor only receives what was sent), never waits.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from shardwise.runtime import holds_whole
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.tensor import Tensor, rehome

__all__ = ["SimTransport", "Transport", "detached", "transport_for"]


class Transport(Protocol):
    """The seam between the executor and a runtime's point-to-point exchange."""

    def send(self, value: Any, src_stage: int, dst_stage: int, tag: str) -> None: ...

    def recv(self, src_stage: int, dst_stage: int, tag: str) -> Any: ...


def detached(value: Any, mesh: DeviceMesh | None = None) -> Any:
    """``value`` cut from autograd: each tensor detached (on ``mesh`` when given, for
    shardwise Tensors), and made a leaf that requires grad where it required grad."""

    def one(x: Any) -> Any:
        y: torch.Tensor
        if isinstance(x, Tensor):
            y = rehome(x, mesh) if mesh is not None and x.mesh != mesh else x.detach()
        elif isinstance(x, torch.Tensor):
            y = x.detach()
        else:
            return x
        return y.requires_grad_(True) if x.requires_grad else y

    return pytree.tree_map(one, value)


class SimTransport:
    """Every stage in this process: a message is the sender's value, handed over
    detached and moved onto the receiving stage's mesh."""

    def __init__(self, meshes: list[DeviceMesh]) -> None:
        self._meshes = meshes
        self._box: dict[tuple[int, int, str], Any] = {}

    def send(self, value: Any, src_stage: int, dst_stage: int, tag: str) -> None:
        key = (src_stage, dst_stage, tag)
        if key in self._box:
            raise ShardingError(
                f"Pipeline message {tag} from stage {src_stage} to stage {dst_stage} was "
                "sent twice before it was received: the schedule runs an action twice.")
        self._box[key] = value

    def recv(self, src_stage: int, dst_stage: int, tag: str) -> Any:
        try:
            value = self._box.pop((src_stage, dst_stage, tag))
        except KeyError:
            raise ShardingError(
                f"Pipeline stage {dst_stage} receives {tag} from stage {src_stage}, which "
                "was never sent: the schedule runs an action before the one it needs.") \
                from None
        return detached(value, self._meshes[dst_stage])

    def pending(self) -> list[tuple[int, int, str]]:
        """Messages sent and not received (none after a complete step)."""
        return list(self._box)


def transport_for(meshes: list[DeviceMesh]) -> Transport:
    """The transport for stages on ``meshes`` (one per stage): :class:`SimTransport`
    where this process holds every stage's devices (the simulated mesh), else the
    process backend's point-to-point transport."""
    if all(holds_whole(m) for m in meshes):
        return SimTransport(meshes)
    from shardwise.pipelining import transport_process

    return transport_process.ProcessTransport(meshes)
