"""The executor shared by every compute op, one way: bind the rule to the operands'
shapes, decide the layouts (cached by value), move the operands, run the torch op
locally, wrap the result.

Invariants:
- Operands reach the layouts the decision requires only through the operand cache
  (:mod:`shardwise.tensors.cache`: ``blocks``, ``whole``), which also names the
  layouts each already reached (priced free by ``decide``); nothing here reads a
  Tensor's instance dict. Its one state is the decision cache below.
- Decisions are cached (``_DECISIONS``, at most :data:`DECISIONS_MAX` entries, the
  oldest out first) by (op, ``shaped``, params, per operand its layout, shape, open
  dims and dtype or a marker for a Python number, and the layouts operands keep when
  any keeps one): everything ``bind`` and ``decide`` read, so a hit is the decision
  the uncached path would make. Plain torch operands (converted per call) and integer
  Partial operands (reduced first on blocks) never hit; a hit binds, decides and
  allocates nothing but the result. The process runtime's commonest hits (one or two
  Tensors held as blocks, another process holding some devices) run in :func:`_hit`,
  one frame from the handler to the wrap; the others in ``runners._run_plain``.
- Running the decided op (on blocks or wholes) and wrapping its result is
  :mod:`shardwise.ops.runners`' (see its invariants: one torch call per distinct
  tuple of input blocks, so replicas share one buffer and simulated gradients are
  exact).
- Python numbers and 0-d torch tensors are broadcast constants: replicated,
  never communicated (a 0-d tensor that requires grad is placed on the mesh).
- Where an operand is replicated over a mesh axis but the output is not, each
  device computes only a share of that operand's gradient; the backend's
  ``diverge`` sums the shares (identity in the simulated runtime). Where autograd
  records nothing through the operand (no grad-requiring block in grad mode, no
  forward-mode level) the diverge is the identity and is skipped.
- Where every Tensor operand holds its whole value (``_whole``: a mesh this process
  holds wholly) or has a derived one (``cache.whole_of``: blocks seen whole), the op
  runs once on the wholes: the rule still decides the layouts (metadata) and the
  collectives the operands' layout changes imply are counted, but no block moves;
  the output keeps its whole and cuts blocks on demand. A result that aliases a
  derived copy (a view) is dropped and the op runs on the blocks, so that views
  alias the operand's blocks; derived copies are not used while CommCounter counts
  (the rerun would count twice).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.ops.runners import (
    _NONE,
    _aliases_copy,
    _failed,
    _misshapen,
    _run_local,
    _run_plain,
    _run_whole,
)
from shardwise.propagation.binding import Factors, bind
from shardwise.propagation.decide import Decision, decide
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor, place

__all__ = ["DECISIONS_MAX", "apply", "apply_elementwise", "clear_decisions",
           "decision_cache_info", "decision_of", "records"]


def _is_const(x: Any) -> bool:
    return (isinstance(x, numbers.Number)
            or (isinstance(x, torch.Tensor) and x.ndim == 0))


def _operands(op: str, operands: Sequence[Any]) -> list[Any]:
    """The operands, checked: Tensors on one mesh, or constants."""
    first = None
    for x in operands:
        if isinstance(x, Tensor):
            first = x
            break
    if first is None:
        raise ShardingTypeError(
            f"{op} needs at least one shardwise.Tensor operand. Got "
            f"{[type(x).__name__ for x in operands]}; wrap data with shardwise.tensor(...)."
        )
    mesh = first._layout.mesh
    out = list(operands)
    for i, x in enumerate(out):
        if isinstance(x, Tensor):
            if x._layout.mesh is not mesh and x._layout.mesh != mesh:
                raise ShardingError(
                    f"{op}: operand {i} lives on {x.mesh!r} but operand 0 on {mesh!r}; "
                    "compute ops need one mesh. Move one with "
                    "shardwise.to_device(x, sharding=...) first."
                )
        elif isinstance(x, torch.Tensor) and x.ndim > 0:
            # a plain torch tensor among shardwise ones: Replicated on the mesh (as JAX
            # treats numpy arrays); every process must hold the same value
            out[i] = place(x, Layout.replicated(mesh, x.ndim))
        elif not _is_const(x):
            raise ShardingTypeError(
                f"{op}: operand {i} is a {type(x).__name__}; operands are shardwise "
                "Tensors, torch tensors or Python numbers. Wrap it with "
                "shardwise.tensor(x, sharding=...) first."
            )
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            out[i] = place(x, Layout.replicated(mesh, 0))
    return out


#: ``Tensor._wrap``, bound once (a classmethod looked up on the class binds anew each call)
_wrap = Tensor._wrap
_CONSTS = (int, float, bool, complex)  # Python numbers: broadcast constants, as _is_const

#: the decision cache: (op, shaped, params, per operand its (layout, shape, open dims,
#: dtype) or None for a number[, the kept layouts when some operand keeps any]) ->
#: :class:`_Decided`. Bounded: the oldest entry goes once it holds DECISIONS_MAX.
_DECISIONS: dict[tuple[Any, ...], _Decided] = {}
DECISIONS_MAX = 4096
"""The decision cache's bound: distinct (op, operand layouts, shapes...) keys kept."""


class _Decided:
    """What an op's key decides, computed once: the bound rule, the decision, the
    output's torch size, and per operand whether its blocks serve as they are (its
    required layout is its own)."""

    __slots__ = ("bare", "dec", "diverges", "expect", "factors", "out_open",
                 "output", "plain", "same", "shape", "size")

    def __init__(self, factors: Factors, dec: Decision, layouts: Sequence[Layout | None],
                 shaped: bool) -> None:
        self.factors, self.dec = factors, dec
        self.size = torch.Size(factors.out_shape)
        self.same = _in_place(layouts, dec)
        # every operand a Tensor that serves as it is (a diverge only where autograd
        # records: ``diverges``), and fn takes the blocks alone: _run_plain
        self.plain = all(self.same) and not shaped
        self.diverges = tuple(i for i, d in enumerate(dec.diverge) if d)
        self.bare = self.plain and not self.diverges  # no diverge at all
        # read by _hit on every op: one attribute each
        self.expect, self.output, self.out_open = dec.local_shapes, dec.output, dec.out_open
        self.shape = factors.out_shape


def decision_cache_info() -> tuple[int, int]:
    """(entries, bound) of the decision cache (tests and benchmarks read it).

    >>> clear_decisions()
    >>> decision_cache_info() == (0, DECISIONS_MAX)
    True
    """
    return len(_DECISIONS), DECISIONS_MAX


def clear_decisions() -> None:
    """Forget every cached decision (tests that patch the rules or ``decide``).

    >>> clear_decisions(); decision_cache_info()[0]
    0
    """
    _DECISIONS.clear()


def _hit(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor],
         params: tuple[Any, ...], shaped: bool) -> Tensor | None:
    """The commonest hit, run; else None (the caller takes the general path). One or
    two Tensors held as blocks of which another process holds some (so no derived
    whole: ``whole_of`` is None; the caller checked it of operand 0, so values held
    whole or wholly here pay no call), keeping nothing, each in its required layout with no
    diverge that records, ``fn`` taking the blocks alone: the key is built without a
    loop and the rows run here, one ``fn`` call per distinct row (as ``_run_plain``,
    whose general loop the other hits take). The per-op path of the process runtime:
    every line here is paid by every op."""
    if len(operands) == 1:
        x = operands[0]
        if x._cache is not None:
            return None
        hit = _DECISIONS.get((op, shaped, params, x._layout, x._shape, x._open,
                              x._dtype))
        if hit is None or not hit.bare:
            return None
        out: list[torch.Tensor | None] = []
        first = b0 = None
        for b in x._blocks:
            if b is None:
                out.append(None)
            elif first is None:  # the first block here
                try:
                    first = fn(b)
                except (RuntimeError, TypeError, ValueError, IndexError) as err:
                    raise _failed(op, operands, len(out), hit.factors, err) from err
                if first.shape != hit.expect[len(out)]:
                    raise AssertionError(_misshapen(op, len(out), first, hit.dec))
                b0 = b
                out.append(first)
            elif b is b0:  # a replica of it: the same result
                out.append(first)
            else:  # another block here: the general loop runs the rest
                return _run_plain(op, fn, operands, hit.dec, hit.factors, hit.size, out,
                                  {(id(b0),): first})
    elif len(operands) == 2:
        x, y = operands
        if (type(y) is not Tensor or y._whole is not None or x._cache is not None
                or y._cache is not None):
            return None
        hit = _DECISIONS.get((op, shaped, params, x._layout, x._shape, x._open,
                              x._dtype, y._layout, y._shape, y._open, y._dtype))
        if hit is None or not hit.plain or (hit.diverges and any(
                records(operands[i]) for i in hit.diverges)):
            return None
        out = []
        first = b0 = c0 = None
        c1 = y._blocks
        for k, b in enumerate(x._blocks):
            if b is None:
                out.append(None)
                continue
            c = c1[k]  # type: ignore[index]
            if first is None:
                try:
                    first = fn(b, c)
                except (RuntimeError, TypeError, ValueError, IndexError) as err:
                    raise _failed(op, operands, k, hit.factors, err) from err
                if first.shape != hit.expect[k]:
                    raise AssertionError(_misshapen(op, k, first, hit.dec))
                b0, c0 = b, c
                out.append(first)
            elif b is b0 and c is c0:
                out.append(first)
            else:
                return _run_plain(op, fn, operands, hit.dec, hit.factors, hit.size, out,
                                  {(id(b0), id(c0)): first})
    else:
        return None
    if first is None:  # no device of this mesh here: the dtype from meta
        return _run_plain(op, fn, operands, hit.dec, hit.factors, hit.size)
    return _wrap(tuple(out), None, hit.output, hit.size, first.dtype, first.device,
                 hit.out_open, hit.shape)


def apply(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor], *params: Any,
          shaped: bool = False, views: dict[int, torch.Tensor] | None = None) -> Tensor:
    """Run ``op`` (rule ``RULES[op]`` with ``params``) as ``fn`` on the local shards;
    ``shaped``: ``fn`` also takes the expected local output shape; ``views``: operand
    index -> the identity view of its whole value that the computation already used
    (communication accounting hangs its backward hook there).

    The decision (bound rule, layouts, local shapes) is a cache hit for operands
    already seen in the same layouts, shapes, open dims, dtypes and kept layouts, with
    the same ``params``: the per-op path then binds and decides nothing."""
    x = operands[0] if operands else None
    if (type(x) is Tensor and x._whole is None
            and _NONE in map(id, x._blocks)):  # type: ignore[arg-type]
        out = _hit(op, operands, fn, params, shaped)
        if out is not None:
            return out
    key: list[Any] = [op, shaped, params]
    wholes = True
    kept = False
    for x in operands:
        if isinstance(x, Tensor):
            key += (x._layout, x._shape, x._open, x._dtype)
            # as _apply: a value held as blocks runs whole on its derived whole
            if wholes and x._whole is None and cache.whole_of(x, not comm.active()) is None:
                wholes = False
            if x._cache is not None:
                kept = True
        elif type(x) in _CONSTS:
            key.append(None)
        else:  # torch tensors and the rest: converted or refused by _operands
            return _apply(op, operands, fn, params, shaped, views, None)
    if kept:  # the layouts operands keep are priced by decide: part of the key
        key.append(cache.kept_layouts(
            [x if isinstance(x, Tensor) else None for x in operands], wholes))
    k = tuple(key)
    hit = _DECISIONS.get(k)
    if hit is None:
        return _apply(op, operands, fn, params, shaped, views, k)
    dec = hit.dec
    if hit.plain and not wholes:
        for i in hit.diverges:
            if records(operands[i]):
                break
        else:
            return _run_plain(op, fn, operands, dec, hit.factors, hit.size)
    args = list(operands)
    if wholes:
        out = _run_whole(op, fn, args, dec.required, dec, hit.factors, shaped, views)
        if out is not None:
            return out
    return _run_local(op, fn, args, _columns(args, dec, hit.same), dec, hit.factors, shaped,
                      hit.size)


def decision_of(op: str, operands: Sequence[Any], *params: Any) -> Decision | None:
    """The decision :func:`apply` takes for these operands, from the cache or made and
    cached now, where every operand is a Tensor on one mesh held as blocks of which
    another process holds some (no derived whole), with no integer Partial; else None.
    Lets a handler choose its local call by the layouts before it runs, the same on
    the first call as on later ones (``F.linear`` adds its bias in the same call).

    >>> decision_of("linear", ()) is None
    True
    """
    key: list[Any] = [op, False, params]
    mesh = None
    for x in operands:
        if (not isinstance(x, Tensor) or x._whole is not None
                or _NONE not in map(id, x._blocks)  # type: ignore[arg-type]
                or (x._layout.is_partial and not _sums_exactly(x._dtype))):
            return None  # (blocks all here may run on a derived whole: apply decides)
        if mesh is None:
            mesh = x._layout.mesh
        elif x._layout.mesh != mesh:
            return None  # apply names the two meshes in its error
        key += (x._layout, x._shape, x._open, x._dtype)
    if mesh is None:
        return None
    kept: tuple[tuple[Layout, ...], ...] = ()
    if any(x._cache is not None for x in operands):  # as apply's key has it
        kept = cache.kept_layouts(operands, False)
        key.append(kept)
    k = tuple(key)
    hit = _DECISIONS.get(k)
    if hit is None:
        layouts = tuple(x._layout for x in operands)
        factors = bind(op, tuple(x._shape for x in operands), *params)
        dec = decide(factors, layouts, tuple(x._open for x in operands),
                     tuple(x._dtype.itemsize for x in operands), kept)
        hit = _store(k, factors, dec, layouts, False)
    return hit.dec


def _store(key: tuple[Any, ...], factors: Factors, dec: Decision,
           layouts: Sequence[Layout | None], shaped: bool) -> _Decided:
    if len(_DECISIONS) >= DECISIONS_MAX:
        del _DECISIONS[next(iter(_DECISIONS))]
    hit = _DECISIONS[key] = _Decided(factors, dec, layouts, shaped)
    return hit


def records(x: Tensor) -> bool:
    """Whether autograd records through ``x``'s blocks: only then does a diverge (the
    identity forward, a sum of the gradient's shares backward) do anything."""
    if fwAD._current_level >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    if x._whole is not None:
        return x._whole.requires_grad
    return any(b is not None and b.requires_grad for b in x._blocks)  # type: ignore[union-attr]


def _apply(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor],
           params: tuple[Any, ...], shaped: bool, views: dict[int, torch.Tensor] | None,
           key: tuple[Any, ...] | None) -> Tensor:
    """:func:`apply` without a cached decision: check and convert the operands, bind,
    decide; then remember the decision under ``key`` (None: not cacheable)."""
    args = _operands(op, operands)
    tensors: list[Tensor | None] = []
    shapes: list[tuple[int, ...]] = []
    layouts: list[Layout | None] = []
    opens: list[tuple[bool, ...] | None] = []
    itemsizes: list[int] = []
    wholes = True
    wrapping: list[int] = []  # integer or bool Partial operands (_reduce_wrapping_partials)
    for i, x in enumerate(args):
        if isinstance(x, Tensor):
            if x._layout.is_partial and not _sums_exactly(x._dtype):
                wrapping.append(i)
            tensors.append(x)
            shapes.append(x._shape)
            layouts.append(x._layout)
            opens.append(x._open)
            itemsizes.append(x._dtype.itemsize)
            # (a value held as blocks runs whole on its derived whole; a copy only
            # while nothing counts: a view result reruns on the blocks, see _run_whole)
            wholes = wholes and (x._whole is not None or cache.whole_of(
                x, not comm.active()) is not None)
        else:
            tensors.append(None)
            shapes.append(())
            layouts.append(None)
            opens.append(())
            itemsizes.append(0)
    factors = bind(op, tuple(shapes), *params)
    if wrapping and not wholes:
        _reduce_wrapping_partials(wrapping, args, tensors, layouts, fn, factors, shaped)
    # the layouts each operand already reached for earlier ops: free for this one
    dec = decide(factors, tuple(layouts), tuple(opens), tuple(itemsizes),
                 cache.kept_layouts(tensors, wholes))
    size = None
    if key is not None and not wrapping:  # a wrapping operand's run depends on wholes
        size = _store(key, factors, dec, layouts, shaped).size
    if wholes:
        out = _run_whole(op, fn, args, layouts, dec, factors, shaped, views)
        if out is not None:
            return out
    return _run_local(op, fn, args, _columns(args, dec, _in_place(layouts, dec)), dec,
                      factors, shaped, size)


def _in_place(layouts: Sequence[Layout | None], dec: Decision) -> tuple[bool, ...]:
    """Per operand, whether it already has the layout ``dec`` requires (a Tensor)."""
    return tuple(have is not None and req == have for have, req in zip(layouts, dec.required))


def _columns(args: Sequence[Any], dec: Decision, same: Sequence[bool]
             ) -> list[Sequence[torch.Tensor | None] | None]:
    """Each operand's blocks in the layout ``dec`` requires (None for a constant):
    its own where it is already there (``same``) and needs no diverge, or a diverge
    nothing records through (the identity); else from the operand cache."""
    cols: list[Sequence[torch.Tensor | None] | None] = []
    for x, req, div, sm in zip(args, dec.required, dec.diverge, same):
        if req is None:
            cols.append(None)
        elif sm and (not div or not records(x)):
            cols.append(x._shards)
        else:
            cols.append(cache.blocks(x, req, div))
    return cols


def _sums_exactly(dtype: torch.dtype) -> bool:
    """Whether Partial blocks of ``dtype`` add up the same in a wider dtype: floats and
    complex numbers do (up to rounding order); integers and bools wrap in their own."""
    return dtype.is_floating_point or dtype.is_complex


def _reduce_wrapping_partials(wrapping: list[int], args: list[Any],
                              tensors: list[Tensor | None], layouts: list[Layout | None],
                              fn: Callable[..., torch.Tensor], factors: Factors,
                              shaped: bool) -> None:
    """Reduce, in place in the lists, each operand of ``wrapping`` (integer or bool
    Partial operands) of an op whose result has another dtype. Its blocks add up in
    their own dtype (wrapping), so the rule's Partial pass-through (``x * 1.5``,
    ``x.sum()``) would add them up in the result's dtype instead: another value. A
    whole-value run is exact (the whole holds the reduced value), so only block runs
    come here; the check costs a meta call, paid only where such an operand exists."""
    call = [torch.empty(x._shape, dtype=x._dtype, device="meta") if isinstance(x, Tensor)
            else x for x in args]
    if shaped:
        call.append(factors.out_shape)
    try:
        dtype = fn(*call).dtype
    except Exception:  # no meta kernel: reduce, which is always exact
        dtype = None
    for i in wrapping:
        t = tensors[i]
        assert t is not None
        if dtype != t._dtype:
            args[i] = tensors[i] = cache.relayout(t, t._layout.without_partial())
            layouts[i] = args[i]._layout


def apply_elementwise(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor]
                      ) -> Tensor:
    """An elementwise op: when every Tensor operand has one shape and one layout
    without Partial axes (and the rest are Python numbers) the output keeps that
    layout with no rule to bind; else :func:`apply`.

    Where every operand also holds its whole value (``_whole``: a simulated mesh) or
    has a derived one (``cache.whole_of``), ``fn`` runs once on the whole values (one
    autograd node) and the result keeps its whole: one torch call instead of one per
    distinct block."""
    x0 = operands[0] if operands else None
    if (type(x0) is Tensor and x0._whole is None
            and _NONE in map(id, x0._blocks)):  # type: ignore[arg-type]
        # another process holds a device: the cached path
        hit = _hit(op, operands, fn, (), False)
        return apply(op, operands, fn) if hit is None else hit
    first: Tensor | None = None
    for x in operands:
        if isinstance(x, Tensor):
            if first is None:
                first = x
            elif x._shape != first._shape or (
                    x._layout is not first._layout and x._layout != first._layout):
                return apply(op, operands, fn)
        elif not isinstance(x, (int, float)) or isinstance(x, bool):
            return apply(op, operands, fn)
    if first is None or first._layout.is_partial or (first._whole is None and any(
            s is None for s in first._shards)):
        return apply(op, operands, fn)
    layout = first._layout
    # A failing torch op, or a result of another shape (a broadcast), takes the general
    # path, which reports the op, the rule and the blocks.
    try:
        # each Tensor's own whole, else its derived one (cache.whole_of)
        call: list[Any] = []
        derived = False
        for x in operands:
            w = x
            if isinstance(x, Tensor):
                w = x._whole
                if w is None:
                    w, derived = cache.whole_of(x), True
                    if w is None:
                        break  # (no whole: on the blocks, below)
            call.append(w)
        else:
            whole = fn(*call)
            if tuple(whole.shape) != first._shape:
                return apply(op, operands, fn)
            if not (derived and _aliases_copy(operands, call, whole)):  # (else: blocks)
                return Tensor._wrap(None, whole, layout, whole.shape, whole.dtype,
                                    whole.device, first._open)
        single = len(operands) == 1
        memo: dict[Any, torch.Tensor] = {}
        out: list[torch.Tensor] = []
        cols = [x._shards if isinstance(x, Tensor) else None for x in operands]
        for k in range(len(first._shards)):
            row = [c[k] if c is not None else x for c, x in zip(cols, operands)]
            key: Any = id(row[0]) if single else tuple(map(id, row))
            r = memo.get(key)
            if r is None:
                r = memo[key] = fn(*row)
            out.append(r)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return apply(op, operands, fn)
    if tuple(out[0].shape) != tuple(first._shards[0].shape):
        return apply(op, operands, fn)
    return Tensor(out, layout, first._shape, out[0].dtype, open_dims=first._open)


def apply_outputs(op: str, operands: Sequence[Any],
                  fn: Callable[..., Sequence[torch.Tensor]], *params: Any,
                  lead: int | None = None) -> tuple[Tensor, ...]:
    """:func:`apply` for an op whose local call returns several tensors (``eigh``,
    ``var_mean``, ``cummax``, ``lu_factor``...): output 0 follows the rule; each other
    output shares output 0's layout on its first ``lead`` dims (the batch; default:
    all of output 0's dims) and holds the rest whole. One layout decision and one
    local call per block give every output, so they always agree.

    An output whose leading dims are not output 0's (an empty placeholder, such as
    ``lstsq``'s residuals) is Replicated: every block must then give the same shape."""
    rest: dict[int, tuple[torch.Tensor, ...]] = {}

    def first(*blocks: Any) -> torch.Tensor:
        r = tuple(fn(*blocks))
        rest[id(r[0])] = r[1:]
        return r[0]

    out = apply(op, operands, first, *params)
    layout = out._layout
    assert not layout.is_partial, f"{op}: a multi-output rule leaves no Partial"
    n = len(out._shape) if lead is None else lead

    def placed(value_shape: tuple[int, ...]) -> tuple[Layout, tuple[bool, ...] | None]:
        if value_shape[:n] != out._shape[:n]:
            return Layout.replicated(layout.mesh, len(value_shape)), None
        dims = layout.dims[:n] + ((),) * (len(value_shape) - n)
        opened = None if out._open is None else out._open[:n] + (True,) * (
            len(value_shape) - n)
        return Layout(layout.mesh, dims, layout.partial), opened

    if out._whole is not None:
        extra = rest[id(out._whole)]
        return (out, *(Tensor.from_whole(e, *placed(tuple(e.shape))) for e in extra))
    rows = [None if s is None else rest[id(s)] for s in out._shards]
    have = next((r for r in rows if r is not None), None)
    if have is None:  # no device of this mesh here: shapes and dtypes from meta
        meta = [torch.empty(x.shape, dtype=x.dtype, device="meta")
                if isinstance(x, Tensor) else x for x in operands]
        have = tuple(fn(*meta))[1:]
        shapes = [tuple(out._shape[:n]) + tuple(e.shape[n:]) for e in have]
    else:
        shapes = []
        local = next(s for s in out._shards if s is not None)
        for e in have:
            if tuple(e.shape[:n]) == tuple(local.shape[:n]):
                shapes.append(tuple(out._shape[:n]) + tuple(e.shape[n:]))
            else:
                shapes.append(tuple(e.shape))
    outs: list[Tensor] = [out]
    for j, shape in enumerate(shapes):
        lay, opened = placed(shape)
        blocks = [None if r is None else r[j] for r in rows]
        outs.append(Tensor(blocks, lay, shape, have[j].dtype, open_dims=opened))
    return tuple(outs)
