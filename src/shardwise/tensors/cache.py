"""The operand cache: the layouts ops moved a value to, kept for the next op.

An op asks this module for each operand in the layout its rule chose
(:mod:`shardwise.ops.execute`): :func:`blocks` (the per-device blocks, through the
backend's ``diverge`` where the gradient must be summed over replicas),
:func:`whole` (the global value of a Tensor that holds it: the layout change is
metadata, its collectives counted) or :func:`relayout` (a Tensor: ``item()``,
backward's roots); and for the layouts an operand already reached
(:func:`kept_layouts`), which ``decide`` prices as free. So a Partial read by three
ops is reduced once and autograd sums their gradients through one node, and q, k
and v reading one value share one ``diverge`` (one all_reduce of the gradient).

Invariants:
- One cache per value, an :class:`OperandCache` in the Tensor's ``_cache`` slot (no
  global table): kept results die with their source. Kept results go to ops only,
  never to users (two public relayouts give two tensors a user may write separately).
- Two kinds, one table each: a value held as blocks keeps Tensors (and diverged
  blocks), a value held whole (``_whole``) keeps torch tensors; one Tensor holding
  its whole may meet both (an operand beside one held as blocks). In each, entries
  are keyed by (target layout, diverge axes, grad mode): one kept under ``no_grad``
  never serves with grad.
- Staleness, one rule: an entry serves while its source (the value's blocks tuple,
  or its whole) is the same object in the same layout at the same version (the sum
  of its distinct buffers' version counters), and the kept result is at the version
  it was stored at (its buffers that are neither the source's own nor views of the
  whole: the source's version already shows writes to those). An in-place write to
  either, new shards (``.data =``) or a new whole (``requires_grad_``) make it stale;
  stale entries are dropped where met and never revive (versions only grow).
- Leaf rule, one rule: a source that is an autograd leaf requiring grad (a
  parameter: its whole, or its first distinct block) keeps nothing and plans from
  nothing kept, so each use moves (and counts) afresh: its relayout belongs to one
  step's graph, and the optimizer's step makes it stale anyway.
- Cheapest source: a new layout is reached from the value's own layout or any fresh
  kept one of the same kind and grad mode (no diverge), whichever moves fewer bytes:
  a Partial reduce_scattered for one op is all_gathered for the next, never reduced
  twice.
- Counting for CommCounter (:mod:`shardwise.runtime.observe`), once per entry: a
  block relayout counts in ``run_plan``; a whole counts the plan a block-by-block run
  would make, and via a hook on an identity view its backward transposes and the
  diverge's all_reduce; a block diverge announces its all_reduce on identity views.
  Axes whose gradient the value's :class:`~shardwise.runtime.owner.GradOwner` sums
  itself are left out of the all_reduce and of its count. Identity views exist only
  while counting.
- A value held as blocks, without Partial axes, on a mesh this process holds wholly
  (:func:`local_mesh`) has a *derived whole* for compute ops (:func:`whole_of`),
  kept in the cache's ``derived`` slot under the staleness and leaf rules above:
  the blocks' one buffer seen whole (a view: a Replicated block, or blocks that tile
  one buffer, :func:`~shardwise.runtime.blocks.tiling_view`) or, where none exists
  or autograd must reach each block, a copy (the runtime's gather; differentiable
  into every distinct block once). Blocks that are leaves requiring grad (from
  ``requires_grad=True``) derive none: each use would copy afresh (the leaf rule), so
  their ops run on the blocks. A copy is read, never written, and an op whose
  result aliases it (a view) runs on the blocks instead (:func:`aliases_copy`): a
  view of a value aliases its blocks, as torch's views do. ``_whole`` stays the
  value's own (in-place ops, ``requires_grad_``, gradients read it); the derived
  whole never is.
- Below every other module of ``tensors/``: it knows a Tensor only by the fields and
  methods of :class:`Operand`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Protocol, Self, TypeVar

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, backward_steps, diverge_step, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.runtime.blocks import recording, tiling_view
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.layout import Layout

__all__ = ["COPY_BYTES", "Operand", "OperandCache", "aliases_copy", "blocks", "kept_layouts",
           "local_mesh", "relayout", "shard_versions", "whole", "whole_of"]

Key = tuple[Layout, tuple[int, ...], bool]
"""(target layout, diverge axes, grad mode)."""

_VERSION = operator.attrgetter("_version")  # a torch tensor's version counter


class _Entry:
    """One kept operand: its source when stored (object, layout, version), the kept
    result, the result's buffers that are not the source's own (``watched``) and the
    sum of their versions then."""

    __slots__ = ("kept", "kept_version", "layout", "source", "version", "watched")

    def __init__(self, source: object, layout: Layout, version: int, kept: Any,
                 watched: tuple[torch.Tensor, ...]) -> None:
        self.source, self.layout, self.version = source, layout, version
        self.kept, self.watched = kept, watched
        self.kept_version = sum(map(_VERSION, watched))

    def fresh(self, source: object, layout: Layout, version: int) -> bool:
        """The staleness rule (module doc)."""
        return (self.source is source and self.layout is layout and self.version == version
                and (not self.watched
                     or sum(map(_VERSION, self.watched)) == self.kept_version))


class OperandCache:
    """One value's kept operands: ``blocks`` (held as blocks) and ``wholes`` (held
    whole), each keyed by (target layout, diverge axes, grad mode); ``derived``: the
    derived whole of a value held as blocks (its ``kept`` is ``(whole, is_copy)``),
    or None."""

    __slots__ = ("blocks", "derived", "wholes")

    def __init__(self) -> None:
        self.blocks: dict[Key, _Entry] = {}
        self.wholes: dict[Key, _Entry] = {}
        self.derived: _Entry | None = None


class Operand(Protocol):
    """What this module reads of a Tensor (:class:`~shardwise.tensors.tensor.Tensor`)."""

    _layout: Layout
    _shape: tuple[int, ...]
    _dtype: torch.dtype
    _device: torch.device
    _blocks: tuple[torch.Tensor, ...] | None
    _whole: torch.Tensor | None
    _cache: OperandCache | None
    _grad_owner: GradOwner | None

    @property
    def _shards(self) -> tuple[torch.Tensor, ...]: ...

    def _unique(self) -> tuple[int, ...]: ...

    def relayout(self, target: Layout) -> Self: ...

    def plan_to(self, target: Layout) -> Plan: ...


T = TypeVar("T", bound=Operand)


def shard_versions(shards: Sequence[torch.Tensor | None], uniq: Sequence[int] | None = None
                   ) -> int:
    """The sum of the distinct local buffers' version counters (``uniq``: their
    indices, when known): any in-place write to one of them (or to a view of it)
    changes it.

    >>> a = torch.zeros(2)
    >>> before = shard_versions([a, a])
    >>> _ = a[:1].add_(1)
    >>> shard_versions([a, a]) - before
    1
    """
    if uniq is None:
        return sum(map(_VERSION, _distinct(shards)))
    return sum([shards[k]._version for k in uniq])  # type: ignore[union-attr,misc]


def _distinct(blocks: Sequence[torch.Tensor | None], own: Sequence[torch.Tensor | None] = ()
              ) -> tuple[torch.Tensor, ...]:
    """The distinct buffers among ``blocks`` (replicas share one), in order, less
    those in ``own``."""
    skip = {id(s) for s in own}
    seen: dict[int, torch.Tensor] = {}
    for s in blocks:
        if s is not None and id(s) not in skip:
            seen.setdefault(id(s), s)
    return tuple(seen.values())


def _whole_version(w: torch.Tensor) -> int:
    """A whole value's version counter (0 for an inference tensor, which has none and
    is never written under autograd)."""
    return 0 if w.is_inference() else int(w._version)


def _block_source(x: Operand) -> tuple[tuple[torch.Tensor, ...], int, bool]:
    """``x``'s blocks, their version and whether they are a leaf requiring grad."""
    shards = x._shards
    uniq = x._unique()
    first = shards[uniq[0]] if uniq else None
    if first is not None and first.requires_grad and first.grad_fn is None:
        return shards, 0, True
    return shards, shard_versions(shards, uniq), False


def _plain(table: dict[Key, _Entry], grad: bool) -> list[tuple[Layout, _Entry]]:
    """The entries without diverge kept in ``grad`` mode, fresh or not."""
    return [(key[0], entry) for key, entry in table.items() if key[2] == grad and not key[1]]


def _prune(table: dict[Key, _Entry], source: object, layout: Layout, version: int) -> None:
    """Drop the stale entries (they never revive: versions only grow)."""
    for key in [k for k, e in table.items() if not e.fresh(source, layout, version)]:
        del table[key]


def _table(x: Operand, held_whole: bool) -> dict[Key, _Entry]:
    cache = x._cache
    if cache is None:
        cache = x._cache = OperandCache()
    return cache.wholes if held_whole else cache.blocks


def kept_layouts(operands: Sequence[Operand | None], held_whole: bool
                 ) -> tuple[tuple[Layout, ...], ...]:
    """Per operand (None: a constant), the layouts it holds kept now for an op on
    blocks (``held_whole`` False) or on whole values (True) in the current grad mode:
    ops price them as free and plan from them. ``()`` when none holds any."""
    out: list[tuple[Layout, ...]] | None = None
    grad = torch.is_grad_enabled()
    for i, x in enumerate(operands):
        cache = None if x is None else x._cache
        if cache is None:
            continue
        assert x is not None
        lays: list[Layout] = []
        source: object = None
        version = 0
        for (lay, div, g), entry in (cache.wholes if held_whole else cache.blocks).items():
            if div or g != grad:
                continue
            if source is None:  # read the source's version once, only when needed
                if held_whole:
                    w = whole_of(x)
                    assert w is not None
                    source, version = w, _whole_version(w)
                else:
                    source, version, _ = _block_source(x)
            if entry.fresh(source, x._layout, version):
                lays.append(lay)
        if lays:
            if out is None:
                out = [()] * len(operands)
            out[i] = tuple(lays)
    return () if out is None else tuple(out)


def relayout(x: T, target: Layout) -> T:
    """``x.relayout(target)`` for an op's operand, done once per value: every later
    op gets the same Tensor, planned from the cheapest layout kept.

    >>> from shardwise.tensors.tensor import place
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> p = place(torch.ones(4), Layout(mesh, ((),), (ReduceOp.SUM,)))
    >>> rep = Layout.replicated(mesh, 1)
    >>> relayout(p, rep) is relayout(p, rep), relayout(p, rep).to_torch().tolist()
    (True, [1.0, 1.0, 1.0, 1.0])
    """
    layout = x._layout
    if target is layout or target == layout:
        return x
    shards, version, leaf = _block_source(x)
    if leaf:
        return x.relayout(target)
    table = _table(x, False)
    grad = torch.is_grad_enabled()
    key = (target, (), grad)
    if table:
        hit = table.get(key)
        if hit is not None and hit.fresh(shards, layout, version):
            return hit.kept
        _prune(table, shards, layout, version)
    source, cost = x, x.plan_to(target).bytes_per_device
    for _, entry in _plain(table, grad):
        c = entry.kept.plan_to(target).bytes_per_device
        if c < cost:
            source, cost = entry.kept, c
    out = source.relayout(target)
    table[key] = _Entry(shards, layout, version, out, _distinct(out._shards, shards))
    return out


def blocks(x: Operand, target: Layout, diverge: tuple[int, ...] = ()
           ) -> Sequence[torch.Tensor | None]:
    """``x``'s blocks in layout ``target`` for an op, through the backend's
    ``diverge`` over ``diverge`` (the op's output is split where ``x`` is replicated:
    its gradient is summed over those axes), once per value: every op reading ``x``
    shares one diverge, so the gradient's all_reduce runs once on the summed
    gradient."""
    if not diverge:
        return x._shards if target is x._layout else relayout(x, target)._shards
    shards, version, leaf = _block_source(x)
    layout = x._layout
    grad = torch.is_grad_enabled()
    key = (target, diverge, grad)
    cache = x._cache
    if not leaf and cache is not None:
        hit = cache.blocks.get(key)
        if hit is not None and hit.fresh(shards, layout, version):
            return hit.kept
    t = relayout(x, target)
    tb = t._shards
    uniq = t._unique()
    owner = t._grad_owner
    out: Sequence[torch.Tensor | None] = backend_for(target.mesh).diverge(
        tb, target, diverge, owner=owner)
    first = tb[uniq[0]] if uniq else None
    if grad and first is not None and first.requires_grad and comm.active():
        axes = owner.others(diverge) if owner is not None else diverge
        if axes:
            out = _announced(out, diverge_step(target, t._shape, t._dtype.itemsize, axes))
    if not leaf:
        _table(x, False)[key] = _Entry(shards, layout, version, out, _distinct(out, shards))
    return out


def _announced(out: Sequence[torch.Tensor | None], step: Any) -> list[torch.Tensor | None]:
    """``out`` with the gradient's all_reduce (``step``) announced to the CommCounter,
    hung on identity views of its own (the simulated diverge is the identity: the
    replicas share one buffer, which other uses of the value also read)."""
    views: dict[int, torch.Tensor] = {}
    hooked = [None if s is None else views.setdefault(id(s), s.view_as(s)) for s in out]
    comm.on_backward(hooked, (step,), comm.source_line())
    return hooked


def whole(x: Operand, target: Layout, diverge: tuple[int, ...] = (),
          view: torch.Tensor | None = None) -> torch.Tensor:
    """The whole value of ``x`` as an op's operand that needs layout ``target`` (and,
    for its gradient, a sum over the ``diverge`` axes): the layout change is metadata,
    but its collectives are counted as :func:`relayout` would run them, once per
    value, from the cheapest layout kept (the same operand for every later op, so one
    backward hook sees the summed gradient). ``view``: an identity view of the whole
    that the op already used (the hook goes there, e.g. a bias inside addmm)."""
    w = x._whole if x._whole is not None else whole_of(x)
    assert w is not None
    layout = x._layout
    if not diverge and (target is layout or target == layout):
        return w
    grad = torch.is_grad_enabled()
    key = (target, diverge, grad)
    leaf = w.requires_grad and w.grad_fn is None
    version = _whole_version(w)
    table = None if leaf else _table(x, True)
    if table:
        hit = table.get(key)
        if hit is not None and hit.fresh(w, layout, version):
            return hit.kept
        _prune(table, w, layout, version)
    out = w
    if comm.active():
        shape, itemsize = x._shape, x._dtype.itemsize
        source = layout
        plan = make_plan(layout, target, shape, itemsize)
        for lay, _ in _plain(table, grad) if table else ():
            other = make_plan(lay, target, shape, itemsize)
            if other.bytes_per_device < plan.bytes_per_device:
                source, plan = lay, other
        where = comm.source_line()
        for step in plan.collectives:
            comm.record(step.kind, step.bytes_per_device, step, where=where)
        back = tuple(backward_steps(plan)) if source is layout else ()
        owner = x._grad_owner
        axes = owner.others(diverge) if owner is not None else diverge
        if axes:
            back += (diverge_step(target, shape, itemsize, axes),)
        if back and grad and w.requires_grad:
            # its own node: the hook sees this use's gradient
            out = w.view_as(w) if view is None else view
            comm.on_backward([out], back, where)
    if table is not None:  # (a view of the whole shares its version: watch nothing more)
        table[key] = _Entry(w, layout, version, out, ())
    return out


# --- the derived whole of a value held as blocks ---------------------------------------
_LOCAL: dict[tuple[int, torch.device], tuple[Any, bool]] = {}
_DIST = torch.distributed.is_available()


def local_mesh(mesh: Any, device: torch.device) -> bool:
    """Whether this process alone holds every device of ``mesh`` (a DeviceMesh), all
    on torch ``device``. Never in a process world (torch.distributed initialized):
    other processes may take part in ``mesh``'s collectives (a one-device mesh held
    here is still broadcast to them), so every process runs the ops block by block
    alike."""
    if _DIST and torch.distributed.is_initialized():
        return False
    hit = _LOCAL.get((id(mesh), device))
    if hit is None:
        backend = backend_for(mesh)
        ok = len(backend.owned(mesh)) == mesh.num_devices and all(
            backend.device_of(mesh, k) == device for k in range(mesh.num_devices))
        hit = _LOCAL[(id(mesh), device)] = (mesh, ok)
    return hit[1]


COPY_BYTES = 1 << 18
"""Derived wholes that copy are made for values of at most this many bytes: there an
op's per-block torch calls (~1-3 us each) cost more than the copy; above it they are
a small share of the op, and a copy would cost a pass over the bytes and keep a second
copy of the value alive."""


def whole_of(x: Operand, copy: bool = True) -> torch.Tensor | None:
    """``x``'s whole value for a compute op: its own ``_whole``, else its derived
    whole (module doc), else None (Partial axes, blocks on other devices or
    processes, blocks that are autograd leaves requiring grad, or a copy where
    ``copy`` is False or the value is above :data:`COPY_BYTES`). A derived whole is
    made once per value and kept while the blocks are unchanged.

    >>> from shardwise.tensors.tensor import Tensor
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> lay = Layout(mesh, ((0,),), (None,))
    >>> g = torch.arange(4.)
    >>> whole_of(Tensor(list(g.chunk(2)), lay, (4,))).data_ptr() == g.data_ptr()  # a view
    True
    >>> t = Tensor([torch.zeros(2), torch.ones(2)], lay, (4,))
    >>> whole_of(t).tolist(), aliases_copy(t, whole_of(t))
    ([0.0, 0.0, 1.0, 1.0], True)
    """
    w = x._whole
    if w is not None:
        return w
    cache = x._cache
    entry = None if cache is None else cache.derived
    blocks = x._blocks
    if (entry is not None and blocks is not None and entry.source is blocks
            and entry.layout is x._layout):
        # kept: a view serves while the blocks tuple is the same (writes show through
        # it), a copy while their version is too; either only in the autograd mode it
        # was made in, and while the blocks are no leaf requiring grad
        w, copied, grad, level, first, uniq = entry.kept
        if (grad is torch.is_grad_enabled() and level == fwAD._current_level
                and not (first is not None and first.requires_grad and first.grad_fn is None)
                and (not copied or entry.version == shard_versions(blocks, uniq))):
            return w if copy or not copied else None
    layout = x._layout
    if layout.is_partial or not local_mesh(layout.mesh, x._device):
        return None  # (a process world's values pay only this check)
    shards = x._shards
    uniq = x._unique()
    first = shards[uniq[0]] if uniq else None
    if first is not None and first.requires_grad and first.grad_fn is None:
        return None  # (the leaf rule: each use would copy afresh; its blocks run the op)
    version = shard_versions(shards, uniq)
    w, copied = _derive(shards, uniq, layout, x._shape, x._dtype.itemsize)
    if cache is None:
        cache = x._cache = OperandCache()
    cache.derived = _Entry(shards, layout, version, (
        w, copied, torch.is_grad_enabled(), fwAD._current_level, first, uniq), ())
    return w if copy or not copied else None


def _derive(shards: tuple[torch.Tensor, ...], uniq: tuple[int, ...], layout: Layout,
            shape: tuple[int, ...], itemsize: int) -> tuple[torch.Tensor | None, bool]:
    """(the whole, whether it is a copy) of blocks ``shards`` in ``layout`` (no
    Partial axes); the whole is None when this process does not hold them all on one
    device or the copy would be above :data:`COPY_BYTES`."""
    if not uniq or len(uniq) != len(set(layout.representatives())):
        return None, False  # (a device without its block: never on a mesh held wholly)
    first = shards[uniq[0]]
    if len(uniq) == 1 and tuple(first.shape) == shape:
        return first, False  # Replicated: the one buffer is the whole
    if not recording([shards[k] for k in uniq]):
        view = tiling_view(shards, layout, shape)
        if view is not None:
            return view, False
    if math.prod(shape) * itemsize > COPY_BYTES:
        return None, False
    full = Layout.replicated(layout.mesh, len(shape))
    return backend_for(layout.mesh).assemble(shards, layout, full, shape)[0], True


def aliases_copy(x: Operand, result: torch.Tensor) -> bool:
    """Whether ``result`` (an op's output) is, or is a view of, ``x``'s derived whole
    when that whole is a copy of the blocks: then the op runs on the blocks instead,
    so that its result aliases them (module doc)."""
    if x._whole is not None:
        return False
    cache = x._cache
    entry = None if cache is None else cache.derived
    if entry is None or not entry.kept[1]:
        return False
    w = entry.kept[0]
    return result is w or result._base is w
