"""DTensor's names on a shardwise Tensor: ``device_mesh``, ``full_tensor()``,
``to_local()`` and ``redistribute()``, so code written against DTensor reads the same.

:class:`DTensorNamesMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) maps
each name to shardwise's own operation; nothing here has semantics of its own.

Invariants:
- ``redistribute`` takes shardwise placements and DTensor's (``Shard``,
  ``Replicate``, ``Partial``) alike, on the Tensor's own mesh, and is the relayout
  ``shardwise.shard`` runs (differentiable, counted by ``CommCounter``).
- ``to_local`` is the one block this process holds (differentiable, as DTensor's):
  on a simulated mesh, or with several devices per process, there is no single one,
  so it raises naming ``local(device)``, ``shards`` and ``addressable_shards``.
- ``full_tensor`` is ``to_torch``: the global value, Partial axes reduced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Partial, Placement, Replicated, Sharded
from shardwise.tensors.dtensor import our_placement
from shardwise.tensors.relayout import RelayoutMixin

__all__ = ["DTensorNamesMixin"]


class DTensorNamesMixin(RelayoutMixin):
    """DTensor's method names, each one shardwise operation (module doc)."""

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh this value is laid out on (DTensor's name for :attr:`mesh`)."""
        return self.mesh

    def full_tensor(self) -> torch.Tensor:
        """The global value as a torch tensor, Partial axes reduced (DTensor's name for
        :meth:`to_torch`). Differentiable.

        >>> import shardwise
        >>> from shardwise.sharding.mappings import PlacementMapping
        >>> mesh = DeviceMesh.cpu(2, "x")
        >>> x = shardwise.tensor(torch.arange(4.), sharding=PlacementMapping(mesh, [Sharded(0)]))
        >>> x.full_tensor().tolist()
        [0.0, 1.0, 2.0, 3.0]
        """
        return self.to_torch()  # type: ignore[attr-defined]

    def to_local(self) -> torch.Tensor:
        """The block of the value this process holds (DTensor's ``to_local``), sharing
        its memory; gradients flow back to this Tensor.

        One process per device (``torchrun``) holds exactly one block. A simulated
        mesh holds every device's, so it raises, naming ``local(device)``,
        ``shards`` and ``addressable_shards``::

            x = shardwise.tensor(torch.arange(4.), sharding=PlacementMapping(mesh, [Sharded(0)]))
            x.to_local()          # rank 0 of 2: tensor([0., 1.])
        """
        held = [s for s in self.shards if s is not None]
        if len(held) != 1:
            raise ShardingError(
                f"Cannot take to_local() of {self!r}: it returns the one block a process "
                f"holds, and this process holds {len(held)} of the "
                f"{self.mesh.num_devices} devices of {self.mesh!r} (a simulated mesh holds "
                "all). Use x.local(device) for one device's block, x.shards for every "
                "device's, or x.full_tensor() for the global value.")
        return held[0]

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Any] | None = None, *,
                     async_op: bool = False) -> Self:
        """This value with ``placements`` (one per mesh axis: shardwise's ``Sharded``,
        ``Replicated``, ``Partial`` or DTensor's ``Shard``, ``Replicate``,
        ``Partial``) on the same mesh: DTensor's ``redistribute``, the relayout
        ``shardwise.shard`` runs. Differentiable. ``async_op`` is accepted for
        DTensor's signature; shardwise's collectives complete before it returns.

        >>> import shardwise
        >>> from shardwise.sharding.mappings import PlacementMapping
        >>> from torch.distributed.tensor import Replicate
        >>> mesh = DeviceMesh.cpu(2, "x")
        >>> x = shardwise.tensor(torch.arange(4.), sharding=PlacementMapping(mesh, [Sharded(0)]))
        >>> x.redistribute(mesh, [Replicate()])
        Tensor(shape=(4,), dtype=float32, layout=DeviceMesh(x=2)[R])
        """
        del async_op
        mesh = self.mesh if device_mesh is None else device_mesh
        if mesh != self.mesh:
            raise ShardingError(
                f"Cannot redistribute {self!r} to {mesh!r}: redistribute keeps the mesh "
                f"(DTensor's rule too). Use shardwise.to_device(x, sharding=...) to move "
                "it to another mesh.")
        if placements is None:
            raise ShardingError(
                f"redistribute of {self!r} needs placements: one per mesh axis of "
                f"{mesh!r}, e.g. [Replicate()] * {mesh.ndim}.")
        given = list(placements)
        if len(given) != mesh.ndim:
            raise ShardingError(
                f"Cannot redistribute {self!r} with {len(given)} placements {given}: "
                f"{mesh!r} has {mesh.ndim} axes; give one placement per axis.")
        ours: tuple[Placement, ...] = tuple(
            p if isinstance(p, (Sharded, Replicated, Partial)) else our_placement(p)
            for p in given)
        target = Layout.from_placements(mesh, ours, self.ndim)
        return self.relayout(target)
