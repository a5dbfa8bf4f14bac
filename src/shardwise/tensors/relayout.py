"""Moving a Tensor's value between layouts: plans run on its blocks.

:class:`RelayoutMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) changes a
value's layout through the planner; the runtime moves what it holds
(``Local.moved``: a plan run on the blocks, or metadata for a value held whole, its
collectives still counted for :class:`~shardwise.debug.CommCounter`). The layouts
ops asked for are kept by :mod:`shardwise.tensors.cache`, not here.

Invariants:
- :meth:`~RelayoutMixin.relayout` runs the plan on the value's blocks (cut from a
  value held whole) and gives a new Tensor every call:
  two public relayouts give two tensors a user may write separately (ops' kept
  relayouts are :mod:`shardwise.tensors.cache`'s, never handed to users).
- A layout change between sequence orders (``Layout.orders``) goes through
  :func:`shardwise.tensors.ordering.reorder`; the planner only sees layouts without.
- Nothing here imports :mod:`shardwise.tensors.tensor`: new Tensors are built as
  ``type(self)(...)``.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from shardwise.planner import Plan, make_plan
from shardwise.runtime.local import Local, record_plan, run_plan
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors import ordering
from shardwise.tensors.meta import MetaMixin
from shardwise.tensors.symbolic import plan_of

__all__ = ["RelayoutMixin", "record_plan", "run_plan"]


class RelayoutMixin(MetaMixin):
    """Layout changes of a Tensor's value (module doc)."""

    def global_value(self) -> torch.Tensor:
        """The global value as one torch tensor (differentiable; may alias a shard: read
        it, or use :meth:`to_torch` for a copy of one's own)."""
        target = Layout.replicated(self.mesh, self.ndim)
        if self._layout.orders:  # natural order first (the held value is permuted)
            return ordering.reorder(self, target).global_value()
        local = self._local
        if target != self._layout:
            local = local.moved(self.plan_to(target), target)
        return local.global_value(target, self._shape, self._dtype)

    def relayout(self, target: Layout, *, keep_whole: bool = False) -> Self:
        """This value in layout ``target`` (same mesh), through the planner: a new
        Tensor whose blocks the plan made from this one's. ``keep_whole``: a value the
        runtime holds whole stays so (the move is metadata, its collectives counted as
        if they ran; the result shares the buffer), so ops keep running once on it."""
        if target == self._layout:
            return self
        if target.orders or self._layout.orders:
            return ordering.reorder(self, target, keep_whole)
        local = self._local if keep_whole else self._local.as_blocks()
        return self._held(local.moved(self.plan_to(target), target), target)

    def _held(self, local: Local, layout: Layout) -> Self:
        """A Tensor of this value's shape and dtype holding ``local`` in ``layout``."""
        return type(self).from_held(local, layout, self._size, self._dtype, self._device, None)

    def plan_to(self, target: Layout) -> Plan:
        if target.mesh != self.mesh:
            raise ShardingError(
                f"Cannot plan from {self.mesh!r} to {target.mesh!r}: a plan stays on one mesh. "
                "Use to_device(x, sharding=...) to move between meshes."
            )
        source = self._layout
        if source.orders or target.orders:  # (blocks are cut alike in every order)
            source, target = source.with_orders(()), target.with_orders(())
        try:
            return make_plan(source, target, self._shape, self._dtype.itemsize)
        except TypeError:  # symbolic sizes (tensors/symbolic.py)
            return plan_of(source, target, self._shape, self._dtype.itemsize)

    def unique_shards(self) -> tuple[list[int], list[torch.Tensor]]:
        """Representative device indices and their (distinct) local tensors."""
        reps = list(self._local.unique())
        blocks = self._local.blocks
        return reps, [blocks[k] for k in reps]  # type: ignore[misc]

    def _unique(self) -> tuple[int, ...]:
        """Indices of the first device holding each distinct local tensor."""
        return self._local.unique()

    def map_blocks(self, fn: Any, layout: Layout | None = None) -> Self:
        """Apply ``fn`` once per distinct local block, keeping the sharing pattern (a
        value held whole is cut into its blocks first: the result is held as blocks)."""
        layout = layout or self._layout
        local = self._local.as_blocks().map(fn, layout)
        first = local.first()
        return type(self).from_held(local, layout, self._size,
                                self._dtype if first is None else first.dtype,
                                self._device if first is None else first.device, self._open)

    def map_buffers(self, fn: Any, layout: Layout | None = None,
                     dtype: torch.dtype | None = None) -> Self:
        """Apply ``fn`` once per buffer this value is held in (its whole value, or each
        distinct block): elementwise functions (casts, clones, detaching), which keep
        a value held whole held whole. ``dtype``: the result's, where this process may
        hold none of it."""
        layout = layout or self._layout
        local = self._local.map(fn, layout)
        first = local.first()
        return type(self).from_held(local, layout, self._size,
                                (dtype or self._dtype) if first is None else first.dtype,
                                self._device if first is None else first.device, self._open)
