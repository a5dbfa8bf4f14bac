"""Moving a Tensor's value between layouts: plans run on its blocks, and kept results.

:class:`RelayoutMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) changes a
value's layout through the planner and keeps, per value, the layouts ops asked for;
the module functions cut a global value into a layout's blocks and run plans,
counting their collectives for :class:`~shardwise.debug.CommCounter`.

Invariants:
- A layout change of a value held as blocks runs a :class:`Plan` (one mesh) on the
  mesh's backend; of a value holding its whole (``_whole``), it is metadata only,
  but its collectives are still counted (``record_plan``, ``_whole_as``), as if the
  blocks had moved.
- ``_cut`` gives the blocks of a whole as views of it for the layout's dims, and for
  Partial axes the canonical decomposition (the value at coordinate 0, the reduce
  op's identity elsewhere; MIN/MAX/AVG: the value everywhere); nothing is counted.
- Kept results (``_reused``, ``_whole_as``) live in the source Tensor's ``__dict__``,
  keyed by target layout and grad mode; an in-place write to either tensor (a bumped
  version counter, ``shard_versions``) makes an entry stale; leaves that require grad keep
  nothing (their relayout belongs to one step's graph); ops get them, users never do
  (two public relayouts give two tensors a user may write separately).
- Nothing here imports :mod:`shardwise.tensors.tensor`: new Tensors are built as
  ``type(self)(...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch

from shardwise.planner import Plan, backward_steps, diverge_step, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.meta import MetaMixin

__all__ = ["RelayoutMixin", "record_plan", "run_plan", "shard_versions"]

_REPLICATED: dict[tuple[int, int], tuple[DeviceMesh, Layout]] = {}


def _replicated(mesh: DeviceMesh, ndim: int) -> Layout:
    """``Layout.replicated(mesh, ndim)``, cached by mesh identity (the mesh is kept)."""
    hit = _REPLICATED.get((id(mesh), ndim))
    if hit is None:
        hit = _REPLICATED[(id(mesh), ndim)] = (mesh, Layout.replicated(mesh, ndim))
    return hit[1]


_LOCAL: dict[tuple[int, torch.device], tuple[DeviceMesh, bool]] = {}
_DIST = torch.distributed.is_available()


def _local_mesh(mesh: DeviceMesh, device: torch.device) -> bool:
    """Whether this process alone holds every device of ``mesh``, all on torch
    ``device``. Never in a process world (torch.distributed initialized): other
    processes may take part in ``mesh``'s collectives (a one-device mesh held here is
    still broadcast to them), so every process runs the ops block by block alike."""
    if _DIST and torch.distributed.is_initialized():
        return False
    hit = _LOCAL.get((id(mesh), device))
    if hit is None:
        backend = backend_for(mesh)
        ok = len(backend.owned(mesh)) == mesh.num_devices and all(
            backend.device_of(mesh, k) == device for k in range(mesh.num_devices))
        hit = _LOCAL[(id(mesh), device)] = (mesh, ok)
    return hit[1]


def _cut(whole: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The blocks of ``whole`` (the global value) that ``layout`` gives each device;
    Partial axes get the canonical decomposition (the planner's make_partial steps,
    local: nothing is counted as communication)."""
    mesh = layout.mesh
    shape = tuple(whole.shape)
    backend = backend_for(mesh)
    if layout.is_partial:
        plain = layout.with_partial((None,) * mesh.ndim)
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


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (0 for an inference tensor, which has none and is
    never written under autograd)."""
    return 0 if t.is_inference() else int(t._version)


def shard_versions(shards: Sequence[torch.Tensor | None], uniq: Sequence[int] | None = None
                   ) -> int:
    """The sum of the distinct local buffers' version counters: any in-place write
    to one of them (or to a view of it) changes it."""
    if uniq is None:
        seen: set[int] = set()
        total = 0
        for s in shards:
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                total += s._version
        return total
    return sum(int(shards[k]._version) for k in uniq)  # type: ignore[union-attr,misc]


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
    """Layout changes of a Tensor's value and the results kept for ops (module doc)."""

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

    def _whole_as(self, target: Layout, diverge: tuple[int, ...] = (),
                  view: torch.Tensor | None = None) -> torch.Tensor:
        """The whole value as an op's operand that needs layout ``target`` (and, for its
        gradient, a sum over the ``diverge`` axes): the layout change is metadata, but
        its collectives are counted as :meth:`_reused` would run them, once per value
        (kept like ``_reused``'s results: the same operand for every later op, so one
        backward hook sees the summed gradient; leaves keep nothing), from the
        cheapest layout already reached. ``view``: an identity view of the whole that
        the op already used (the hook goes there, e.g. a bias inside addmm)."""
        whole = self._whole
        assert whole is not None
        layout = self._layout
        if not diverge and (target is layout or target == layout):
            return whole
        grad = torch.is_grad_enabled()
        leaf = whole.requires_grad and whole.grad_fn is None
        memo: dict[Any, Any] | None = None if leaf else self.__dict__.setdefault("_wreuse", {})
        key = (target, diverge, grad)
        if memo is not None:
            hit = memo.get(key)
            if hit is not None and hit[0] is whole and hit[1] == _version(whole):
                return hit[2]
        out = whole
        if comm.active():
            source = layout
            plan = make_plan(layout, target, self._shape, self._dtype.itemsize)
            for lay in self._whole_kept() if memo else ():
                other = make_plan(lay, target, self._shape, self._dtype.itemsize)
                if other.bytes_per_device < plan.bytes_per_device:
                    source, plan = lay, other
            where = comm.source_line()
            for step in plan.collectives:
                comm.record(step.kind, step.bytes_per_device, step, where=where)
            back = tuple(backward_steps(plan)) if source is layout else ()
            if diverge:
                back += (diverge_step(target, self._shape, self._dtype.itemsize, diverge),)
            if back and grad and whole.requires_grad:
                # its own node: the hook sees this use's gradient
                out = whole.view_as(whole) if view is None else view
                comm.on_backward([out], back, where)
        if memo is not None:
            memo[key] = (whole, _version(whole), out)
        return out

    def _whole_kept(self) -> tuple[Layout, ...]:
        """The layouts :meth:`_whole_as` reached for this value (grad mode alike)."""
        memo = self.__dict__.get("_wreuse")
        if not memo:
            return ()
        whole, grad = self._whole, torch.is_grad_enabled()
        return tuple(lay for (lay, div, g), (w, ver, _) in memo.items()
                     if g == grad and not div and w is whole and whole is not None
                     and ver == _version(whole))

    def _reused(self, target: Layout) -> Self:
        """:meth:`relayout` for an op's operand, done once per value: the result is
        kept on this tensor (keyed by ``target`` and grad mode) and every later use
        gets the same Tensor, so a Partial read by several ops is reduced once and
        autograd sums their gradients through one node. Built from the cheapest kept
        layout (e.g. an all_gather of a kept reduce_scatter instead of a second
        all_reduce). An in-place write to either tensor (a bumped ``_version``)
        drops the entry; leaves that require grad keep nothing (their relayout
        belongs to one step's graph). Never returned to users: ops only."""
        if target == self._layout:
            return self
        shards = self._shards
        uniq = self._unique()
        first = shards[uniq[0]] if uniq else None
        if first is not None and first.requires_grad and first.grad_fn is None:
            return self.relayout(target)
        memo: dict[Any, Any] | None = self.__dict__.get("_reuse")
        if memo is None:
            memo = self.__dict__["_reuse"] = {}
        grad = torch.is_grad_enabled()
        layout, version = self._layout, shard_versions(shards, uniq)

        def fresh(entry: tuple[Any, ...]) -> bool:
            src, lay, ver, kept, kept_ver = entry
            return (src is shards and lay is layout and ver == version
                    and kept_ver == shard_versions(kept._shards))

        hit = memo.get((target, grad))
        if hit is not None and fresh(hit):
            return hit[3]
        source, cost = self, self.plan_to(target).bytes_per_device
        for (lay, g), entry in list(memo.items()):
            kept = entry[3]
            if not fresh(entry):
                del memo[(lay, g)]  # written in place since: stale
            elif g == grad:
                c = kept.plan_to(target).bytes_per_device
                if c < cost:
                    source, cost = kept, c
        out = source.relayout(target)
        memo[(target, grad)] = (shards, layout, version, out, shard_versions(out._shards))
        return out

    def _kept_layouts(self) -> tuple[Layout, ...]:
        """The layouts :meth:`_reused` holds for this value now (grad mode alike): ops
        price them as free and plan from them."""
        memo = self.__dict__.get("_reuse")
        if not memo:
            return ()
        shards = self._shards
        grad = torch.is_grad_enabled()
        version = shard_versions(shards, self._unique())
        return tuple(lay for (lay, g), (src, src_lay, ver, kept, kept_ver) in memo.items()
                     if g == grad and src is shards and src_lay is self._layout
                     and ver == version and kept_ver == shard_versions(kept._shards))

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
        cached = self.__dict__.get("_uniq")
        if cached is not None and cached[0] is shards:
            return cached[1]
        reps: list[int] = []
        seen: set[int] = set()
        for k, s in enumerate(shards):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                reps.append(k)
        out = tuple(reps)
        self.__dict__["_uniq"] = (shards, out)
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
