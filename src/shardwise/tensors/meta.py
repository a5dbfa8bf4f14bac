"""What a Tensor says about itself: its fields, torch's metadata and the mesh view.

:class:`MetaMixin` is the lowest base of :class:`shardwise.tensors.tensor.Tensor`: it declares
the fields every Tensor holds and answers every question about them without running
an op (torch metadata, layout, mesh, shards).

Invariants:
- ``shape``/``dtype``/``ndim``/``device`` are the global value's, read from the
  wrapper's own fields: no trip through ``__torch_function__`` (a few µs each
  otherwise). ``layout`` is torch's (always ``torch.strided``); shardwise's is
  :attr:`~MetaMixin.dist_layout`.
- ``shards``/``local()`` hand out the local buffers themselves (shared by replicas,
  possibly views of a larger buffer): read them, never write them.
- Nothing here builds a Tensor or imports :mod:`shardwise.tensors.tensor` (which derives
  from this class); the mixin never subclasses ``torch.Tensor``, and comes before it
  in ``Tensor``'s bases so that these properties override torch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch

from shardwise.runtime.local import Local
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.devices import Device
from shardwise.sharding.errors import ConversionError, ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, NamedMapping, PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement
from shardwise.sharding.shapes import local_shape
from shardwise.sharding.types import DistributedTensorType
from shardwise.tensors.cache import OperandCache

__all__ = ["MetaMixin"]


class MetaMixin:
    """The fields of a Tensor and the read-only views of them (see the module doc)."""

    # Declared here for the mixins, stored in the slots Tensor declares (slots on a
    # base beside torch.Tensor would conflict with its instance layout).
    # What this process holds of the value, as the runtime holds it (its blocks, or
    # the simulated runtime's whole value): :mod:`shardwise.runtime.local`.
    _local: Local
    _layout: Layout
    _shape: tuple[int, ...]
    _size: torch.Size
    _dtype: torch.dtype
    _open: tuple[bool, ...] | None
    _device: torch.device
    # What the value keeps (slots, never the instance dict): the operands ops moved it
    # to, the ``.grad`` Tensor last shown (for the gradients it names), and the record
    # of who sums its gradient over which mesh axes (set once by its producer).
    _cache: OperandCache | None
    _grad_view: tuple[tuple[torch.Tensor | None, ...], Any] | None
    _grad_owner: GradOwner | None

    if TYPE_CHECKING:  # defined by Tensor; the mixins build Tensors through type(self)
        def __new__(cls, shards: Sequence[torch.Tensor | None], layout: Layout,
                    shape: Sequence[int], dtype: torch.dtype | None = None, *,
                    open_dims: tuple[bool, ...] | None = None) -> Self: ...

        @classmethod
        def from_whole(cls, whole: torch.Tensor, layout: Layout,
                       open_dims: tuple[bool, ...] | None = None) -> Self: ...

        @classmethod
        def from_held(cls, local: Local, layout: Layout, size: torch.Size,
                      dtype: torch.dtype, device: torch.device,
                      open_dims: tuple[bool, ...] | None,
                      shape: tuple[int, ...] | None = None) -> Self: ...

    # --- open / closed dims (sharding propagation) -------------------------------------
    @property
    def open_dims(self) -> tuple[bool, ...]:
        """Per dim: True when compute ops may reshard it freely (open), False when
        they change its sharding only if unavoidable (closed). Dims are closed when
        the Tensor was made from a ShardingSpec whose DimSpec is closed; every
        other Tensor (other sharding forms, results of ops) has open dims."""
        return (True,) * len(self._shape) if self._open is None else self._open

    # --- inspection -----------------------------------------------------------------
    # Python-level overrides of torch's metadata: they answer from the wrapper's own
    # fields without a trip through __torch_function__ (a few µs each otherwise).
    @property
    def shape(self) -> torch.Size:
        return self._size

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None) -> Any:
        return self._size if dim is None else self._size[dim]

    def numel(self) -> int:
        return math.prod(self._shape)

    def is_complex(self) -> bool:
        return self._dtype.is_complex

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    @property
    def is_sparse(self) -> bool:
        return False

    nelement = numel

    def data_ptr(self) -> int:
        """0: the wrapper has no storage of its own (its shards do), as for torch's
        other storage-less wrapper tensors; DCP's stager then copies the shards."""
        return 0

    @property
    def layout(self) -> torch.layout:
        """torch's memory layout (always ``torch.strided``); shardwise's is :attr:`dist_layout`."""
        return torch.strided

    @property
    def device(self) -> torch.device:
        """The torch device of the local shards (``cpu`` on a simulated CPU mesh); the
        mesh is :attr:`mesh`, a single device's shardwise device :attr:`dist_device`."""
        return self._device

    @property
    def dist_layout(self) -> Layout:
        """The canonical layout (mesh, per-dim mesh axes, Partial ops)."""
        return self._layout

    @property
    def mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._layout.to_placements()

    @property
    def sharding(self) -> DeviceMapping:
        """A PlacementMapping when the layout has one, else a NamedMapping."""
        try:
            return PlacementMapping(self.mesh, self._layout.to_placements())
        except ConversionError:
            return NamedMapping.from_layout(self._layout)

    @property
    def dist_device(self) -> Device:
        """The shardwise device of a single-device tensor (``CPU(0)``)."""
        mesh = self.mesh
        if not mesh.is_single:
            raise ShardingError(
                f"{self!r} lives on {mesh.num_devices} devices, so it has no single .dist_device. "
                "Use .mesh.devices, .sharding, or gather it with to_device(x, device)."
            )
        return mesh.devices[0]

    @property
    def held(self) -> Local:
        """What this process holds of the value, as the runtime holds it (a
        :class:`~shardwise.runtime.local.Local`: its blocks, or the simulated runtime's
        whole value): shardwise's own modules read it (buffers, blocks); never write it.

        >>> x = shardwise.tensor(torch.ones(4), sharding=PlacementMapping(
        ...     DeviceMesh.cpu(2, "x"), [Sharded(0)]))
        >>> [tuple(b.shape) for b in x.held.blocks]
        [(2,), (2,)]
        """
        return self._local

    @property
    def grad_owner(self) -> GradOwner | None:
        """Who sums this value's gradient over which mesh axes itself (a ``fully_shard``
        unit's gathered parameter), or None: set once, by the value's producer."""
        return self._grad_owner

    @grad_owner.setter
    def grad_owner(self, owner: GradOwner) -> None:
        assert self._grad_owner is None, "a value's gradient owner is set once"
        self._grad_owner = owner

    @property
    def _shards(self) -> tuple[torch.Tensor, ...]:
        """Per-device local tensors (None where another process holds the device)."""
        return self._local.blocks  # type: ignore[return-value]

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """Per-device local tensors, row-major over the mesh (shared buffers: read only)."""
        return self._local.blocks  # type: ignore[return-value]

    def local(self, device: Any) -> torch.Tensor:
        """The local tensor ``device`` holds (shares memory with the Tensor: read only)."""
        shard = self._shards[self.mesh.device_index(device)]
        if shard is None:
            raise ShardingError(
                f"{device!r} is owned by another process, so its shard of {self!r} is not "
                "addressable here. Use .addressable_shards or .to_torch()."
            )
        return shard

    @property
    def addressable_shards(self) -> dict[Any, torch.Tensor]:
        """``{device: local tensor}`` for the devices this process holds."""
        return {d: s for d, s in zip(self.mesh.devices, self._shards) if s is not None}

    @property
    def local_shapes(self) -> list[tuple[int, ...]]:
        mesh = self.mesh
        return [local_shape(self._shape, self._layout, mesh.coord_of(k))
                for k in range(mesh.num_devices)]

    @property
    def dist_type(self) -> DistributedTensorType:
        """The symbolic type of this tensor (no data)."""
        return DistributedTensorType(self._dtype, self._shape, self.mesh, self.placements)
