"""The distributed Tensor: one global value laid out on a device mesh.

Invariants:
- A Tensor has a global ``shape`` and ``dtype``, a :class:`Layout` (mesh +
  where each dim and each Partial axis lives) and one local ``torch.Tensor``
  per mesh device (row-major). A single-device tensor is a one-device mesh.
- The global value is defined by the layout: sharded dims concatenate their
  shards (split rule of :mod:`shardwise.sharding.shapes`), replicated axes hold
  equal copies, Partial axes hold values whose reduction is the global value.
- Values are immutable: no shardwise op mutates a Tensor or its shards, so
  replicas share one buffer and shards may be views of a larger buffer.
  ``local()``/``shards`` expose those buffers: read them, never write them.
- Gradients: ``.grad`` is in the tensor's own layout; the Partial(SUM) axes of
  a tensor hold equal gradients and come back Replicated, other Partial ops
  come back as per-device derivatives under Partial(SUM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.debug import comm
from shardwise.devices import Device
from shardwise.planner import Plan, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime.simulated import rep_indices
from shardwise.sharding.errors import ConversionError, ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, NamedMapping, PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement, ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.sharding.types import DistributedTensorType, dtype_name

__all__ = ["Tensor"]


class Tensor:
    """A global value laid out on a :class:`DeviceMesh`.

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> x = shardwise.tensor(torch.arange(8.).reshape(4, 2),
    ...                      sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
    >>> x
    Tensor(shape=(4, 2), dtype=float32, layout=DeviceMesh(dp=2, tp=2)[S(dp), R])

    ::

        device   (dp,tp)   local block
        CPU(0)   (0,0)     x[0:2]   (same buffer as CPU(1))
        CPU(1)   (0,1)     x[0:2]
        CPU(2)   (1,0)     x[2:4]   (same buffer as CPU(3))
        CPU(3)   (1,1)     x[2:4]
    """

    __slots__ = ("__weakref__", "_dtype", "_layout", "_open", "_shape", "_shards")

    def __init__(self, shards: Sequence[torch.Tensor | None], layout: Layout,
                 shape: Sequence[int], dtype: torch.dtype | None = None, *,
                 open_dims: tuple[bool, ...] | None = None) -> None:
        """Internal: build from per-device shards that already follow ``layout``
        (None for devices another process owns). Users build Tensors with
        ``shardwise.tensor``/``zeros``/``from_local``."""
        self._shards: tuple[torch.Tensor, ...] = tuple(shards)  # type: ignore[arg-type]
        self._layout = layout
        self._shape = tuple(shape)
        if dtype is None:
            dtype = next(s.dtype for s in self._shards if s is not None)
        self._dtype = dtype
        self._open = open_dims

    # --- open / closed dims (sharding propagation) -------------------------------------
    @property
    def open_dims(self) -> tuple[bool, ...]:
        """Per dim: True when compute ops may reshard it freely (open), False when
        they change its sharding only if unavoidable (closed). Dims are closed when
        the Tensor was made from a ShardingSpec whose DimSpec is closed; every
        other Tensor (other sharding forms, results of ops) has open dims."""
        return (True,) * len(self._shape) if self._open is None else self._open

    # --- inspection -----------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None) -> Any:
        return self._shape if dim is None else self._shape[dim]

    def numel(self) -> int:
        return math.prod(self._shape)

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
    def device(self) -> Device:
        """The device of a single-device tensor."""
        mesh = self.mesh
        if not mesh.is_single:
            raise ShardingError(
                f"{self!r} lives on {mesh.num_devices} devices, so it has no single .device. "
                "Use .mesh.devices, .sharding, or gather it with to_device(x, device)."
            )
        return mesh.devices[0]

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """Per-device local tensors, row-major over the mesh (shared buffers: read only)."""
        return self._shards

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
    def type(self) -> DistributedTensorType:
        """The symbolic type of this tensor (no data)."""
        return DistributedTensorType(self._dtype, self._shape, self.mesh, self.placements)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"Tensor(shape={self._shape}, dtype={dtype_name(self._dtype)}, "
                f"layout={self._layout}{grad})")

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d Tensor")
        return self._shape[0]

    # --- values -------------------------------------------------------------------------
    def _global(self) -> torch.Tensor:
        """The global value as one torch tensor (differentiable; may alias a shard)."""
        target = Layout.replicated(self.mesh, self.ndim)
        full = self if self._layout == target else self.relayout(target)
        return backend_for(self.mesh).global_value(full._shards, full._layout, full._shape,
                                                    full._dtype)

    def to_torch(self) -> torch.Tensor:
        """The global value as a new torch tensor (Partial axes reduced), on the
        first device of the mesh. Differentiable."""
        out = self._global()
        storages = {s.untyped_storage()._cdata for s in self._shards if s is not None}
        if out.untyped_storage()._cdata in storages:
            out = out.clone()
        return out

    def numpy(self) -> Any:
        return self.to_torch().detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.to_torch().tolist()

    def item(self) -> Any:
        return self._global().item()

    def relayout(self, target: Layout) -> Tensor:
        """This value in layout ``target`` (same mesh), through the planner."""
        if target == self._layout:
            return self
        shards = run_plan(self.mesh, self.plan_to(target), self._shards)
        return Tensor(shards, target, self._shape, self._dtype)

    def plan_to(self, target: Layout) -> Plan:
        if target.mesh != self.mesh:
            raise ShardingError(
                f"Cannot plan from {self.mesh!r} to {target.mesh!r}: a plan stays on one mesh. "
                "Use to_device(x, sharding=...) to move between meshes."
            )
        return make_plan(self._layout, target, self._shape, self._dtype.itemsize)

    def unique_shards(self) -> tuple[list[int], list[torch.Tensor]]:
        """Representative device indices and their (distinct) local tensors."""
        reps: list[int] = []
        seen: set[int] = set()
        for k, s in enumerate(self._shards):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                reps.append(k)
        return reps, [self._shards[k] for k in reps]

    def _map_unique(self, fn: Any, layout: Layout | None = None) -> Tensor:
        """Apply ``fn`` once per distinct local tensor, keeping the sharing pattern."""
        layout = layout or self._layout
        done: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        for s in self._shards:
            if s is None:
                out.append(None)
                continue
            r = done.get(id(s))
            if r is None:
                r = done[id(s)] = fn(s)
            out.append(r)
        present = any(o is not None for o in out)
        return Tensor(out, layout, self._shape, None if present else self._dtype,
                      open_dims=self._open)

    # --- autograd ----------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return any(s.requires_grad for s in self._shards if s is not None)

    @property
    def is_leaf(self) -> bool:
        return all(s.is_leaf for s in self._shards if s is not None)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Make this tensor a leaf that records gradients (in place on the flag only)."""
        if not self.is_leaf:
            raise ShardingError(
                "requires_grad_() is for leaf tensors; this one is the result of an op. "
                "Use x.detach().requires_grad_()."
            )
        for s in {id(s): s for s in self._shards if s is not None}.values():
            s.requires_grad_(requires_grad)
        return self

    def detach(self) -> Tensor:
        """The same value, cut from the autograd graph (shares memory)."""
        return self._map_unique(lambda s: s.detach())

    def _grad_layout(self) -> Layout:
        partial = tuple(
            None if op is None or op is ReduceOp.SUM else ReduceOp.SUM
            for op in self._layout.partial
        )
        return self._layout.with_partial(partial)

    def _wrap_grads(self, grads: dict[int, torch.Tensor | None]) -> Tensor:
        """Gradients keyed by id() of this tensor's shard objects -> a Tensor."""
        layout = self._grad_layout()
        reps = rep_indices(layout)
        zeros: dict[int, torch.Tensor] = {}
        owner: dict[int, int] = {}  # buffer id -> the one rep device its gradient lands on
        out: list[torch.Tensor | None] = []
        for k in range(len(self._shards)):
            if self._shards[k] is None:
                out.append(None)
                continue
            s = self._shards[reps[k]]
            if s is None:  # the representative lives in another process
                s = self._shards[k]
            # A buffer shared along a Partial axis (MIN/MAX/AVG hold the value on every
            # device) got one summed gradient: it lands once, the other devices get zeros,
            # so the Partial(SUM) gradient is not counted twice.
            first = owner.setdefault(id(s), reps[k])
            g = grads.get(id(s)) if first == reps[k] else None
            if g is None:
                g = zeros.get(id(s))
                if g is None:
                    g = zeros[id(s)] = torch.zeros_like(s)
            out.append(g)
        return Tensor(out, layout, self._shape, self._dtype)

    @property
    def grad(self) -> Tensor | None:
        """Accumulated gradient, in this tensor's layout; None before any backward."""
        if not any(s.grad is not None for s in self._shards if s is not None):
            return None
        return self._wrap_grads({id(s): s.grad for s in self._shards if s is not None})

    def _roots(self) -> Tensor:
        """This value with Partial axes reduced (the differentiable global)."""
        if not self._layout.is_partial:
            return self
        return self.relayout(self._layout.with_partial((None,) * self.mesh.ndim))

    def backward(self, gradient: Any = None) -> None:
        """Accumulate d(self)/d(leaf) into the ``.grad`` of every leaf it depends on."""
        if not self.requires_grad:
            raise ShardingError(
                f"backward() on {self!r}, which does not require grad: no leaf it depends on "
                "has requires_grad. Call x.requires_grad_() on the inputs first."
            )
        roots = self._roots()
        if gradient is None:
            if self._shape:
                raise ShardingError(
                    f"backward() without a gradient needs a scalar; {self!r} has shape "
                    f"{self._shape}. Pass gradient= (same global shape) or reduce first."
                )
            first = next(s for s in roots._shards if s is not None)
            gradient = torch.ones((), dtype=self._dtype, device=first.device)
        from shardwise.creation import as_layout_of

        g = as_layout_of(gradient, roots)
        reps, outs = roots.unique_shards()
        torch.autograd.backward(outs, [g._shards[k] for k in reps])


def run_plan(mesh: DeviceMesh, plan: Plan, shards: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
    """Execute ``plan`` on ``mesh``'s backend, counting its collectives for
    :class:`~shardwise.debug.CommCounter`."""
    if comm.active():
        for step in plan.collectives:
            comm.record(step.kind, step.bytes_per_device, step)
    return backend_for(mesh).execute_plan(plan, shards)


def with_open_dims(t: Tensor, sharding: object) -> Tensor:
    """``t`` with the open/closed dims ``sharding`` gives (a ShardingSpec's DimSpecs;
    any other form: all open). Shares ``t``'s shards; ``t`` itself is unchanged."""
    from shardwise.sharding.mappings import ShardingSpec

    want = sharding.open_dims if isinstance(sharding, ShardingSpec) else None
    if want is not None and all(want):
        want = None
    if want == t._open or (want is not None and len(want) != t.ndim):
        return t
    return Tensor(t._shards, t._layout, t._shape, t._dtype, open_dims=want)
