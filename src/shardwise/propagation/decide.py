"""Sharding propagation: one sharding per factor of a rule, chosen by cost.

Given a rule bound to shapes (:class:`~shardwise.propagation.rules.Factors`) and the
operands' layouts, :func:`decide` picks a sharding (tuple of mesh axes) for
every factor and a Partial pass-through per mesh axis; that fixes the layout
each operand is resharded to and the output layout.

Invariants:
- Candidates for a factor: the shardings its dims have on the operands, plus
  unsharded. The major factor of a compound dim (reshape) is sharded only where
  it splits evenly. A "needs full" factor is only unsharded. Nothing is sharded over
  an axis no operand uses for that factor (no new shardings are invented).
- A mesh axis serves at most one factor, or one Partial pass-through.
- A sharded factor missing from the output makes the output Partial(rule's
  reduce op) over its axes; a pass-through axis keeps Partial(SUM) (any op for a
  rule marked ``any_partial``: reshape only moves elements).
- Cost = bytes per device the planner moves to lay the operands out as
  required (from the operand's layout or, cheaper, from a layout it already has
  at hand: a kept relayout, free to reuse), plus :data:`CLOSED_PENALTY` per
  closed operand dim whose sharding changes. Ties go to more output parallelism
  (devices the output's dims are split over), then to keeping earlier operands as
  they are (or as they are at hand).
- An output dim is open iff every operand dim of its factor is open.
- Decisions are pure and cached by (rule, layouts, open dims, itemsizes).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from shardwise.planner import make_plan
from shardwise.propagation.binding import Factors
from shardwise.propagation.rules import Passes
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape

__all__ = ["CLOSED_PENALTY", "Decision", "decide"]

CLOSED_PENALTY = 1 << 50
"""Cost of changing a closed operand dim: above any byte count, so it happens
only when every choice changes one."""

MAX_COMBINATIONS = 4096
"""Above this many factor combinations the candidates of each factor are cut to
its sharding on the first operand that has it, plus unsharded."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What an op does: operand layouts, output layout, and where gradients diverge."""

    required: tuple[Layout | None, ...]     # per operand (None: a constant)
    output: Layout
    out_open: tuple[bool, ...] | None       # None: every output dim open
    diverge: tuple[tuple[int, ...], ...]    # per operand: replicated axes the output is not
    local_shapes: tuple[tuple[int, ...], ...]  # expected output block per device
    cost: int


def _candidates(factors: Factors, layouts: tuple[Layout | None, ...],
                first_only: bool, kept: tuple[tuple[Layout, ...], ...] = ()
                ) -> list[list[tuple[int, ...]]]:
    out: list[list[tuple[int, ...]]] = []
    for f in range(len(factors.sizes)):
        opts: list[tuple[int, ...]] = [()]
        if f not in factors.full:
            for i, (lay, fs) in enumerate(zip(layouts, factors.operands)):
                if lay is None:
                    continue
                for have in (lay, *(kept[i] if kept else ())):
                    for d, g in enumerate(fs):
                        if g == f and have.dims[d] and have.dims[d] not in opts:
                            opts.append(have.dims[d])
                if first_only and len(opts) > 1:
                    break
        out.append(opts)
    return out


# per mesh axis where a Partial may pass: (axis, its reduce op, the choices of which
# operands keep it: -1 all of them, None nobody (resolve), i operand i alone)
PassOptions = list[tuple[int, ReduceOp, list[int | None]]]


def _pass_options(factors: Factors, layouts: tuple[Layout | None, ...]) -> PassOptions:
    """Per mesh axis where some operand is Partial(SUM), or, for a rule that passes
    any Partial (``any_partial``), where every operand is Partial with one op."""
    out: PassOptions = []
    mesh = next(lay for lay in layouts if lay is not None).mesh
    for a in range(mesh.ndim):
        holders = [i for i, lay in enumerate(layouts)
                   if lay is not None and lay.partial[a] is ReduceOp.SUM]
        if not holders:
            ops = {lay.partial[a] if lay is not None else None for lay in layouts}
            if factors.any_partial and factors.passes is Passes.LINEAR and len(ops) == 1:
                op = ops.pop()
                if op is not None:
                    out.append((a, op, [None, -1]))
            continue
        opts: list[int | None] = [None]
        if factors.passes is Passes.LINEAR and all(lay is not None for lay in layouts):
            opts.append(-1)
        elif factors.passes is Passes.MULTILINEAR:
            opts += [i for i in holders if i in factors.carriers]
        out.append((a, ReduceOp.SUM, opts))
    return out


@functools.lru_cache(maxsize=8192)
def decide(factors: Factors, layouts: tuple[Layout | None, ...],
           opens: tuple[tuple[bool, ...] | None, ...], itemsizes: tuple[int, ...],
           kept: tuple[tuple[Layout, ...], ...] = ()) -> Decision:
    """The cheapest way to run ``factors`` on operands laid out as ``layouts``.

    ``layouts[i]`` is None for a constant operand (a broadcast scalar: replicated,
    never Partial). ``opens[i][d]``: may operand ``i``'s dim ``d`` be resharded
    freely (else it is closed and changing it costs :data:`CLOSED_PENALTY`);
    ``opens[i]`` None: every dim open. ``kept[i]`` (optional): layouts operand
    ``i`` already has at hand (:func:`shardwise.tensors.cache.kept_layouts`): free, and a
    source to plan from.
    """
    mesh = next(lay for lay in layouts if lay is not None).mesh
    shapes = factors.shapes
    cands = _candidates(factors, layouts, first_only=False, kept=kept)
    if math.prod(len(c) for c in cands) > MAX_COMBINATIONS:
        cands = _candidates(factors, layouts, first_only=True, kept=kept)
    passes = _pass_options(factors, layouts)
    in_output = set(factors.output)
    best: tuple[tuple[int, ...], Layout, list[Layout | None]] | None = None
    for shardings in itertools.product(*cands):
        used = [a for axes in shardings for a in axes]
        if len(used) != len(set(used)) or (factors.even and not _even(factors, shardings,
                                                                        mesh.mesh_shape)):
            continue
        for keep in itertools.product(*(opts for _, _, opts in passes)):
            axes_kept = [(a, op) for (a, op, _), k in zip(passes, keep) if k is not None]
            if {a for a, _ in axes_kept} & set(used):
                continue
            out_partial: list[ReduceOp | None] = [None] * mesh.ndim
            for a, op in axes_kept:
                out_partial[a] = op
            for f, axes in enumerate(shardings):
                if axes and f not in in_output:
                    assert factors.reduce is not None, f"{factors.text}: factor {f} reduced"
                    for a in axes:
                        out_partial[a] = factors.reduce
            required: list[Layout | None] = []
            cost, changed = 0, []
            for i, (lay, fs) in enumerate(zip(layouts, factors.operands)):
                if lay is None:
                    required.append(None)
                    changed.append(0)
                    continue
                part = tuple(op if k == -1 or k == i else None
                             for k, op in _per_axis(passes, keep, mesh.ndim))
                req = Layout(mesh, tuple(shardings[f] for f in fs), part)
                if req == lay:
                    req = lay  # the operand's own object: compute skips relayout by identity
                required.append(req)
                if req != lay:
                    at_hand = kept[i] if kept else ()
                    cost += min(make_plan(have, req, shapes[i], itemsizes[i]).bytes_per_device
                                for have in (lay, *at_hand))
                    flags = opens[i]
                    if flags is not None:
                        cost += CLOSED_PENALTY * sum(1 for d, o in enumerate(flags)
                                                     if not o and req.dims[d] != lay.dims[d])
                    changed.append(int(req not in at_hand))
                else:
                    changed.append(0)
            out = Layout(mesh, tuple(shardings[f] for f in factors.output), tuple(out_partial))
            spread = math.prod(mesh.mesh_shape[a] for a in out.sharded_axes)
            key = (cost, -spread, *changed)
            if best is None or key < best[0]:
                best = (key, out, required)
    assert best is not None, "the all-unsharded choice is always valid"
    key, out, required = best
    return Decision(tuple(required), out, _out_open(factors, opens),
                    _diverge(required, out), _local_shapes(out, factors.out_shape), key[0])


def _even(factors: Factors, shardings: tuple[tuple[int, ...], ...],
          mesh_shape: tuple[int, ...]) -> bool:
    """Every major factor of a compound dim splits evenly over its mesh axes."""
    return all(factors.sizes[f] % math.prod(mesh_shape[a] for a in shardings[f]) == 0
               for f in factors.even)


def _per_axis(passes: PassOptions, keep: tuple[int | None, ...], ndim: int
              ) -> list[tuple[int | None, ReduceOp | None]]:
    """Per mesh axis: who keeps its Partial (as in :data:`PassOptions`) and its op."""
    out: list[tuple[int | None, ReduceOp | None]] = [(None, None)] * ndim
    for (a, op, _), k in zip(passes, keep):
        out[a] = (k, op)
    return out


def _out_open(factors: Factors, opens: tuple[tuple[bool, ...] | None, ...]
              ) -> tuple[bool, ...] | None:
    closed = {f for fs, op in zip(factors.operands, opens) if op is not None
              for f, o in zip(fs, op) if not o}
    if not closed & set(factors.output):
        return None
    return tuple(f not in closed for f in factors.output)


def _diverge(required: list[Layout | None], out: Layout) -> tuple[tuple[int, ...], ...]:
    """Per operand: mesh axes it is replicated over while the output is not (sharded
    or Partial there), so each device holds only a share of its gradient."""
    spread = set(out.sharded_axes) | set(out.partial_axes)
    result: list[tuple[int, ...]] = []
    for req in required:
        if req is None:
            result.append(())
            continue
        used = set(req.sharded_axes) | set(req.partial_axes)
        result.append(tuple(a for a in sorted(spread) if a not in used))
    return tuple(result)


def _local_shapes(out: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    mesh = out.mesh
    return tuple(local_shape(shape, out, mesh.coord_of(k)) for k in range(mesh.num_devices))
