"""The executor shared by every compute op, one way: bind the rule to the operands'
shapes, decide the layouts (cached by value), hand the operands in their required
layouts to the runtime, which runs the torch op where it holds the values, and wrap.

Invariants:
- One path: :func:`apply` builds the decision key (:func:`decision_key`, the one
  function that does), takes the cached decision or binds and decides, and calls the
  runtime's ``run_local`` once. Whether the op runs once on whole values (a mesh the
  simulated runtime holds wholly) or once per distinct row of blocks is the
  runtime's choice (``Backend.run_local``), never a fork here.
- Operands reach the layouts the decision requires only through the operand cache
  (:class:`shardwise.tensors.cache.Decided`: ``blocks``, ``wholes``), which also names
  the layouts each already reached (priced free by ``decide``). Its one state is the
  decision cache below.
- Decisions are cached (``_DECISIONS``, at most :data:`DECISIONS_MAX` entries, the
  oldest out first) by (op, ``shaped``, params, per operand its layout, shape, open
  dims and dtype or a marker for a Python number, and the layouts operands keep when
  any keeps one): everything ``bind`` and ``decide`` read, so a hit is the decision
  the uncached path would make. Plain torch operands (converted per call) and integer
  Partial operands (reduced first) never hit. A miss also stores its decision under
  the key the operands have after the op (the layouts it left them keeping), so the
  second identical call hits.
- Python numbers and 0-d torch tensors are broadcast constants: replicated,
  never communicated (a 0-d tensor that requires grad is placed on the mesh).
- Where an operand is replicated over a mesh axis but the output is not, each
  device computes only a share of that operand's gradient; the backend's
  ``diverge`` sums the shares (identity in the simulated runtime). Where autograd
  records nothing through the operand (no grad-requiring block in grad mode, no
  forward-mode level) the diverge is the identity and is skipped.
- The runtime's result is wrapped with the decision's layout; a process holding no
  device of the mesh gets the dtype from meta.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardwise.propagation.binding import Factors, bind
from shardwise.propagation.decide import Decision
from shardwise.runtime import backend_for
from shardwise.runtime.world import C10D
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.shapes import local_shape
from shardwise.tensors import cache
from shardwise.tensors.cache import Decided, records
from shardwise.tensors.keys import decision_key
from shardwise.tensors.symbolic import is_symbolic
from shardwise.tensors.tensor import Tensor, place

__all__ = ["DECISIONS_MAX", "apply", "apply_elementwise", "apply_outputs", "clear_decisions",
           "companion",
           "decision_cache_info", "decision_key", "decision_of", "records"]


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
    mesh = first.mesh
    out = list(operands)
    for i, x in enumerate(out):
        if isinstance(x, Tensor):
            if x.mesh is not mesh and x.mesh != mesh:
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



#: ``Tensor.from_held``, bound once (a classmethod looked up on the class binds anew each call)
_wrap = Tensor.from_held
_CONSTS = (int, float, bool, complex)  # Python numbers: broadcast constants, as _is_const

#: the decision cache: decision_key(...) -> :class:`~shardwise.tensors.cache.Decided`.
#: Bounded: the oldest entry goes once it holds DECISIONS_MAX.
_DECISIONS: dict[tuple[Any, ...], Decided] = {}
DECISIONS_MAX = 4096
"""The decision cache's bound: distinct (op, operand layouts, shapes...) keys kept."""


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


def _store(key: tuple[Any, ...], hit: Decided) -> None:
    if len(_DECISIONS) >= DECISIONS_MAX:
        del _DECISIONS[next(iter(_DECISIONS))]
    _DECISIONS[key] = hit


def apply(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor], *params: Any,
          shaped: bool = False, views: dict[int, torch.Tensor] | None = None) -> Tensor:
    """Run ``op`` (rule ``RULES[op]`` with ``params``) as ``fn`` on the local values;
    ``shaped``: ``fn`` also takes the expected local output shape; ``views``: operand
    index -> the identity view of its whole value that the computation already used
    (communication accounting hangs its backward hook there).

    The decision (bound rule, layouts, local shapes) is a cache hit for operands
    already seen in the same layouts, shapes, open dims, dtypes and kept layouts, with
    the same ``params``: the per-op path then binds and decides nothing."""
    key = decision_key(op, shaped, params, operands)
    try:
        hit = None if key is None else _DECISIONS.get(key)
    except TypeError:  # symbolic sizes (torch.compile, dynamic shapes): decided per trace
        key = hit = None
    args, stored = operands, False
    if hit is None:
        args, hit, stored = _decide(op, operands, fn, params, shaped, key)
    # the decided op, run by the runtime where it holds the values, and wrapped
    dec = hit.dec
    mesh = dec.output.mesh
    # torch's default group (None outside a process world): what backend_for's answer
    # depends on besides the mesh
    world = C10D._default_pg
    backend = hit.backend
    if backend is None or hit.world is not world:
        backend = hit.backend = backend_for(mesh)
        hit.world = world
    local, first = backend.run_local(op, fn, args, hit, shaped, views)
    if first is None:  # no device of this mesh here: the dtype from meta
        out = _wrap(local, dec.output, hit.size, _meta_dtype(fn, args, dec, shaped),
                    backend_for(mesh).device_of(mesh, 0), dec.out_open, hit.shape)
    else:
        out = _wrap(local, dec.output, hit.size, first.dtype, first.device, dec.out_open,
                    hit.shape)
    if args is not operands and stored:
        # the operands may keep layouts now: the second identical call's key
        again = decision_key(op, shaped, params, operands)
        if again is not None and again not in _DECISIONS:
            _store(again, Decided.of(hit.factors, [x if isinstance(x, Tensor) else None
                                                 for x in args]))
    return out


def _decide(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor],
            params: tuple[Any, ...], shaped: bool, key: tuple[Any, ...] | None
            ) -> tuple[list[Any], Decided, bool]:
    """:func:`apply` without a cached decision: check and convert the operands (a new
    list), bind, decide, and remember the decision under ``key`` (None: not
    cacheable). Returns the operands, the decision and whether it was stored."""
    args = _operands(op, operands)
    tensors: list[Tensor | None] = [x if isinstance(x, Tensor) else None for x in args]
    wrapping = [i for i, x in enumerate(tensors)  # integer or bool Partial operands
                if x is not None and x.dist_layout.is_partial and not _sums_exactly(x.dtype)]
    factors = _bind(op, tuple(() if x is None else tuple(x.shape) for x in tensors), params)
    if wrapping:
        _reduce_wrapping_partials(wrapping, args, tensors, fn, factors, shaped)
    hit = Decided.of(factors, tensors)
    if key is None or wrapping:  # (a wrapping operand was reduced first: not cached)
        return args, hit, False
    _store(key, hit)
    return args, hit, True


def decision_of(op: str, operands: Sequence[Any], *params: Any) -> Decision | None:
    """The decision :func:`apply` takes for these operands, from the cache or made and
    cached now, where every operand is a Tensor on one mesh with no integer Partial;
    else None. Lets a handler choose its local call by the layouts before it runs, the
    same on the first call as on later ones (``F.linear`` adds its bias in the same
    call).

    >>> decision_of("linear", ()) is None
    True
    """
    key = decision_key(op, False, params, operands) if operands else None
    try:
        hit = None if key is None else _DECISIONS.get(key)
    except TypeError:  # symbolic sizes: decided per trace, never cached
        key, hit = (), None
    if hit is not None:  # (stored only for operands that pass the checks below)
        return hit.dec
    if key is None or not all(isinstance(x, Tensor) for x in operands):
        return None
    mesh = operands[0].mesh
    for x in operands:
        if x.mesh != mesh or (x.dist_layout.is_partial and not _sums_exactly(x.dtype)):
            return None  # (apply names the two meshes in its error, or reduces first)
    factors = _bind(op, tuple(tuple(x.shape) for x in operands), params)
    hit = Decided.of(factors, operands)
    if key:
        _store(key, hit)
    return hit.dec


def _bind(op: str, shapes: tuple[tuple[Any, ...], ...], params: tuple[Any, ...]) -> Factors:
    """``bind``, cached, or uncached where a size is symbolic (torch.compile's dynamic
    shapes: tensors/symbolic.py; a SymInt has no hash, and its checks are guards)."""
    try:
        return bind(op, shapes, *params)
    except TypeError:
        if not any(is_symbolic(s) for s in shapes) and not is_symbolic(_flat(params)):
            raise
        return bind.__wrapped__(op, shapes, *params)


def _flat(params: Any) -> list[Any]:
    if isinstance(params, (tuple, list)):
        return [v for p in params for v in _flat(p)]
    return [params] if isinstance(params, (int, torch.SymInt)) else []


def _meta_dtype(fn: Callable[..., torch.Tensor], args: Sequence[Any], dec: Decision,
                shaped: bool) -> torch.dtype:
    """The output dtype on a process that holds no device of the mesh."""
    call: list[Any] = []
    for x, req in zip(args, dec.required):
        if isinstance(x, Tensor) and req is not None:
            shape = local_shape(tuple(x.shape), req, req.mesh.coord_of(0))
            call.append(torch.empty(shape, dtype=x.dtype, device="meta"))
        else:
            call.append(x)
    if shaped:
        call.append(dec.local_shapes[0])
    return fn(*call).dtype


def _sums_exactly(dtype: torch.dtype) -> bool:
    """Whether Partial blocks of ``dtype`` add up the same in a wider dtype: floats and
    complex numbers do (up to rounding order); integers and bools wrap in their own."""
    return dtype.is_floating_point or dtype.is_complex


def _reduce_wrapping_partials(wrapping: list[int], args: list[Any],
                              tensors: list[Tensor | None], fn: Callable[..., torch.Tensor],
                              factors: Factors, shaped: bool) -> None:
    """Reduce, in place in the lists, each operand of ``wrapping`` (integer or bool
    Partial operands) of an op whose result has another dtype. Its blocks add up in
    their own dtype (wrapping), so the rule's Partial pass-through (``x * 1.5``,
    ``x.sum()``) would add them up in the result's dtype instead: another value. The
    check costs a meta call, paid only where such an operand exists."""
    call = [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Tensor)
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
        if dtype != t.dtype:
            args[i] = tensors[i] = cache.relayout(t, t.dist_layout.without_partial())


#: an elementwise op: :func:`apply` with its rule (the elementwise families' entry point;
#: their rules keep a shared layout, and the decision is cached like any other)
apply_elementwise = apply


def companion(extras: Mapping[int, Sequence[torch.Tensor]], j: int, b: torch.Tensor
               ) -> torch.Tensor:
    """Result ``j`` of the further results of the local call that gave ``b``."""
    return extras[id(b)][j]


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

    def leading(*blocks: Any) -> torch.Tensor:
        r = tuple(fn(*blocks))
        rest[id(r[0])] = r[1:]
        return r[0]

    out = apply(op, operands, leading, *params)
    layout = out.dist_layout
    shape0 = tuple(out.shape)
    assert not layout.is_partial, f"{op}: a multi-output rule leaves no Partial"
    n = len(shape0) if lead is None else lead

    def placed(value_shape: tuple[int, ...]) -> tuple[Layout, tuple[bool, ...] | None]:
        if value_shape[:n] != shape0[:n]:
            return Layout.replicated(layout.mesh, len(value_shape)), None
        dims = layout.dims[:n] + ((),) * (len(value_shape) - n)
        opened = out.open_dims[:n] + (True,) * (len(value_shape) - n)
        return Layout(layout.mesh, dims, layout.partial), None if all(opened) else opened

    # each further output is held as output 0 is (the same buffers' companions)
    outs: list[Tensor] = [out]
    local = out.held
    first = local.first()
    extra = rest[id(first)] if first is not None else ()
    for j, e in enumerate(extra):
        assert first is not None
        shape = (shape0[:n] + tuple(e.shape[n:])
                 if tuple(e.shape[:n]) == tuple(first.shape[:n]) else tuple(e.shape))
        lay, opened = placed(shape)
        held = local.map(functools.partial(companion, rest, j), lay)
        outs.append(Tensor.from_held(held, lay, torch.Size(shape), e.dtype, e.device, opened))
    if first is None:  # no device of this mesh here: shapes and dtypes from meta
        meta = [torch.empty(x.shape, dtype=x.dtype, device="meta")
                if isinstance(x, Tensor) else x for x in operands]
        for e in tuple(fn(*meta))[1:]:
            shape = shape0[:n] + tuple(e.shape[n:])
            lay, opened = placed(shape)
            outs.append(Tensor([None] * lay.mesh.num_devices, lay, shape, e.dtype,
                               open_dims=opened))
    return tuple(outs)
