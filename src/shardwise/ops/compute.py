"""Compute ops on :class:`~shardwise.Tensor`, with sharding propagation.

Every op runs the same way (:func:`shardwise.ops.execute.apply`): bind its
rule from the table in :mod:`shardwise.propagation.rules` to the operand shapes, let
:mod:`shardwise.propagation.decide` pick the cheapest layouts, reshard each
operand through the planner, then run the torch op on the local shards.

Invariants:
- One rule per op, from the table; the functions here only pick the rule's
  arguments (dims, index, shape) and the local torch op.
- Inputs are never mutated; outputs may be views of inputs (reshape, permute,
  getitem). Replicas of the output share one buffer (see ``execute``).

On ``DeviceMesh(dp=2, tp=2)``, ``x`` Sharded(0) on dp and ``w`` Sharded(1) on
tp, ``x @ w`` needs no communication::

    device (dp,tp)   (0,0)            (0,1)            (1,0)            (1,1)
    x @ w            x[0:2] @ w[:,0]  x[0:2] @ w[:,1]  x[2:4] @ w[:,0]  x[2:4] @ w[:,1]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.execute import apply, apply_elementwise
from shardwise.propagation.binding import normalize_index
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__ = [
    "add", "amax", "amin", "cat", "div", "einsum", "eq", "exp", "ge", "gelu", "gt", "le",
    "log", "lt", "matmul", "maximum", "mean", "minimum", "mul", "ne", "neg", "permute",
    "pow", "relu", "reshape", "sigmoid", "silu", "softmax", "sqrt", "sub", "sum", "tanh",
    "transpose", "where", "getitem", "ZeroGrad", "with_zero_grad",
]


# --- elementwise --------------------------------------------------------------------------
def _elementwise(op: str, fn: Callable[..., torch.Tensor]) -> Callable[..., Tensor]:
    def run(*operands: Any) -> Tensor:
        return apply(op, operands, fn)

    run.__name__ = run.__qualname__ = op
    return run


add = _elementwise("add", operator.add)
add.__doc__ = """``a + b`` (numpy broadcasting). Linear: Partial(SUM) passes through when
every Tensor operand is Partial(SUM) on that mesh axis; a replicated partner is made
Partial locally when that is the cheapest choice (``p[P] + r[R]``: no communication),
a Python constant is not (``p[P] + 1`` resolves ``p``). ``x[S(0)] + y[R]`` slices
``y``; ``x[S(0)] + y[S(1)]`` is one all_to_all of ``y``."""
sub = _elementwise("sub", operator.sub)
sub.__doc__ = "``a - b``; see :func:`add`."
mul = _elementwise("mul", operator.mul)
mul.__doc__ = """``a * b``. Multilinear: one Partial(SUM) operand times replicated ones
stays Partial(SUM) (no communication)."""
div = _elementwise("div", operator.truediv)
div.__doc__ = "``a / b``; a Partial(SUM) numerator over a replicated denominator stays Partial."
pow = _elementwise("pow", operator.pow)
pow.__doc__ = "``a ** b`` (nonlinear: a Partial operand is resolved first)."
maximum = _elementwise("maximum", torch.maximum)
minimum = _elementwise("minimum", torch.minimum)
eq = _elementwise("eq", operator.eq)
ne = _elementwise("ne", operator.ne)
lt = _elementwise("lt", operator.lt)
le = _elementwise("le", operator.le)
gt = _elementwise("gt", operator.gt)
ge = _elementwise("ge", operator.ge)
neg = _elementwise("neg", operator.neg)
neg.__doc__ = "``-a`` (linear: a Partial(SUM) stays Partial)."
relu = _elementwise("relu", torch.relu)
silu = _elementwise("silu", F.silu)
sigmoid = _elementwise("sigmoid", torch.sigmoid)
tanh = _elementwise("tanh", torch.tanh)
exp = _elementwise("exp", torch.exp)
log = _elementwise("log", torch.log)
sqrt = _elementwise("sqrt", torch.sqrt)
abs_ = _elementwise("abs", torch.abs)
for _f in (maximum, minimum, eq, ne, lt, le, gt, ge, relu, silu, sigmoid, tanh, exp, log, sqrt,
           abs_):
    _f.__doc__ = (f"Elementwise ``{_f.__name__}`` (nonlinear: Partial operands are resolved "
                  "first; shardings of the operands are kept where they agree).")


def gelu(x: Any, approximate: str = "none") -> Tensor:
    """GELU, elementwise (nonlinear: a Partial input is resolved first)."""
    return apply("gelu", (x,), lambda s: F.gelu(s, approximate=approximate))


def where(cond: Any, a: Any, b: Any) -> Tensor:
    """``a`` where ``cond`` else ``b`` (broadcasting; Partial operands are resolved)."""
    return apply("where", (cond, a, b), torch.where)


# --- contractions -------------------------------------------------------------------------
def matmul(a: Any, b: Any) -> Tensor:
    """``a @ b`` with torch.matmul semantics (1-D and batched cases).

    Rule ``"... i k, ... k j -> ... i j"``: a sharded ``k`` gives a Partial(SUM)
    output with no communication. On ``DeviceMesh(tp=2)``, ``h[S(1)] @ w[S(0)]``::

        device      CPU(0)              CPU(1)
        output      h[:, :2] @ w[:2]    h[:, 2:] @ w[2:]     Partial(sum)
    """
    return apply("matmul", (a, b), torch.matmul)


def einsum(equation: str, *operands: Any) -> Tensor:
    """torch.einsum on shardwise Tensors: contracted letters that are sharded
    give a Partial(SUM) output (no communication); ``"bij,bjk->bik"``."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return apply("einsum", operands, lambda *xs: torch.einsum(equation, *xs), equation)


# --- reductions ---------------------------------------------------------------------------
def _dims(x: Tensor, dim: Any, op: str) -> tuple[int, ...]:
    n = x.ndim
    if type(dim) is int and -n <= dim < n:  # one dim in range: the common call
        return (dim % n,)
    dims = (dim,) if isinstance(dim, int) else tuple(dim or ())
    if not dims:  # None or an empty list: torch's sum/mean/amax/amin reduce every dim
        return tuple(range(x.ndim))
    out = tuple(sorted({normalize_dim(d, max(x.ndim, 1), f"{op} dim") for d in dims}))
    return out if x.ndim else ()


def _reducer(op: str, fn: Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor],
             doc: str) -> Callable[..., Tensor]:
    def run(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
        t = x if type(x) is Tensor else _need(x, op)
        n = t.ndim  # (one dim in range, the common call: _dims's first case)
        dims = (dim % n,) if type(dim) is int and -n <= dim < n else _dims(t, dim, op)
        # a 0-d value reduces over no dim, still in torch's result dtype (bool sums to int64)
        return apply(op, (t,), lambda s: fn(s, dims, keepdim), dims, keepdim)

    run.__name__ = run.__qualname__ = op
    run.__doc__ = doc
    return run


sum = _reducer("sum", torch.sum, """Sum over ``dim``
(all dims if None). A sharded reduced dim gives Partial(SUM), no communication::

    x[S(0)] on DeviceMesh(x=2):   CPU(0) x[:2].sum(0)   CPU(1) x[2:].sum(0)   Partial(sum)""")


def mean(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Mean over ``dim``: local sum / global count, so a sharded reduced dim gives
    Partial(SUM) like :func:`sum` (no communication)."""
    t = _need(x, "mean")
    dims = _dims(t, dim, "mean")
    count = math.prod(t.shape[d] for d in dims)
    return apply("mean", (t,), lambda s: (torch.sum(s, dims, keepdim=keepdim) if dims else s)
                  / count, dims, keepdim)


def _extreme(fn: Callable[..., torch.Tensor], identity: float) -> Callable[..., torch.Tensor]:
    def local(s: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
        if s.numel() == 0 and any(s.shape[d] == 0 for d in dims):  # an empty shard
            shape = [1 if d in dims else n for d, n in enumerate(s.shape)] if keepdim else [
                n for d, n in enumerate(s.shape) if d not in dims]
            value = identity if s.is_floating_point() else (
                torch.iinfo(s.dtype).min if identity < 0 else torch.iinfo(s.dtype).max)
            return torch.full(shape, value, dtype=s.dtype, device=s.device)
        return fn(s, dims, keepdim=keepdim)

    return local


amax = _reducer("amax", _extreme(torch.amax, -math.inf), """Max over ``dim``. A sharded
reduced dim gives Partial(MAX) (empty shards hold -inf); a Partial(SUM) input is
resolved first.""")
amin = _reducer("amin", _extreme(torch.amin, math.inf), """Min over ``dim``; see :func:`amax`
(Partial(MIN)).""")


# --- layout of dims -----------------------------------------------------------------------
def _need(x: Any, op: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ShardingTypeError(f"{op} needs a shardwise.Tensor, got {type(x).__name__}. "
                                "Wrap it with shardwise.tensor(...).")
    return x


def permute(x: Tensor, *dims: Any) -> Tensor:
    """Reorder dims; each dim keeps its sharding (no communication)."""
    t = _need(x, "permute")
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])
    n = max(t.ndim, 1)
    perm = tuple(normalize_dim(d, n, "permute dim") for d in dims)
    return apply("permute", (t,), lambda s: s.permute(perm), perm)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dims; each keeps its sharding (no communication)."""
    t = _need(x, "transpose")
    n = t.ndim
    a = normalize_dim(dim0, max(n, 1), "transpose dim0")  # a 0-d tensor has dim 0 (-1)
    b = normalize_dim(dim1, max(n, 1), "transpose dim1")
    if n == 0:
        return t
    perm = list(range(max(n, 1)))
    perm[a], perm[b] = perm[b], perm[a]
    order = tuple(perm)  # normalized already: straight to the rule
    return apply("permute", (t,), lambda s: s.permute(order), order)


def _reshape_block(s: torch.Tensor, local: tuple[int, ...]) -> torch.Tensor:
    """One block to its block of the output (``apply(..., shaped=True)`` passes it):
    the global target shape would not fit a block of a sharded dim."""
    return s.reshape(local)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """A new shape. Dims that stay unchanged keep their sharding; a dim split,
    merged or regrouped keeps it on the run's first dim when every block stays a
    contiguous piece of the run, and then no block moves (``(b, t, d)`` with ``d``
    sharded viewed as ``(b, t, heads, d // heads)`` shards the heads); otherwise
    the dims are gathered first. The rule ``"reshape"`` decides (compound dims
    ``(a b)``, :mod:`shardwise.propagation.rules`); Partial axes pass through.

    On ``DeviceMesh(tp=2)``, ``x`` of shape (2, 8) Sharded(1) viewed as (2, 2, 4)::

        device      CPU(0)                          CPU(1)
        block       x[:, 0:4].reshape(2, 1, 4)      x[:, 4:8].reshape(2, 1, 4)
    """
    t = _need(x, "reshape")
    if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
        shape = tuple(shape[0])
    # a symbolic size (torch.compile's dynamic shapes) stays one: int() would guard on it
    target = tuple(s if type(s) is int or isinstance(s, torch.SymInt) else int(s)
                   for s in shape)
    return apply("reshape", (t,), _reshape_block, target, shaped=True)


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along ``dim`` (gathered: needs full); other dims keep sharding.
    Linear: Partial(SUM) passes when every input is Partial(SUM) on that axis."""
    ts = [_need(t, "cat") for t in tensors]
    if not ts:
        raise ShardingError("cat needs at least one Tensor.")
    d = normalize_dim(dim, max(ts[0].ndim, 1), "cat dim")
    return apply("cat", ts, lambda *xs: torch.cat(xs, d), d)


def softmax(x: Tensor, dim: int) -> Tensor:
    """Softmax over ``dim``, which must be whole on every device (gathered if
    sharded); other dims keep their sharding. Nonlinear."""
    t = _need(x, "softmax")
    d = normalize_dim(dim, max(t.ndim, 1), "softmax dim")
    return apply("softmax", (t,), lambda s: F.softmax(s, d), d)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _basic_item(it: Any) -> bool:
    return it is None or it is Ellipsis or _is_int(it) or (isinstance(it, slice) and all(
        v is None or _is_int(v) for v in (it.start, it.stop, it.step)))


def is_basic_index(index: Any) -> bool:
    """Whether ``x[index]`` is basic indexing (ints, slices, None, ...), which
    :func:`getitem` runs shard-wise.

    >>> is_basic_index((slice(1, 3), None, 0)), is_basic_index([0, 1])
    (True, False)
    """
    return all(_basic_item(it) for it in (index if isinstance(index, tuple) else (index,)))


def _index_key(index: Any) -> tuple[Any, ...]:
    items = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    for it in items:
        if not _basic_item(it):
            raise ShardingError(
                f"getitem: only basic indexing (ints, slices, None, ...) works on a "
                f"shardwise.Tensor; got {it!r} ({type(it).__name__}). Gather the value "
                "(x.to_torch()) for advanced indexing."
            )
        if isinstance(it, slice):
            out.append(("slice", it.start, it.stop, it.step))
        else:
            out.append(operator.index(it) if _is_int(it) else it)
    return tuple(out)


def _torch_index(norm: tuple[Any, ...]) -> tuple[Any, ...]:
    conv = {"full": lambda it: slice(None), "new": lambda it: None,
            "int": lambda it: it[1], "slice": lambda it: slice(it[1], it[2], it[3])}
    return tuple(conv[it[0]](it) for it in norm)


def getitem(x: Tensor, index: Any) -> Tensor:
    """``x[index]`` for basic indices. Full slices keep their dim's sharding; a dim
    indexed by an int or a partial slice is gathered first. Linear."""
    t = _need(x, "getitem")
    key = _index_key(index)
    local = _torch_index(normalize_index(key, t.shape))
    return apply("getitem", (t,), lambda s: s[local], key)


class ZeroGrad(torch.autograd.Function):
    """``value``, in the graph of ``inputs`` (plain tensors: the blocks) with a zero
    gradient, or none with ``undefined``: where torch defines an op's derivative as
    zeros (normal's and bernoulli's with respect to their parameters) or as undefined
    (a 0-norm's), its result still requires grad."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, undefined: bool, *inputs: Any
                ) -> torch.Tensor:
        ctx.likes = [(t.shape, t.dtype) if isinstance(t, torch.Tensor) and not undefined
                     else None for t in inputs]
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (None, None, *[None if like is None else grad.new_zeros(
            like[0], dtype=like[1]) for like in ctx.likes])


def with_zero_grad(value: Any, x: Any, undefined: bool = False) -> Any:
    """``value`` (x's shape) in x's graph with a zero gradient (none: ``undefined``),
    when x requires grad."""
    if not (isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled()):
        return value
    return apply_elementwise("elementwise", [value, x],
                             lambda v, xs: ZeroGrad.apply(v, undefined, xs))
