"""Moving a Tensor's value between layouts: plans run on its blocks.

:class:`RelayoutMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) changes a
value's layout through the planner; the module functions cut a global value into a
layout's blocks and run plans, counting their collectives for
:class:`~shardwise.debug.CommCounter`. The layouts ops asked for are kept by
:mod:`shardwise.tensors.cache`, not here.

Invariants:
- A layout change of a value held as blocks runs a :class:`Plan` (one mesh) on the
  mesh's backend; of a value holding its whole (``_whole``), it is metadata only,
  but its collectives are still counted (``record_plan``, ``cache.whole``), as if the
  blocks had moved.
- ``_cut`` gives the blocks of a whole as views of it for the layout's dims, and for
  Partial axes the canonical decomposition (the value at coordinate 0, the reduce
  op's identity elsewhere; MIN/MAX/AVG: the value everywhere); nothing is counted.
- :meth:`~RelayoutMixin.relayout` to another layout gives a new Tensor every call:
  two public relayouts give two tensors a user may write separately (ops' kept
  relayouts are :mod:`shardwise.tensors.cache`'s, never handed to users).
- Nothing here imports :mod:`shardwise.tensors.tensor`: new Tensors are built as
  ``type(self)(...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch

from shardwise.planner import Plan, backward_steps, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.meta import MetaMixin

__all__ = ["RelayoutMixin", "record_plan", "run_plan"]

_REPLICATED: dict[tuple[int, int], tuple[DeviceMesh, Layout]] = {}


def _replicated(mesh: DeviceMesh, ndim: int) -> Layout:
    """``Layout.replicated(mesh, ndim)``, cached by mesh identity (the mesh is kept)."""
    hit = _REPLICATED.get((id(mesh), ndim))
    if hit is None:
        hit = _REPLICATED[(id(mesh), ndim)] = (mesh, Layout.replicated(mesh, ndim))
    return hit[1]


def _cut(whole: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The blocks of ``whole`` (the global value) that ``layout`` gives each device;
    Partial axes get the canonical decomposition (the planner's make_partial steps,
    local: nothing is counted as communication)."""
    mesh = layout.mesh
    shape = tuple(whole.shape)
    backend = backend_for(mesh)
    if layout.is_partial:
        plain = layout.without_partial()
        plan = make_plan(plain, layout, shape, whole.dtype.itemsize)
        return tuple(backend.execute_plan(plan, _cut(whole, plain)))
    return tuple(backend.assemble([whole] * mesh.num_devices, _replicated(mesh, len(shape)),
                                  layout, shape))


def record_plan(plan: Plan) -> None:
    """Count ``plan``'s collectives for :class:`~shardwise.debug.CommCounter` without
    running them (a layout change of a Tensor that keeps its whole value)."""
    if comm.active():
        for step in plan.collectives:
            comm.record(step.kind, step.bytes_per_device, step)


def run_plan(mesh: DeviceMesh, plan: Plan, shards: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
    """Execute ``plan`` on ``mesh``'s backend, counting its collectives (and, when a
    gradient is recorded, its gradient's) for :class:`~shardwise.debug.CommCounter`."""
    if not comm.active():
        return backend_for(mesh).execute_plan(plan, shards)
    where = comm.source_line()
    for step in plan.collectives:
        comm.record(step.kind, step.bytes_per_device, step, where=where)
    out = backend_for(mesh).execute_plan(plan, shards)
    comm.on_backward(out, backward_steps(plan), where)
    return out


class RelayoutMixin(MetaMixin):
    """Layout changes of a Tensor's value (module doc)."""

    def _global(self) -> torch.Tensor:
        """The global value as one torch tensor (differentiable; may alias a shard)."""
        target = Layout.replicated(self.mesh, self.ndim)
        if self._whole is not None:
            if self._layout != target:
                record_plan(self.plan_to(target))
            return self._whole
        full = self if self._layout == target else self.relayout(target)
        return backend_for(self.mesh).global_value(full._shards, full._layout, full._shape,
                                                    full._dtype)

    def relayout(self, target: Layout) -> Self:
        """This value in layout ``target`` (same mesh), through the planner."""
        if target == self._layout:
            return self
        shards = run_plan(self.mesh, self.plan_to(target), self._shards)
        return type(self)(shards, target, self._shape, self._dtype)

    def plan_to(self, target: Layout) -> Plan:
        if target.mesh != self.mesh:
            raise ShardingError(
                f"Cannot plan from {self.mesh!r} to {target.mesh!r}: a plan stays on one mesh. "
                "Use to_device(x, sharding=...) to move between meshes."
            )
        return make_plan(self._layout, target, self._shape, self._dtype.itemsize)

    def unique_shards(self) -> tuple[list[int], list[torch.Tensor]]:
        """Representative device indices and their (distinct) local tensors."""
        reps = list(self._unique())
        return reps, [self._shards[k] for k in reps]

    def _unique(self) -> tuple[int, ...]:
        """Indices of the first device holding each distinct local tensor (cached)."""
        shards = self._shards
        cached = self._uniq
        if cached is not None and cached[0] is shards:
            return cached[1]
        reps: list[int] = []
        seen: set[int] = set()
        for k, s in enumerate(shards):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                reps.append(k)
        out = tuple(reps)
        self._uniq = (shards, out)
        return out

    def _map_unique(self, fn: Any, layout: Layout | None = None) -> Self:
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
        return type(self)(out, layout, self._shape, None if present else self._dtype,
                          open_dims=self._open)
