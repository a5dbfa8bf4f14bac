"""Ops on values held in a sequence order (``Layout.orders``): kept only where exact.

From the first value in a sequence order on (``cp.shard`` of a load-balanced
context-parallel region), every torch function on Tensors passes :func:`dispatch`
before the registry; an op with no ordered operand goes straight on.

Invariants:
- A whitelist, never the rules: an op keeps its operands' orders only where its
  result, computed on the held (permuted) values, is the permuted result. Elementwise
  ops (a natural-order operand that spans an ordered dim, e.g. a ``[T, D]`` position
  embedding or a mask, is reordered to match first: local where it is replicated),
  ops that leave the ordered dims whole (linear/embedding/matmul rows, softmax, norms
  over other dims, views that keep the sequence factor whole, transposes: the order
  follows its dim), reductions (over an ordered dim the order goes), cross-entropy,
  and the context-parallel attention (its handler takes ordered operands itself).
- Every other op first returns its ordered operands to natural order (a relayout:
  the gather is counted by CommCounter), so its result is torch's; a write in place
  into an ordered value that is not elementwise is refused, naming ``cp.unshard``.
- Backward runs through the same local ops (autograd on the held values), so
  gradients keep the invariants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.elementwise import LINEAR, NONLINEAR, OPERATORS
from shardwise.ops.registry import TensorMethod
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import SequenceOrder
from shardwise.tensors import ordering
from shardwise.tensors.tensor import HANDLERS, Tensor, place, route

__all__ = ["dispatch", "natural"]

Orders = dict[int, SequenceOrder]  # output dim -> its order
_NATURAL = object()  # a rule's answer: not exact here, natural order first


def natural(x: Any) -> Any:
    """``x`` in natural order (anything but a Tensor with orders as is): its ordered
    dims gathered (one all_gather each, which the reorder needs anyway) and left whole,
    since the op that needs natural order mostly needs the whole dim too.

    >>> cp = shardwise.parallel.context_parallel(DeviceMesh.cpu(2, "cp"))
    >>> x = natural(cp.shard(torch.arange(6.), 0))
    >>> x.placements, x.shards[0].tolist()
    ((Replicated(),), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    if not isinstance(x, Tensor) or not x.dist_layout.orders:
        return x
    layout = x.dist_layout
    whole = {o.dim for o in layout.orders}
    return x.relayout(layout.with_orders(()).with_dims(tuple(
        () if d in whole else axes for d, axes in enumerate(layout.dims))))


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` with the orders kept where exact (module doc)."""
    if not _ordered(args, kwargs):
        return route(func, args, kwargs)
    handler = HANDLERS.get(func)
    if getattr(handler, "takes_orders", False):
        return route(func, args, kwargs)
    out = kwargs.get("out")
    if out is not None:  # written in place: its operands natural, never out itself
        written = out if isinstance(out, (list, tuple)) else (out,)
        for t in written:
            if isinstance(t, Tensor) and t.dist_layout.orders:
                raise _refused(func, t)
        return route(func, _map(args, natural), {
            k: v if k == "out" else _map(v, natural) for k, v in kwargs.items()})
    rule = _RULES.get(func)
    if rule is not None:
        out = rule(func, args, kwargs)
        if out is not _NATURAL:
            return out
    first = args[0] if args else None
    if isinstance(first, Tensor) and first.dist_layout.orders and _writes(func):
        raise _refused(func, first)
    return route(func, *_map((args, kwargs), natural))


# --- helpers ---------------------------------------------------------------------------------
def _refused(func: Any, target: Any) -> ShardingError:
    orders = ", ".join(map(str, target.dist_layout.orders))
    return ShardingError(
        f"{getattr(func, '__name__', func)} writes in place into {target!r}, held in a "
        f"context-parallel region's sequence order ({orders}), and only elementwise "
        "writes keep that order. Write out of place (y = f(x)), or bring it to natural "
        "order first: x = cp.unshard(x, seq_dim).")


def _ordered(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            if a.dist_layout.orders:
                return True
        elif isinstance(a, (list, tuple)) and _ordered(a, {}):
            return True
    return False


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _orders(x: Any) -> Orders:
    if isinstance(x, Tensor):
        return {o.dim: o for o in x.dist_layout.orders}
    return {}


def _run(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
         marks: Callable[[Tensor, int], Orders]) -> Any:
    """``func`` on the stripped operands; each Tensor result ``k`` relabelled with
    ``marks(result, k)``; a result that is a stripped operand is that operand."""
    stripped: dict[int, Tensor] = {}

    def strip(x: Any) -> Any:
        if isinstance(x, Tensor) and x.dist_layout.orders:
            s = ordering.strip(x)
            stripped[id(s)] = x
            return s
        return x

    out = route(func, *_map((tuple(args), kwargs), strip))
    results = out if isinstance(out, tuple) else (out,)
    fixed = []
    for k, r in enumerate(results):
        if isinstance(r, Tensor) and id(r) in stripped:
            fixed.append(stripped[id(r)])
        elif isinstance(r, Tensor):
            want = tuple(o for d, o in sorted(marks(r, k).items())
                         if d < r.ndim and o.fits(r.shape[d]))
            fixed.append(ordering.relabel(r, r.dist_layout.with_orders(want)) if want else r)
        else:
            fixed.append(r)
    if not isinstance(out, tuple):
        return fixed[0]
    return type(out)(fixed) if type(out) is tuple else type(out)(tuple(fixed))


def _aligned(x: Any, want: Orders, offset: int, mesh: Any) -> Any:
    """``x`` (an operand whose dim ``e`` is the output's ``e + offset``) with every dim
    that spans an ordered output dim in that order (a relayout: local where the dim is
    whole); size-1 dims broadcast and need none."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return x
    have = _orders(x)
    need: Orders = {}
    for e in range(x.ndim):
        o = want.get(e + offset)
        if o is not None and x.shape[e] != 1:
            need[e] = o.at(e)
    if need == have:
        return x
    if not isinstance(x, Tensor):
        x = place(x, Layout.replicated(mesh, x.ndim))
    for e, o in need.items():
        if not o.fits(x.shape[e]):
            return _NATURAL
    return x.relayout(x.dist_layout.with_orders(tuple(need.values())))


def _mesh(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a.mesh
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    return b.mesh
    return None


# --- the rules -------------------------------------------------------------------------------
def _elementwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Broadcasting elementwise ops: every operand aligned to the output's orders (the
    first ordered operand's win); a write in place keeps its target's."""
    values = (*args, *kwargs.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    nd = max(t.ndim for t in tensors)
    want: Orders = {}
    for t in tensors:
        for d, o in _orders(t).items():
            want.setdefault(d + nd - t.ndim, o.at(d + nd - t.ndim))
    mesh = _mesh(args, kwargs)
    writes = _writes(func)
    fixed = []
    for i, a in enumerate(values):
        if isinstance(a, torch.Tensor):
            b = _aligned(a, want, nd - a.ndim, mesh)
            if b is _NATURAL or (i == 0 and writes and b is not a):
                return _NATURAL
            a = b
        fixed.append(a)
    return _run(func, fixed[:len(args)], dict(zip(kwargs, fixed[len(args):])),
                lambda r, k: {d - (nd - r.ndim): o.at(d - (nd - r.ndim))
                              for d, o in want.items() if d - (nd - r.ndim) >= 0})


def _writes(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``)."""
    name = getattr(func, "__name__", "")
    return name.startswith("__i") or name == "__setitem__" or (
        name.endswith("_") and not name.endswith("__"))


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Reshapes: each order follows its sequence factor to the output dim that holds
    it whole (``(B, T) -> B*T`` keeps it with a larger outer count, ``T*D`` with
    ``inner = D``); a reshape that splits the sequence factor is not exact."""
    x = args[0]
    if not isinstance(x, Tensor) or not _orders(x) or _ordered(args[1:], kwargs):
        return _NATURAL
    out_shape = _meta_call(func, args, kwargs)
    if out_shape is None:
        return _NATURAL
    want: Orders = {}
    for d, o in _orders(x).items():
        seq_stride = o.inner * math.prod(x.shape[d + 1:])
        e = _holding(out_shape, seq_stride, o.length)
        if e is None:
            return _NATURAL
        want[e] = o.at(e, seq_stride // math.prod(out_shape[e + 1:]))
    return _run(func, args, kwargs, lambda r, k: want)


def _holding(shape: Sequence[int], stride: int, length: int) -> int | None:
    """The dim of contiguous ``shape`` that holds the flat range ``[stride, stride *
    length)`` factor whole, or None."""
    for e in range(len(shape)):
        below = math.prod(shape[e + 1:])
        if stride % below == 0 and (below * shape[e]) % (stride * length) == 0:
            return e
    return None


def _permuted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Transposes and permutes: each order follows its dim (read from the strides of a
    meta value whose dims have distinct strides)."""
    x = args[0]
    if not isinstance(x, Tensor) or _ordered(args[1:], kwargs):
        return _NATURAL
    strides = tuple(2 ** d for d in range(x.ndim))
    meta = torch.empty_strided(tuple(x.shape), strides, dtype=x.dtype, device="meta")
    try:
        out = func(meta, *args[1:], **kwargs)
    except Exception:  # torch's error, raised by the op on natural values
        return _NATURAL
    source = {s: d for d, s in enumerate(strides)}
    want = {e: o.at(e) for e, s in enumerate(out.stride()) if (o := _orders(x).get(
        source.get(s, -1))) is not None}
    return _run(func, args, kwargs, lambda r, k: want)


def _meta_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty(tuple(a.shape), dtype=a.dtype, device="meta")
        return a
    try:
        out = func(*_map((args, kwargs), meta)[0], **_map(kwargs, meta))
    except Exception:  # torch's error, raised again by the op on natural values
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def _lead(last: int) -> Callable[..., Any]:
    """Ops that keep every dim of operand 0 but its last ``last`` (``F.linear``,
    ``layer_norm``...) whole, with every other operand in natural order."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        n = len(args[1]) if last < 0 and len(args) > 1 else last  # layer_norm's shape
        if _ordered(args[1:], kwargs) or any(d >= x.ndim - n for d in _orders(x)):
            return _NATURAL
        return _run(func, args, kwargs, lambda r, k: _orders(x) if k == 0 else {})

    return rule


def _embedding(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _ordered(args[1:], kwargs):
        return _NATURAL
    return _run(func, args, kwargs, lambda r, k: _orders(args[0]))


def _softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Softmax permutes with its dim: every order is kept."""
    if _ordered(args[1:], kwargs):
        return _NATURAL
    return _run(func, args, kwargs, lambda r, k: _orders(args[0]))


def _reduction(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Sums, means, extremes: order-invariant; an order over a reduced dim goes."""
    x = args[0]
    if _ordered(args[1:], kwargs):
        return _NATURAL
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return _run(func, args, kwargs, lambda r, k: {})
    if isinstance(dim, int):
        dims = {dim % x.ndim}
    elif isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        dims = {d % x.ndim for d in dim}
    else:
        return _NATURAL
    want: Orders = {}
    for d, o in _orders(x).items():
        if d not in dims:
            e = d if keep is True else d - sum(1 for r in dims if r < d)
            want[e] = o.at(e)
    return _run(func, args, kwargs, lambda r, k: want)


def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a @ b`` (both at least 2-d): a's rows and b's columns keep their orders, batch
    dims align as elementwise ops do, the contracted dims (a's last, b's rows) are
    summed over, which any order both share leaves exact."""
    if kwargs or len(args) != 2 or not all(isinstance(t, torch.Tensor) and t.ndim >= 2
                                            for t in args):
        return _NATURAL
    a, b = args
    nd = max(a.ndim, b.ndim)
    oa, ob = _orders(a), _orders(b)
    k_a, k_b = oa.get(a.ndim - 1), ob.get(b.ndim - 2)
    if (k_a.at(0) if k_a else None) != (k_b.at(0) if k_b else None):
        return _NATURAL
    want: Orders = {}
    for t, marks in ((a, oa), (b, ob)):
        for d, o in marks.items():
            if d < t.ndim - 2:
                e = d + nd - t.ndim
                if want.setdefault(e, o.at(e)) != o.at(e):
                    return _NATURAL
    for e, o in want.items():  # a batch dim ordered in one operand spans it in both
        for t, marks in ((a, oa), (b, ob)):
            d = e - (nd - t.ndim)
            if 0 <= d < t.ndim - 2 and t.shape[d] != 1 and marks.get(d) != o.at(d):
                return _NATURAL
    if a.ndim - 2 in oa:
        want[nd - 2] = oa[a.ndim - 2].at(nd - 2)
    if b.ndim - 1 in ob:
        want[nd - 1] = ob[b.ndim - 1].at(nd - 1)
    return _run(func, args, kwargs, lambda r, k: want)


def _cross_entropy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The loss per target position: over ordered positions the same mean, the
    per-position losses (``reduction='none'``) in the target's order. The class dim
    stays natural."""
    if len(args) < 2 or "target" in kwargs:
        return _NATURAL
    x, target = args[0], args[1]
    soft = target.ndim == x.ndim
    if x.ndim < 2 or 1 in _orders(x) or (soft and 1 in _orders(target)) or _ordered(
            args[2:], kwargs):
        return _NATURAL
    pairs = [(d, d if soft or d == 0 else d - 1) for d in range(x.ndim) if d != 1]
    want: Orders = {}  # over the target's dims
    for xd, td in pairs:
        ox, ot = _orders(x).get(xd), _orders(target).get(td)
        if ox is not None and ot is not None and ox.at(td) != ot:
            return _NATURAL
        if ox is not None or ot is not None:
            want[td] = ot if ot is not None else ox.at(td)  # type: ignore[union-attr]
    mesh = _mesh(args, kwargs)
    x2 = _aligned(x, {xd: want[td].at(xd) for xd, td in pairs if td in want}, 0, mesh)
    t2 = _aligned(target, want, 0, mesh)
    if x2 is _NATURAL or t2 is _NATURAL:
        return _NATURAL
    reduction = args[6] if len(args) > 6 else kwargs.get("reduction", "mean")
    return _run(func, (x2, t2, *args[2:]), kwargs,
                lambda r, k: want if reduction == "none" else {})


def _dim_arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, ndim: int) -> int | None:
    dim = args[at] if len(args) > at else kwargs.get("dim", 0)
    return dim % ndim if isinstance(dim, int) and not isinstance(dim, bool) and ndim else None


def _pieces(at: int, drops: bool = False) -> Callable[..., Any]:
    """``chunk``/``split``/``unbind`` along a dim (argument ``at``) that is not
    ordered: every piece keeps the orders (``unbind`` drops its dim)."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        dim = _dim_arg(args, kwargs, at, x.ndim)
        if dim is None or dim in _orders(x) or _ordered(args[1:], kwargs):
            return _NATURAL
        want = {d - (drops and d > dim): o.at(d - (drops and d > dim))
                for d, o in _orders(x).items()}
        return _run(func, args, kwargs, lambda r, k: want)

    return rule


def _join(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cat``/``stack`` along a dim that is not ordered: the operands aligned to the
    first ordered one's orders (``stack`` adds its dim)."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or _ordered(args[1:], {
            k: v for k, v in kwargs.items() if k != "tensors"}):
        return _NATURAL
    nd = tensors[0].ndim
    stack = "stack" in getattr(func, "__name__", "")
    dim = _dim_arg(args, kwargs, 1, nd + stack)
    want: Orders = {}
    for t in tensors:
        for d, o in _orders(t).items():
            want.setdefault(d, o)
    if dim is None or any(t.ndim != nd for t in tensors) or (not stack and dim in want):
        return _NATURAL
    mesh = _mesh(tensors, {})
    fixed = [_aligned(t, want, 0, mesh) for t in tensors]
    if any(t is _NATURAL for t in fixed):
        return _NATURAL
    out = {d + (stack and d >= dim): o.at(d + (stack and d >= dim)) for d, o in want.items()}
    rest = {k: v for k, v in kwargs.items() if k != "tensors"}
    return _run(func, (type(tensors)(fixed), *args[1:]), rest, lambda r, k: out)


def _order_aware(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Handlers that read each Tensor with its own layout, orders included (autograd's
    entries: a seed is laid out as its output, a gradient as its input)."""
    return route(func, args, kwargs)


# --- the whitelist -----------------------------------------------------------------------------
def _funcs(*names: str) -> list[Any]:
    found = []
    for name in names:
        for mod in (torch, TensorMethod, F, torch.special):
            f = getattr(mod, name, None)
            if f is not None and f not in found:
                found.append(f)
    return found


_ELEMENTWISE = [*LINEAR, *NONLINEAR, *(f"{n}_" for n in (*LINEAR, *NONLINEAR)),
                *OPERATORS, *(f"__i{d[2:]}" for d in OPERATORS if not d.startswith("__r")),
                "clone", "detach", "contiguous", "to", "float", "double", "half", "bfloat16",
                "int", "long", "bool", "type_as", "dropout", "masked_fill_", "zero_",
                "copy_", "fill_", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                "binary_cross_entropy", "binary_cross_entropy_with_logits"]
_RULES: dict[Any, Callable[..., Any]] = {}
for _f in _funcs(*_ELEMENTWISE):
    _RULES[_f] = _elementwise
for _f in _funcs("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze",
                 "view_as", "reshape_as"):
    _RULES[_f] = _view
for _f in _funcs("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"):
    _RULES[_f] = _permuted
for _f in _funcs("sum", "mean", "amax", "amin", "nansum", "nanmean", "logsumexp", "all",
                 "any"):
    _RULES[_f] = _reduction
for _f in _funcs("softmax", "log_softmax"):
    _RULES[_f] = _softmax
for _f in _funcs("matmul", "mm", "bmm", "__matmul__"):
    _RULES[_f] = _matmul
for _f in _funcs("chunk", "split", "tensor_split"):
    _RULES[_f] = _pieces(2)
for _f in _funcs("unbind"):
    _RULES[_f] = _pieces(1, drops=True)
for _f in _funcs("cat", "concat", "concatenate", "stack"):
    _RULES[_f] = _join
_RULES[torch.autograd.backward] = _RULES[torch.autograd.grad] = _order_aware
_RULES[F.linear] = _lead(1)
_RULES[F.layer_norm] = _lead(-1)
_RULES[F.rms_norm] = _lead(-1)
_RULES[F.embedding] = _embedding
_RULES[F.cross_entropy] = _cross_entropy

ordering.DISPATCH[:] = [dispatch]
