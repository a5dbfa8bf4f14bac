"""Linear algebra on shardwise Tensors: batched ``torch.linalg`` (det, inv, solve,
cholesky, qr, eigh, svd, lu...), norms over named dims, cross, vecdot, distances,
normalize, trapezoid, diff, gradient, cov (the matmul family is :mod:`matmuls`).

Invariants:
- Batched linalg (rule ``batched``): the batch dims broadcast and shard freely, each
  operand's matrix or vector dims stay whole, and every batch element is solved on its
  own, so a sharded batch is exact. The output's core sizes come from torch's meta
  kernel on the global shapes (or, where an op has none, from a call on an empty
  batch), never from a guess; an output that does not lead with the batch falls back.
- Arguments that move the core dims (``dim=`` of a norm, a 1-D ``x`` of trapezoid
  along another dim) either get a rule that names them or fall back: a rule never
  assumes the core is trailing when the op was told otherwise.
- Tensor arguments that are not operands of a rule (shardwise tensors in
  ``gradient``'s spacing) fall back: exact values, a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.execute import apply, apply_outputs
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, reduce_dims, register
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__ = ["aligned", "batched", "whole"]


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(*(torch.Size(s) for s in shapes)))
    except RuntimeError:
        return None


def _probe(call: Callable[..., Any], tensors: Sequence[Any], cores: Sequence[int],
           empty: bool = True) -> tuple[Any, list[tuple[int, ...]], bool]:
    """torch's result on meta tensors of the global shapes: (the result, each output's
    shape, whether the shapes are the global ones). Ops without a meta kernel run on
    an empty batch instead (shapes then lead with that batch of 0)."""
    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") if torch.is_tensor(t) else t
             for t in tensors]
    try:
        r = call(*metas)
        glob = True
    except NotImplementedError:
        if not empty:
            raise
        empties = [torch.zeros((0, *t.shape[t.ndim - k:]), dtype=t.dtype)
                   if torch.is_tensor(t) else t for t, k in zip(tensors, cores)]
        r = call(*empties)
        glob = False
    outs = r if isinstance(r, (tuple, list)) else (r,)
    return r, [tuple(o.shape) if torch.is_tensor(o) else () for o in outs], glob


def batched(func: Any, tensors: Sequence[Any], cores: Sequence[int],
            call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            out_core: tuple[int, ...] | None = None, empty_probe: bool = True) -> Any:
    """``call(*blocks)`` (torch's ``func``) on ``tensors`` whose last ``cores[i]`` dims
    are each one problem's matrix or vector: the batch dims shard, the cores stay whole
    (rule ``batched``). ``args``/``kwargs``: the original call, for the fallback when
    the op's outputs do not lead with the batch. ``out_core``: the output's core
    shape where the op's own rule gives it (one output; no probe then).
    ``empty_probe=False``: an op whose tensors are all core (no batch), where a call
    on an empty batch would mean another op, falls back without a meta kernel."""
    ts = on_mesh(list(tensors))
    if out_core is not None:
        return apply("batched", ts, call, tuple(cores), out_core)
    batch = _broadcast([t.shape[:t.ndim - k] for t, k in zip(ts, cores)])
    if batch is None or any(k > t.ndim for t, k in zip(ts, cores)):
        return fallback(func, args, kwargs)  # torch raises its own error there
    try:
        r, shapes, glob = _probe(call, ts, cores, empty_probe)
    except NotImplementedError:
        return fallback(func, args, kwargs)
    nb = len(batch)
    lead = batch if glob else (0,)
    if not (shapes and all(s[:len(lead)] == lead for s in shapes[:1])):
        return fallback(func, args, kwargs)
    out_core = shapes[0][len(lead):]
    for o, s in zip(r if isinstance(r, (tuple, list)) else (r,), shapes):
        if not torch.is_tensor(o) or (s[:len(lead)] != lead and 0 not in s):
            return fallback(func, args, kwargs)
    params = (tuple(cores), tuple(out_core))
    if not isinstance(r, (tuple, list)):
        return apply("batched", ts, call, *params)
    return type(r)(apply_outputs("batched", ts, call, *params, lead=nb))


def _matrix_op(func: Any, cores: Sequence[int] | Callable[..., Sequence[int]],
               tensor_kwargs: tuple[str, ...] = ()) -> Callable[..., Any]:
    """The handler of a batched linalg op whose leading positional arguments are its
    tensors (``cores`` per tensor, or a function of them); tensors among
    ``tensor_kwargs`` (``atol=``, ``rtol=``) join as batch-only operands (core 0)."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            return fallback(func, args, kwargs)  # raises: a write without a rule
        n = 0
        while n < len(args) and torch.is_tensor(args[n]):
            n += 1
        ts, rest = list(args[:n]), args[n:]
        cs = list(cores(*ts) if callable(cores) else cores)[:n]
        if len(cs) != n:
            return fallback(func, args, kwargs)
        names = [k for k in tensor_kwargs if torch.is_tensor(kwargs.get(k))]
        if any(isinstance(v, Tensor) for k, v in kwargs.items() if k not in names):
            return fallback(func, args, kwargs)
        plain = {k: v for k, v in kwargs.items() if k not in names}
        ts += [kwargs[k] for k in names]
        cs += [0] * len(names)

        def call(*blocks: Any) -> Any:
            named = dict(zip(names, blocks[n:]))
            return func(*blocks[:n], *rest, **plain, **named)

        return batched(func, ts, cs, call, args, kwargs)

    return handler


def _rhs_cores(a: Any, b: Any, *more: Any) -> tuple[int, ...]:
    """linalg.solve and lstsq: ``B`` is a batch of vectors when it is 1-D or ``A``'s
    shape without its last dim (torch's rule), else of matrices."""
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    return (2, 1 if vector else 2, *(2 for _ in more))


_MATRIX = {  # (functions, tensor methods) -> the cores of their leading tensors
    (torch.linalg.det, torch.det, torch.logdet, torch.linalg.slogdet, torch.slogdet,
     torch.linalg.inv, torch.linalg.inv_ex, torch.inverse, torch.linalg.cholesky,
     torch.linalg.cholesky_ex, torch.cholesky, torch.cholesky_inverse, torch.linalg.eig,
     torch.linalg.eigvals, torch.linalg.eigh, torch.linalg.eigvalsh, torch.linalg.qr,
     torch.qr, torch.linalg.svd, torch.svd, torch.linalg.svdvals, torch.linalg.lu,
     torch.linalg.lu_factor, torch.linalg.lu_factor_ex, torch.linalg.ldl_factor,
     torch.linalg.ldl_factor_ex, torch.linalg.matrix_exp, torch.matrix_exp,
     torch.linalg.cond, torch.linalg.matrix_power, torch.matrix_power, torch.geqrf,
     torch.pinverse, torch.lu): (2,),
    (torch.cholesky_solve, torch.linalg.solve_triangular, torch.triangular_solve): (2, 2),
    (torch.linalg.householder_product, torch.orgqr): (2, 1),
    (torch.ormqr,): (2, 1, 2),
    (torch.linalg.lu_solve, torch.linalg.ldl_solve): (2, 1, 2),
    (torch.lu_solve,): (2, 2, 1),
    (torch.lu_unpack,): (2, 1),
}
for _funcs, _cores in _MATRIX.items():
    for _f in _funcs:
        method = getattr(TensorMethod, _f.__name__, None) if _f is not torch.lu else None
        register(_f, method)(_matrix_op(_f, _cores))
register(TensorMethod.lu)(_matrix_op(TensorMethod.lu, (2,)))
for _f in (torch.linalg.matrix_rank, torch.linalg.pinv):
    register(_f)(_matrix_op(_f, (2,), ("atol", "rtol", "tol", "rcond")))
for _f in (torch.linalg.solve, torch.linalg.solve_ex, torch.linalg.lstsq):
    register(_f)(_matrix_op(_f, _rhs_cores))


@register(torch.linalg.vander)
def vander(x: Any, *, N: Any = None) -> Any:
    # every element its own row of powers: x's dims all batch, a new core of size N; N
    # defaults to x's last dim, which a block holds only part of: the global size here
    n = x.shape[-1] if N is None and x.ndim else N
    return batched(torch.linalg.vander, [x], (0,), lambda s: torch.linalg.vander(s, N=n),
                   (x,), {"N": N})


def whole(func: Any, tensors: Sequence[Any], call: Callable[..., Any],
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``call(*blocks)`` with every dim of ``tensors`` whole (rule ``batched`` with no
    batch; the planner gathers them): torch's own op on the whole values, its output
    shape from torch's meta kernel (no kernel: the fallback)."""
    return batched(func, tensors, [t.ndim for t in tensors], call, args, kwargs,
                   empty_probe=False)


def _whole_op(func: Any, shape_of: Callable[..., tuple[int, ...]] | None = None
              ) -> Callable[..., Any]:
    """An op over whole tensors with no batch (cov, corrcoef, tensorinv, tensorsolve):
    every dim of its tensor arguments stays whole (the planner gathers them: a rule)."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            return fallback(func, args, kwargs)
        names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        n = 0
        while n < len(args) and torch.is_tensor(args[n]):
            n += 1
        ts = list(args[:n]) + [kwargs[k] for k in names]
        plain = {k: v for k, v in kwargs.items() if k not in names}

        def call(*blocks: Any) -> Any:
            return func(*blocks[:n], *args[n:], **plain, **dict(zip(names, blocks[n:])))

        return batched(func, ts, [t.ndim for t in ts], call, args, kwargs,
                       None if shape_of is None else shape_of(*ts), empty_probe=False)

    return handler


def _variables(x: Any, *more: Any) -> tuple[int, ...]:
    """cov/corrcoef of ``(variables, observations)``: variables x variables (one
    variable, 1-D or one row: a scalar, as torch squeezes it)."""
    return () if x.ndim < 2 or x.shape[0] == 1 else (x.shape[0], x.shape[0])


for _f in (torch.cov, torch.corrcoef):
    register(_f, getattr(TensorMethod, _f.__name__, None))(_whole_op(_f, _variables))
for _f in (torch.linalg.tensorinv, torch.linalg.tensorsolve):
    register(_f)(_whole_op(_f))


# --- norms over named dims: the reduced dims whole, the others kept ----------------------
@register(torch.linalg.matrix_norm)
def matrix_norm(a: Any, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *,
                dtype: Any = None, out: Any = None) -> Any:
    if out is not None or isinstance(ord, Tensor) or a.ndim < 2:
        return fallback(torch.linalg.matrix_norm, (a, ord, dim, keepdim),
                        {"dtype": dtype, "out": out})
    dims = reduce_dims(a, dim, "matrix_norm dim")
    return apply("reduce_full", (a,), lambda s: torch.linalg.matrix_norm(
        s, ord, dim, keepdim, dtype=dtype), dims, keepdim)


@register(torch.linalg.norm)
def linalg_norm(a: Any, ord: Any = None, dim: Any = None, keepdim: bool = False, *,
                dtype: Any = None, out: Any = None) -> Any:
    if out is not None or isinstance(ord, Tensor):
        return fallback(torch.linalg.norm, (a, ord, dim, keepdim), {"dtype": dtype, "out": out})
    dims = reduce_dims(a, dim, "norm dim")
    return apply("reduce_full", (a,), lambda s: torch.linalg.norm(
        s, ord, dim, keepdim, dtype=dtype), dims, keepdim)


# --- broadcast ops with whole dims (rule ``aligned``) --------------------------------------
def aligned(func: Any, tensors: Sequence[Any], whole: Sequence[int],
            call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``call(*blocks)`` on ``tensors`` broadcast right-aligned, frame positions
    ``whole`` (negative: from the end) kept whole: the output's dims are read off
    torch's meta result (dims of the frame that are not whole keep their factor, the
    rest are new whole dims). A result that is not laid out so falls back."""
    ts = on_mesh(list(tensors))
    frame = _broadcast([t.shape for t in ts])
    if frame is None or (not frame and whole):
        return fallback(func, args, kwargs)
    n = len(frame)
    ws = tuple(sorted({w % n for w in whole})) if n else ()
    try:
        r, shapes, glob = _probe(call, ts, [t.ndim for t in ts])
    except NotImplementedError:
        return fallback(func, args, kwargs)
    if not glob or (isinstance(r, (tuple, list)) and (len(r) != 1 or not torch.is_tensor(r[0]))):
        return fallback(func, args, kwargs)
    shape = shapes[0]
    keep = [q for q in range(n) if q not in ws]
    # the output: the frame's kept dims in order, each whole dim dropped or resized
    out: list[tuple[str, int]] = []
    if len(shape) == n:
        for q in range(n):
            out.append(("b", q) if q not in ws else ("n", shape[q]))
    elif len(shape) == len(keep):
        out = [("b", q) for q in keep]
    else:
        return fallback(func, args, kwargs)
    if any(k == "b" and shape[j] != frame[v] for j, (k, v) in enumerate(out)):
        return fallback(func, args, kwargs)
    single = not isinstance(r, (tuple, list))
    fn = call if single else (lambda *xs: call(*xs)[0])
    y = apply("aligned", ts, fn, ws, tuple(out))
    return y if single else type(r)([y])


def _cross_dim(shape: tuple[int, ...]) -> int | None:
    return next((d for d, s in enumerate(shape) if s == 3), None)


@register(torch.cross, TensorMethod.cross)
def cross(a: Any, b: Any, dim: Any = None, *, out: Any = None) -> Any:
    args, kwargs = (a, b), {"dim": dim, **({"out": out} if out is not None else {})}
    frame = _broadcast([a.shape, b.shape])
    d = dim if dim is not None else (None if frame is None else _cross_dim(frame))
    if out is not None or d is None or frame is None:
        return fallback(torch.cross, args, kwargs)
    return aligned(torch.cross, [a, b], [normalize_dim(d, len(frame))],
                   lambda x, y: torch.cross(x, y, dim=dim), args, kwargs)


@register(torch.linalg.cross)
def linalg_cross(a: Any, b: Any, *, dim: int = -1, out: Any = None) -> Any:
    args, kwargs = (a, b), {"dim": dim, **({"out": out} if out is not None else {})}
    frame = _broadcast([a.shape, b.shape])
    if out is not None or not frame:
        return fallback(torch.linalg.cross, args, kwargs)
    return aligned(torch.linalg.cross, [a, b], [normalize_dim(dim, len(frame))],
                   lambda x, y: torch.linalg.cross(x, y, dim=dim), args, kwargs)


@register(torch.linalg.vecdot)
def vecdot(x: Any, y: Any, *, dim: int = -1, out: Any = None) -> Any:
    args, kwargs = (x, y), {"dim": dim, **({"out": out} if out is not None else {})}
    frame = _broadcast([x.shape, y.shape])
    if out is not None or not frame:
        return fallback(torch.linalg.vecdot, args, kwargs)
    return aligned(torch.linalg.vecdot, [x, y], [normalize_dim(dim, len(frame))],
                   lambda a, b: torch.linalg.vecdot(a, b, dim=dim), args, kwargs)


@register(torch.dist, TensorMethod.dist)
def dist(a: Any, b: Any, p: Any = 2) -> Any:
    frame = _broadcast([a.shape, b.shape])
    if frame is None or not torch.is_tensor(b) or torch.is_tensor(p):
        return fallback(torch.dist, (a, b, p), {})
    return aligned(torch.dist, [a, b], range(len(frame)), lambda x, y: torch.dist(x, y, p),
                   (a, b, p), {})


@register(F.pairwise_distance, torch.pairwise_distance)
def pairwise_distance(x1: Any, x2: Any, p: float = 2.0, eps: float = 1e-6,
                      keepdim: bool = False) -> Any:
    frame = _broadcast([x1.shape, x2.shape]) if torch.is_tensor(x2) else None
    if not frame:
        return fallback(F.pairwise_distance, (x1, x2, p, eps, keepdim), {})
    return aligned(F.pairwise_distance, [x1, x2], [-1], lambda a, b: F.pairwise_distance(
        a, b, p, eps, keepdim), (x1, x2, p, eps, keepdim), {})


@register(F.cosine_similarity, torch.cosine_similarity)
def cosine_similarity(x1: Any, x2: Any, dim: int = 1, eps: float = 1e-8) -> Any:
    frame = _broadcast([x1.shape, x2.shape]) if torch.is_tensor(x2) else None
    if not frame:
        return fallback(F.cosine_similarity, (x1, x2, dim, eps), {})
    return aligned(F.cosine_similarity, [x1, x2], [normalize_dim(dim, len(frame))],
                   lambda a, b: F.cosine_similarity(a, b, dim, eps), (x1, x2, dim, eps), {})


@register(F.normalize)
def normalize(x: Any, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None
              ) -> Any:
    if out is not None or x.ndim == 0:
        return fallback(F.normalize, (x, p, dim, eps), {"out": out} if out is not None
                        else {})
    d = normalize_dim(dim, x.ndim, "normalize dim")
    return apply("lp_normalize", (x,), lambda s: F.normalize(s, p, dim, eps), (d,))


def _spaced(func: Any) -> Callable[..., Any]:
    """trapezoid/trapz/cumulative_trapezoid: along ``dim`` (whole), with a spacing ``x``
    broadcast against ``y`` (a 1-D ``x`` lies along ``dim``: whole too)."""

    def handler(y: Any, x: Any = None, *, dx: Any = None, dim: int = -1) -> Any:
        args = (y,) if x is None else (y, x)
        kwargs = {"dim": dim, **({"dx": dx} if dx is not None else {})}
        if not torch.is_tensor(x) and x is not None:  # trapz(y, dx, dim) spells dx positionally
            return fallback(func, args, kwargs)
        if y.ndim == 0:
            return fallback(func, args, kwargs)
        d = normalize_dim(dim, y.ndim, f"{func.__name__} dim")
        if x is None:
            return aligned(func, [y], [d], lambda s: func(s, **kwargs), args, kwargs)
        if x.ndim == 1 and d != y.ndim - 1:  # a 1-D spacing lies along dim, not last
            return fallback(func, args, kwargs)
        frame = _broadcast([y.shape, x.shape])
        if frame is None or len(frame) != y.ndim or (x.ndim == 1 and x.shape[0] == 1):
            return fallback(func, args, kwargs)
        return aligned(func, [y, x], [d], lambda s, t: func(s, t, dim=dim), args, kwargs)

    return handler


for _f in (torch.trapezoid, torch.trapz, torch.cumulative_trapezoid):
    register(_f)(_spaced(_f))


@register(torch.diff, TensorMethod.diff)
def diff(x: Any, n: int = 1, dim: int = -1, prepend: Any = None, append: Any = None) -> Any:
    args = (x, n, dim, prepend, append)
    if x.ndim == 0:
        return fallback(torch.diff, args, {})
    d = normalize_dim(dim, x.ndim, "diff dim")
    extra = [t for t in (prepend, append) if torch.is_tensor(t)]
    if any(t.ndim != x.ndim for t in extra):  # a 0-d prepend/append is expanded by torch
        return fallback(torch.diff, args, {})

    def call(s: torch.Tensor, *pa: torch.Tensor) -> torch.Tensor:
        it = iter(pa)
        p = next(it) if torch.is_tensor(prepend) else prepend
        a = next(it) if torch.is_tensor(append) else append
        return torch.diff(s, n, dim, p, a)

    return aligned(torch.diff, [x, *extra], [d], call, args, {})


@register(torch.gradient)
def gradient(x: Any, *, spacing: Any = 1, dim: Any = None, edge_order: int = 1) -> Any:
    kwargs = {"spacing": spacing, "dim": dim, "edge_order": edge_order}
    spaced = spacing if isinstance(spacing, (list, tuple)) else [spacing]
    if any(isinstance(s, Tensor) for s in spaced) or x.ndim == 0:
        return fallback(torch.gradient, (x,), kwargs)
    dims = reduce_dims(x, dim, "gradient dim")
    outs = apply_outputs("aligned", (x,), lambda s: torch.gradient(s, **kwargs), dims,
                         tuple(("n", s) if q in dims else ("b", q)
                               for q, s in enumerate(x.shape)))
    return tuple(outs)
