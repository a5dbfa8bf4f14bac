"""The operand cache: the layouts ops moved a value to, kept for the next op.

An op asks for each operand in the layout its rule chose, as its runtime runs it
(:class:`Columns`, which the backend's ``run_local`` reads): :func:`blocks` (the
per-device blocks, through the backend's ``diverge`` where the gradient must be
summed over replicas) or :func:`whole` (the global value in one buffer, where the
runtime runs the op once on whole values: the layout change is metadata, its
collectives counted); :func:`relayout` gives a kept Tensor (``item()``, backward's
roots). The layouts an operand already reached (:func:`kept_layouts`) are priced as
free by ``decide``. So a Partial read by three ops is reduced once and autograd sums
their gradients through one node, and q, k and v reading one value share one
``diverge`` (one all_reduce of the gradient).

Invariants:
- One cache per value, an :class:`OperandCache` in the Tensor's ``_cache`` slot (no
  global table): kept results die with their source. Kept results go to ops only,
  never to users (two public relayouts give two tensors a user may write separately).
- One table of kept Tensors, keyed by (target layout, diverge axes, grad mode, whole
  request): one kept under ``no_grad`` never serves with grad, and a whole request
  (the runtime runs the op on whole values) keeps apart from a block request.
- Staleness, one rule: an entry serves while the value holds the same
  :class:`~shardwise.runtime.local.Local` in the same layout at the same version,
  and the kept result is at the version it was stored at (its buffers that are not
  the source's own). An in-place write to either, new contents (``.data =``,
  ``requires_grad_``) make it stale; stale entries are dropped where met and never
  revive (versions only grow).
- Leaf rule, one rule: a source that is an autograd leaf requiring grad (a
  parameter) keeps nothing and plans from nothing kept, so each use moves (and
  counts) afresh: its relayout belongs to one step's graph, and the optimizer's step
  makes it stale anyway.
- Cheapest source: a new layout is reached from the value's own layout or any fresh
  kept one of the same request and grad mode (no diverge), whichever moves fewer
  bytes: a Partial reduce_scattered for one op is all_gathered for the next, never
  reduced twice.
- Counting for CommCounter (:mod:`shardwise.runtime.observe`) happens where the
  runtime moves the value (``Local.moved``), once per entry.
- Below every other module of ``tensors/``: it knows a Tensor only by the fields and
  methods of :class:`Operand`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, Self, TypeVar

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, make_plan
from shardwise.propagation.binding import Factors
from shardwise.propagation.decide import Decision, decide
from shardwise.runtime import observe as comm
from shardwise.runtime.local import COPY_BYTES, Local, Whole, local_mesh, versions
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.layout import Layout
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.symbolic import hinted, pinned_factors, plan_of

__all__ = ["COPY_BYTES", "Decided", "Operand", "OperandCache", "aliases_copy", "blocks",
           "kept_layouts", "local_mesh", "relayout", "runs_whole", "whole", "whole_of"]

Key = tuple[Layout, tuple[int, ...], bool, bool]
"""(target layout, diverge axes, grad mode, whole request)."""


class _Entry:
    """One kept operand: its source when stored (Local, layout, version), the kept
    Local (and the Tensor over it, once :func:`relayout` asked for one), the kept
    Local's buffers that are not the source's own (``watched``) and the sum of their
    versions then."""

    __slots__ = ("kept", "kept_version", "layout", "source", "tensor", "version", "watched")

    def __init__(self, source: Local, layout: Layout, version: int, kept: Local) -> None:
        self.source, self.layout, self.version, self.kept = source, layout, version, kept
        self.tensor: Any = None
        own = {id(b) for b in source.buffers()}
        self.watched = tuple(b for b in kept.buffers() if id(b) not in own)
        self.kept_version = versions(self.watched)

    def fresh(self, source: Local, layout: Layout, version: int) -> bool:
        """The staleness rule (module doc)."""
        return (self.source is source and self.layout is layout and self.version == version
                and (not self.watched or versions(self.watched) == self.kept_version))


class OperandCache:
    """One value's kept operands (module doc)."""

    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table: dict[Key, _Entry] = {}


class Operand(Protocol):
    """What this module reads of a Tensor (:class:`~shardwise.tensors.tensor.Tensor`)."""

    _local: Local
    _layout: Layout
    _shape: tuple[int, ...]
    _dtype: torch.dtype
    _device: torch.device
    _open: tuple[bool, ...] | None
    _cache: OperandCache | None
    _grad_owner: GradOwner | None

    @property
    def _shards(self) -> tuple[torch.Tensor, ...]: ...

    def plan_to(self, target: Layout) -> Plan: ...

    def relayout(self, target: Layout, *, keep_whole: bool = False) -> Self: ...

    def _held(self, local: Local, layout: Layout) -> Self: ...


T = TypeVar("T", bound=Operand)


def whole_of(x: Operand, copy: bool = True) -> torch.Tensor | None:
    """``x``'s global value in one buffer for a compute op: the value it holds whole,
    else its blocks' derived whole (a view, or a copy when ``copy``: see
    :mod:`shardwise.runtime.local`), else None.

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
    return x._local.whole_of(x._layout, x._shape, x._dtype.itemsize, copy)


def aliases_copy(x: Operand, result: torch.Tensor) -> bool:
    """Whether ``result`` (an op's output) is, or is a view of, ``x``'s derived whole
    when that whole copies its blocks: the op then runs on the blocks, so that its
    result aliases them, as torch's views do."""
    return x._local.aliases_copy(result)


def runs_whole(operands: Sequence[Operand | None]) -> bool:
    """Whether the runtime runs an op on these operands (None: a constant) once on
    whole values: every one holds its whole or has a derived one (no copies while
    CommCounter counts, where a rerun on the blocks would count twice)."""
    copy = not comm.active()
    return all(x is None or whole_of(x, copy) is not None for x in operands)


def _table(x: Operand) -> dict[Key, _Entry]:
    cache = x._cache
    if cache is None:
        cache = x._cache = OperandCache()
    return cache.table


def kept_layouts(operands: Sequence[Operand | None], whole: bool | None
                 ) -> tuple[tuple[Any, ...], ...]:
    """Per operand (None: a constant), the layouts it holds kept now for an op run on
    blocks (``whole`` False) or on whole values (True), in the current grad mode:
    ops price them as free and plan from them. ``()`` when none holds any. ``whole``
    None: every kept layout with its request, ``(layout, whole)`` (a key for both)."""
    out: list[tuple[Any, ...]] | None = None
    grad = torch.is_grad_enabled()
    for i, x in enumerate(operands):
        cache = None if x is None else x._cache
        if not cache:
            continue
        assert x is not None
        local = x._local
        version = -1
        lays: list[Any] = []
        for (lay, div, g, w), entry in cache.table.items():
            if div or g != grad or (whole is not None and w != whole):
                continue
            if version < 0:  # read the source's version once, only when needed
                version = local.version()
            if entry.fresh(local, x._layout, version):
                lays.append(lay if whole is not None else (lay, w))
        if lays:
            if out is None:
                out = [()] * len(operands)
            out[i] = tuple(lays)
    return () if out is None else tuple(out)


def _kept(x: Operand, target: Layout, diverge: tuple[int, ...], whole: bool,
          view: torch.Tensor | None = None) -> tuple[Local, _Entry | None]:
    """``x`` moved to ``target`` (through a diverge over ``diverge``) as the request
    ``whole`` wants it, kept (module doc): the one move every later op shares. Returns
    the moved value and its entry (None for a leaf, which keeps nothing)."""
    local, layout = x._local, x._layout
    version = local.version()
    grad = torch.is_grad_enabled()
    key = (target, diverge, grad, whole)
    table = None if local.grad_leaf() else _table(x)
    if table:
        hit = table.get(key)
        if hit is not None and hit.fresh(local, layout, version):
            return hit.kept, hit
        for k in [k for k, e in table.items() if not e.fresh(local, layout, version)]:
            del table[k]  # (stale entries never revive: versions only grow)
    # a whole request moves the whole value (its own or derived), as metadata
    source = local.as_whole(layout, x._shape, x._dtype.itemsize) if whole else local
    alternatives = not diverge
    try:
        plan = make_plan(layout, target, x._shape, x._dtype.itemsize)
    except TypeError:  # symbolic sizes (tensors/symbolic.py): kept layouts not priced
        plan = plan_of(layout, target, x._shape, x._dtype.itemsize)
        alternatives = False
    if table and alternatives:  # the cheapest fresh kept layout of the same request
        for (lay, div, g, w), entry in table.items():
            if div or g != grad or w != whole:
                continue
            other = make_plan(lay, target, x._shape, x._dtype.itemsize)
            if other.bytes_per_device < plan.bytes_per_device:
                source, plan = entry.kept, other
    out = source.moved(plan, target, diverge, x._grad_owner, view)
    if table is None:
        return out, None
    entry = table[key] = _Entry(local, layout, version, out)
    return out, entry


def relayout(x: T, target: Layout) -> T:
    """``x`` in layout ``target`` for an op, done once per value: every later op gets
    the same Tensor, planned from the cheapest layout kept.

    >>> from shardwise.tensors.tensor import place
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> p = place(torch.ones(4), Layout(mesh, ((),), (ReduceOp.SUM,)))
    >>> rep = Layout.replicated(mesh, 1)
    >>> relayout(p, rep) is relayout(p, rep), relayout(p, rep).to_torch().tolist()
    (True, [1.0, 1.0, 1.0, 1.0])
    """
    if target is x._layout or target == x._layout:
        return x
    if target.orders or x._layout.orders:  # (between sequence orders: never kept)
        return x.relayout(target)
    local, entry = _kept(x, target, (), False)
    if entry is None:
        return x._held(local, target)
    if entry.tensor is None:
        entry.tensor = x._held(local, target)
    return entry.tensor


def blocks(x: Operand, target: Layout, diverge: tuple[int, ...] = ()
           ) -> Sequence[torch.Tensor | None]:
    """``x``'s blocks in layout ``target`` for an op, through the backend's
    ``diverge`` over ``diverge`` (the op's output is split where ``x`` is replicated:
    its gradient is summed over those axes), once per value: every op reading ``x``
    shares one diverge, so the gradient's all_reduce runs once on the summed
    gradient."""
    if not diverge and (target is x._layout or target == x._layout):
        return x._shards
    return _kept(x, target, diverge, False)[0].blocks


def whole(x: Operand, target: Layout, diverge: tuple[int, ...] = (),
          view: torch.Tensor | None = None) -> torch.Tensor:
    """The whole value of ``x`` as an op's operand that needs layout ``target`` (and,
    for its gradient, a sum over the ``diverge`` axes): the layout change is metadata,
    but its collectives are counted as the blocks would move, once per value (the
    same operand for every later op, so one backward hook sees the summed gradient).
    ``view``: an identity view of the whole that the op already used (the hook goes
    there, e.g. a bias inside addmm)."""
    if not diverge and (target is x._layout or target == x._layout):
        w = whole_of(x)
        assert w is not None, "the runtime asked for a whole the value has none of"
        return w
    w = _kept(x, target, diverge, True, view)[0].whole_of(target, x._shape, x._dtype.itemsize)
    assert w is not None
    return w


class Decided:
    """A decided op (the decision cache's value): the bound rule, the decision, the
    output's torch size and shape, and per operand whether it already has its required
    layout (``in_place``: its own blocks serve, but for a diverge that records). It
    hands the runtime running the op (``Backend.run_local``) the operands as the
    decision requires them: every operand's blocks, or every operand's whole value
    (once it knows each has one). Constants pass as they are."""

    __slots__ = ("backend", "dec", "factors", "in_place", "moves", "own", "shape", "size",
                 "world")

    def __init__(self, factors: Factors, dec: Decision, layouts: Sequence[Layout | None]
                 ) -> None:
        self.factors, self.dec = factors, dec
        # the backend that runs it, and torch's default process group then (None: no
        # process world): the executor asks ``backend_for`` again only when that changed
        self.backend: Any = None
        self.world: Any = None
        self.size = torch.Size(factors.out_shape)
        self.shape = factors.out_shape
        self.in_place = tuple(have is not None and req == have
                              for have, req in zip(layouts, dec.required))
        # some Tensor operand moves, or diverges (where autograd records)
        self.moves = any(req is not None and (div or not here) for req, div, here in
                         zip(dec.required, dec.diverge, self.in_place))
        # per operand: 0 a constant, 1 its own blocks serve, 2 they serve unless
        # autograd records through them (a diverge), 3 the operand cache's
        self.own = tuple(0 if req is None else (2 if div else 1) if here else 3
                         for req, div, here in zip(dec.required, dec.diverge, self.in_place))

    @classmethod
    def of(cls, factors: Factors, tensors: Sequence[Operand | None]) -> Decided:
        """The decision for ``tensors`` (None: a constant) under ``factors``, pricing the
        layouts each keeps now as free."""
        layouts = tuple(None if x is None else x._layout for x in tensors)
        symbolic = factors.symbolic  # (torch.compile, dynamic shapes)
        dec = decide(hinted(factors) if symbolic else factors, layouts,
                     tuple(None if x is None else x._open for x in tensors),
                     tuple(0 if x is None else x._dtype.itemsize for x in tensors),
                     kept_layouts(tensors, runs_whole(tensors)))
        if symbolic:  # decided on the hints; the shapes stay symbolic where nothing cuts
            factors = pinned_factors(factors, layouts, dec.required, dec.output)
            dec = dataclasses.replace(dec, local_shapes=tuple(
                local_shape(factors.out_shape, dec.output, dec.output.mesh.coord_of(k))
                for k in range(dec.output.mesh.num_devices)))
        return cls(factors, dec, layouts)

    def blocks(self, args: Sequence[Any]) -> Sequence[Sequence[torch.Tensor | None] | None]:
        """Each operand's blocks in its required layout (None for a constant): its own
        where it is already there and needs no diverge that autograd records, else
        from the operand cache."""
        if not self.moves:
            required = self.dec.required
            if len(args) == 2 and required[0] is not None and required[1] is not None:
                return (args[0]._local.blocks, args[1]._local.blocks)
            if len(args) == 1 and required[0] is not None:
                return (args[0]._local.blocks,)
            return [None if req is None else x._local.blocks
                    for x, req in zip(args, required)]
        cols: list[Sequence[torch.Tensor | None] | None] = []
        dec = self.dec
        for i, (x, own) in enumerate(zip(args, self.own)):
            if own == 0:
                cols.append(None)
            elif own == 1 or (own == 2 and not records(x)):
                cols.append(x._local.blocks)
            else:
                cols.append(blocks(x, dec.required[i], dec.diverge[i]))  # type: ignore[arg-type]
        return cols

    def wholes(self, args: Sequence[Any], views: dict[int, torch.Tensor] | None
               ) -> list[Any] | None:
        """Each operand's whole value in its required layout (constants as they are),
        or None where some operand has none (:func:`runs_whole`); ``views``: operand
        index -> an identity view of its whole the op already used (the counting hook
        goes there)."""
        copy: bool | None = None
        out: list[Any] = []
        for x, req in zip(args, self.dec.required):
            if req is None:
                out.append(x)
                continue
            held = x._local
            if type(held) is Whole:  # (the simulated runtime's common case: no questions)
                out.append(held.value)
                continue
            if copy is None:
                copy = not comm.active()
            w = held.whole_of(x._layout, x._shape, x._dtype.itemsize, copy)
            if w is None:
                return None
            out.append(w)
        if self.moves:  # the layout changes, counted (once per value: kept)
            # a value held whole moves as metadata: unobserved (no counter, no holder),
            # its own value serves, with nothing to keep
            observed = comm.active() or comm.holding()
            dec = self.dec
            for i, (x, req, div, here) in enumerate(zip(args, dec.required, dec.diverge,
                                                        self.in_place)):
                if req is not None and (div or not here) and (
                        observed or type(x._local) is not Whole):
                    out[i] = whole(x, req, div, views.get(i) if views else None)
        return out

    def aliases_copy(self, args: Sequence[Any], result: torch.Tensor) -> bool:
        """Whether ``result`` (of a run on :meth:`wholes`) aliases an operand's copy of
        its blocks."""
        for x, req in zip(args, self.dec.required):
            if req is not None and type(x._local) is not Whole and x._local.aliases_copy(
                    result):  # (a value held whole is no copy: asked of blocks only)
                return True
        return False


def records(x: Any) -> bool:
    """Whether autograd records through ``x``'s buffers: only then does a diverge (the
    identity forward, a sum of the gradient's shares backward) do anything."""
    if fwAD._current_level >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    return x._local.requires_grad
