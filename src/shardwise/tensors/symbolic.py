"""Symbolic sizes: a shardwise op traced by ``torch.compile`` with dynamic shapes
(``dynamic=True``, or Dynamo's automatic dynamic after a recompile for new sizes).

Invariants:
- Layouts are decided on the sizes' hints (the sizes of the call being traced), so
  the decision and plan caches, and the planner's costs, see plain ints: a decision
  is made once per sharding pattern, the first size's, and no cost comparison
  becomes a guard. The rule binding runs on the symbolic sizes (uncached): its
  checks are the guards torch's own ops would add.
- A dim stays symbolic where no block moves along it (its sharding is the same
  before and after) and, where it is sharded, it splits evenly (a guard on the
  remainder): the local ops then carry its size and no offset of shardwise's
  depends on it. A dim that a relayout moves blocks along, or splits unevenly, is
  specialised to its hint (a Dynamo guard: a new size recompiles, as
  ``torch._dynamo.mark_static`` would), never sliced at the hint's offsets; a dim
  the user marked dynamic there fails torch's constraint check, which names it.
- Eager code never comes here: symbolic sizes exist only while torch.compile traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true

from shardwise.planner import Plan, make_plan
from shardwise.propagation.binding import Factors
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout

__all__ = ["hint", "hinted", "is_symbolic", "pinned_factors", "plan_of", "static"]


def is_symbolic(shape: Sequence[Any]) -> bool:
    """Whether a size of ``shape`` is symbolic (a ``torch.SymInt``).

    >>> is_symbolic((4, 8))
    False
    """
    return not all(type(d) is int for d in shape)


def hint(value: Any) -> Any:
    """``value`` with each symbolic size replaced by its hint (its size in the call
    being traced), through tuples and lists; anything else as it is.

    >>> hint((4, (8, 2.5), "x"))
    (4, (8, 2.5), 'x')
    """
    if isinstance(value, torch.SymInt):
        got = value.node.hint
        if got is None:
            raise ShardingError(
                f"Cannot lay out a shardwise op on the data-dependent size {value}: "
                "shardwise decides layouts on the sizes of the call being traced, and "
                "this one has none. Got a size computed from tensor values (nonzero, "
                "item(), ...); compute it before torch.compile or mark it static.")
        return got
    if isinstance(value, (tuple, list)):
        return type(value)(hint(v) for v in value)
    return value


def static(d: Any) -> Any:
    """The size ``d`` as an int where it is one, or where Dynamo has pinned it (a
    guard made it equal its hint); else ``d`` itself.

    >>> static(8)
    8
    """
    if type(d) is int:
        return d
    h = hint(d)
    return h if statically_known_true(d == h) else d


def _pin(size: Any) -> int:
    """``size`` specialised to its hint: a Dynamo guard (a new size recompiles). A dim
    the user marked dynamic (``torch._dynamo.mark_dynamic``) then fails torch's own
    constraint check at the end of the trace, which names it ("marked ... as dynamic
    but your code specialized it"): mark it static or compile with dynamic=False."""
    return guard_int(size)


def _pieces(layout: Layout, d: int) -> int:
    n = 1
    for a in layout.dims[d]:
        n *= layout.mesh.mesh_shape[a]
    return n


def _kept(size: Any, before: Layout | None, after: Layout, d: int) -> bool:
    """Whether a symbolic dim ``d`` of ``size`` may stay symbolic going from ``before``
    (None: the same) to ``after``: its blocks stay, are only cut further (each new
    block a slice of the one held: a local narrow at symbolic offsets) or only joined
    (an all_gather of even blocks), and where it is sharded it splits evenly (a guard
    that it keeps doing so)."""
    if before is not None:
        was, now = before.dims[d], after.dims[d]
        if now[:len(was)] != was and was[:len(now)] != now:
            return False
    n = _pieces(after, d)
    return n == 1 or bool(size % n == 0)


def plan_of(source: Layout, target: Layout, shape: Sequence[Any], itemsize: int) -> Plan:
    """The plan of a relayout of a value of symbolic ``shape`` (module doc): on the
    hints, each dim it moves blocks along (or splits unevenly) first specialised; a
    dim it only cuts further keeps its symbolic size (the plan then uncached: its
    slices' offsets are symbolic).

    >>> from shardwise import DeviceMesh
    >>> lay = Layout.replicated(DeviceMesh.cpu(2, "x"), 1)
    >>> plan_of(lay, lay, (4,), 4).steps
    ()
    """
    out: list[Any] = []
    cut = False
    for d, size in enumerate(shape):
        size = static(size)
        if type(size) is not int:
            if not (_kept(size, source, target, d) and _kept(size, None, source, d)):
                size = _pin(size)
            elif source.dims[d] != target.dims[d]:
                cut = True
                out.append(size)
                continue
        out.append(hint(size))
    if cut:
        return make_plan.__wrapped__(source, target, tuple(out), itemsize)
    return make_plan(source, target, tuple(out), itemsize)


def pinned_factors(factors: Factors, layouts: Sequence[Layout | None],
                   required: Sequence[Layout | None], out: Layout) -> Factors:
    """``factors`` (decided on their hints as ``required`` and ``out``, from operands
    laid out as ``layouts``) with each symbolic dim that the decision moves blocks
    along or splits unevenly specialised to its hint, and every size Dynamo has
    pinned as an int: what the op's local shapes are computed from.

    >>> from shardwise import DeviceMesh
    >>> from shardwise.propagation.binding import bind
    >>> f, lay = bind("neg", ((4,),)), Layout.replicated(DeviceMesh.cpu(2, "x"), 1)
    >>> pinned_factors(f, [lay], [lay], lay) is f  # (plain ints: nothing to pin)
    True
    """
    pinned = False
    for i, (lay, req) in enumerate(zip(layouts, required)):
        if lay is None or req is None:
            continue
        for d, size in enumerate(factors.shapes[i]):
            size = static(size)
            if type(size) is not int and not (_kept(size, lay, req, d)
                                              and _kept(size, None, lay, d)):
                _pin(size)
                pinned = True
    for d, size in enumerate(factors.out_shape):
        size = static(size)
        if type(size) is not int and not _kept(size, None, out, d):
            _pin(size)
            pinned = True
    if not pinned and not any(type(static(v)) is int and type(v) is not int
                              for v in factors.sizes):
        return factors
    return dataclasses.replace(factors, sizes=tuple(static(v) for v in factors.sizes),
                               extents=tuple(tuple(static(v) for v in e)
                                             for e in factors.extents),
                               out_extents=tuple(static(v) for v in factors.out_extents))


def hinted(factors: Factors) -> Factors:
    """``factors`` with every size replaced by its hint: what the decision is made on.

    >>> from shardwise.propagation.binding import bind
    >>> hinted(bind("matmul", ((4, 8), (8, 2)))).out_shape
    (4, 2)
    """
    return dataclasses.replace(factors, sizes=hint(factors.sizes),
                               extents=hint(factors.extents),
                               out_extents=hint(factors.out_extents))
