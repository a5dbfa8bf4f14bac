"""The whitelist of ops that keep sequence orders (``Layout.orders``), as data: torch
function -> rule, read by :func:`shardwise.ops.orders.dispatch`.

A rule gets the call with at least one ordered operand and returns its result, or
:data:`NATURAL` where keeping the orders is not exact (the dispatch then brings the
operands to natural order). It runs the registry's handler once on stripped operands
(``_run``: the held values, in the held coordinates) and relabels the
results with the orders it knows to hold.

Invariants:
- Exact only: a rule keeps an order where the op on the held (permuted) values gives
  the permuted result: elementwise ops with every operand _aligned first (a
  natural-order operand that spans an ordered dim is reordered: local where it is
  replicated), ops that leave the ordered dims whole (linear rows, embeddings, norms
  over other dims, softmax, matmul rows and columns, contractions over one shared
  order), views that keep the sequence factor whole (the order follows it, with an
  ``inner`` count where dims merged), transposes, chunks and joins along other dims,
  reductions (over an ordered dim the order goes), losses, autograd's entries (they
  lay seeds and gradients out with their tensors' orders).
- A rule never writes into an operand it reordered: a write in place keeps its
  target's orders or answers :data:`NATURAL` (then refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.elementwise import LINEAR, NONLINEAR, OPERATORS
from shardwise.ops.registry import TensorMethod
from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import SequenceOrder
from shardwise.tensors import ordering
from shardwise.tensors.tensor import Tensor, place, route

__all__ = ["NATURAL", "RULES", "Orders", "ordered", "tree_map", "writes"]

Orders = dict[int, SequenceOrder]  # output dim -> its order
#: a rule's answer: keeping the orders is not exact here, natural order first
NATURAL = object()


def ordered(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a Tensor among ``args`` (lists and tuples included) or ``kwargs`` is
    held in a sequence order.

    >>> cp = shardwise.parallel.context_parallel(DeviceMesh.cpu(2, "cp"))
    >>> ordered(([cp.shard(torch.ones(1, 4)), 2],), {}), ordered((torch.ones(4),), {})
    (True, False)
    """
    for a in args:  # (every op of a program with an ordered value asks: no tuples built)
        if isinstance(a, Tensor):
            if a.dist_layout.orders:
                return True
        elif isinstance(a, (list, tuple)) and ordered(a, {}):
            return True
    return bool(kwargs) and ordered(tuple(kwargs.values()), {})


def tree_map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` on every leaf of ``tree`` (dicts, lists and tuples rebuilt; a
    ``torch.Size`` is a leaf).

    >>> tree_map(({"a": 1}, [2, torch.Size([3])]), lambda v: v)
    ({'a': 1}, [2, torch.Size([3])])
    """
    if isinstance(tree, dict):
        return {k: tree_map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        return type(tree)(tree_map(v, fn) for v in tree)
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

    out = route(func, *tree_map((tuple(args), kwargs), strip))
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
            return NATURAL
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
    """Broadcasting elementwise ops: every operand _aligned to the output's orders (the
    first ordered operand's win); a write in place keeps its target's."""
    values = (*args, *kwargs.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    nd = max(t.ndim for t in tensors)
    want: Orders = {}
    for t in tensors:
        for d, o in _orders(t).items():
            want.setdefault(d + nd - t.ndim, o.at(d + nd - t.ndim))
    mesh = _mesh(args, kwargs)
    in_place = writes(func)
    fixed = []
    for i, a in enumerate(values):
        if isinstance(a, torch.Tensor):
            b = _aligned(a, want, nd - a.ndim, mesh)
            if b is NATURAL or (i == 0 and in_place and b is not a):
                return NATURAL
            a = b
        fixed.append(a)
    return _run(func, fixed[:len(args)], dict(zip(kwargs, fixed[len(args):])),
                lambda r, k: {d - (nd - r.ndim): o.at(d - (nd - r.ndim))
                              for d, o in want.items() if d - (nd - r.ndim) >= 0})


def writes(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``,
    ``__setitem__``).

    >>> writes(torch.Tensor.add_), writes(torch.Tensor.__iadd__), writes(torch.add)
    (True, True, False)
    """
    name = getattr(func, "__name__", "")
    return name.startswith("__i") or name == "__setitem__" or (
        name.endswith("_") and not name.endswith("__"))


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Reshapes: each order follows its sequence factor to the output dim that holds
    it whole (``(B, T) -> B*T`` keeps it with a larger outer count, ``T*D`` with
    ``inner = D``); a reshape that splits the sequence factor is not exact."""
    x = args[0]
    if not isinstance(x, Tensor) or not _orders(x) or ordered(args[1:], kwargs):
        return NATURAL
    out_shape = _meta_call(func, args, kwargs)
    if out_shape is None:
        return NATURAL
    want: Orders = {}
    for d, o in _orders(x).items():
        seq_stride = o.inner * math.prod(x.shape[d + 1:])
        e = _holding(out_shape, seq_stride, o.length)
        if e is None:
            return NATURAL
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
    if not isinstance(x, Tensor) or ordered(args[1:], kwargs):
        return NATURAL
    strides = tuple(2 ** d for d in range(x.ndim))
    meta = torch.empty_strided(tuple(x.shape), strides, dtype=x.dtype, device="meta")
    try:
        out = func(meta, *args[1:], **kwargs)
    except Exception:  # torch's error, raised by the op on natural values
        return NATURAL
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
        out = func(*tree_map((args, kwargs), meta)[0], **tree_map(kwargs, meta))
    except Exception:  # torch's error, raised again by the op on natural values
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def _lead(last: int) -> Callable[..., Any]:
    """Ops that keep every dim of operand 0 but its last ``last`` (``F.linear``,
    ``layer_norm``...) whole, with every other operand in natural order."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        n = len(args[1]) if last < 0 and len(args) > 1 else last  # layer_norm's shape
        if ordered(args[1:], kwargs) or any(d >= x.ndim - n for d in _orders(x)):
            return NATURAL
        return _run(func, args, kwargs, lambda r, k: _orders(x) if k == 0 else {})

    return rule


def _keeps(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ops whose result keeps operand 0's dims in place, each permuted with it (softmax
    permutes with its dim; an embedding's ids keep their dims), the others natural."""
    if ordered(args[1:], kwargs):
        return NATURAL
    return _run(func, args, kwargs, lambda r, k: _orders(args[0]))


def _reduction(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Sums, means, extremes: order-invariant; an order over a reduced dim goes."""
    x = args[0]
    if ordered(args[1:], kwargs):
        return NATURAL
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return _run(func, args, kwargs, lambda r, k: {})
    if isinstance(dim, int):
        dims = {dim % x.ndim}
    elif isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        dims = {d % x.ndim for d in dim}
    else:
        return NATURAL
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
        return NATURAL
    a, b = args
    nd = max(a.ndim, b.ndim)
    oa, ob = _orders(a), _orders(b)
    k_a, k_b = oa.get(a.ndim - 1), ob.get(b.ndim - 2)
    if (k_a.at(0) if k_a else None) != (k_b.at(0) if k_b else None):
        return NATURAL
    want: Orders = {}
    for t, marks in ((a, oa), (b, ob)):
        for d, o in marks.items():
            if d < t.ndim - 2:
                e = d + nd - t.ndim
                if want.setdefault(e, o.at(e)) != o.at(e):
                    return NATURAL
    for e, o in want.items():  # a batch dim ordered in one operand spans it in both
        for t, marks in ((a, oa), (b, ob)):
            d = e - (nd - t.ndim)
            if 0 <= d < t.ndim - 2 and t.shape[d] != 1 and marks.get(d) != o.at(d):
                return NATURAL
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
        return NATURAL
    x, target = args[0], args[1]
    soft = target.ndim == x.ndim
    if x.ndim < 2 or 1 in _orders(x) or (soft and 1 in _orders(target)) or ordered(
            args[2:], kwargs):
        return NATURAL
    pairs = [(d, d if soft or d == 0 else d - 1) for d in range(x.ndim) if d != 1]
    want: Orders = {}  # over the target's dims
    for xd, td in pairs:
        ox, ot = _orders(x).get(xd), _orders(target).get(td)
        if ox is not None and ot is not None and ox.at(td) != ot:
            return NATURAL
        if ox is not None or ot is not None:
            want[td] = ot if ot is not None else ox.at(td)  # type: ignore[union-attr]
    mesh = _mesh(args, kwargs)
    x2 = _aligned(x, {xd: want[td].at(xd) for xd, td in pairs if td in want}, 0, mesh)
    t2 = _aligned(target, want, 0, mesh)
    if x2 is NATURAL or t2 is NATURAL:
        return NATURAL
    reduction = args[6] if len(args) > 6 else kwargs.get("reduction", "mean")
    return _run(func, (x2, t2, *args[2:]), kwargs,
                lambda r, k: want if reduction == "none" else {})


def _dim_arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, ndim: int,
             default: int | None = 0) -> int | None:
    dim = args[at] if len(args) > at else kwargs.get("dim", default)
    return dim % ndim if isinstance(dim, int) and not isinstance(dim, bool) and ndim else None


def _pieces(at: int, drops: bool = False, default: int | None = 0) -> Callable[..., Any]:
    """``chunk``/``split``/``unbind``/``repeat_interleave`` along a dim (argument
    ``at``) that is not ordered: every piece keeps the orders (``unbind`` drops its
    dim); no dim (``repeat_interleave``'s flattening) is not exact."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        dim = _dim_arg(args, kwargs, at, x.ndim, default)
        if dim is None or dim in _orders(x) or ordered(args[1:], kwargs):
            return NATURAL
        want = {d - (drops and d > dim): o.at(d - (drops and d > dim))
                for d, o in _orders(x).items()}
        return _run(func, args, kwargs, lambda r, k: want)

    return rule


def _join(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cat``/``stack`` along a dim that is not ordered: the operands _aligned to the
    first ordered one's orders (``stack`` adds its dim)."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or ordered(args[1:], {
            k: v for k, v in kwargs.items() if k != "tensors"}):
        return NATURAL
    nd = tensors[0].ndim
    stack = "stack" in getattr(func, "__name__", "")
    dim = _dim_arg(args, kwargs, 1, nd + stack)
    want: Orders = {}
    for t in tensors:
        for d, o in _orders(t).items():
            want.setdefault(d, o)
    if dim is None or any(t.ndim != nd for t in tensors) or (not stack and dim in want):
        return NATURAL
    mesh = _mesh(tensors, {})
    fixed = [_aligned(t, want, 0, mesh) for t in tensors]
    if any(t is NATURAL for t in fixed):
        return NATURAL
    out = {d + (stack and d >= dim): o.at(d + (stack and d >= dim)) for d, o in want.items()}
    rest = {k: v for k, v in kwargs.items() if k != "tensors"}
    return _run(func, (type(tensors)(fixed), *args[1:]), rest, lambda r, k: out)


def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[...]`` with ints, slices, ``None`` and ``...`` that take every ordered dim
    whole (RoPE's halves of the last dim, a head's columns): the orders follow their
    dims; any other index of an ordered dim is not exact."""
    x, index = args[0], args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if kwargs or not isinstance(x, Tensor) or not all(
            i is None or i is Ellipsis or isinstance(i, slice) or (
                isinstance(i, int) and not isinstance(i, bool)) for i in items):
        return NATURAL
    named = sum(1 for i in items if i is not None and i is not Ellipsis)
    if named > x.ndim or sum(1 for i in items if i is Ellipsis) > 1:
        return NATURAL
    marks, want = _orders(x), {}
    d = e = 0
    for i in items:
        if i is Ellipsis:
            for _ in range(x.ndim - named):
                if d in marks:
                    want[e] = marks[d].at(e)
                d, e = d + 1, e + 1
        elif i is None:
            e += 1
        elif isinstance(i, int):
            if d in marks:
                return NATURAL
            d += 1
        else:
            if d in marks and i.indices(x.shape[d]) != (0, x.shape[d], 1):
                return NATURAL
            if d in marks:
                want[e] = marks[d].at(e)
            d, e = d + 1, e + 1
    for rest in range(d, x.ndim):
        if rest in marks:
            want[e + rest - d] = marks[rest].at(e + rest - d)
    return _run(func, args, kwargs, lambda r, k: want)


def _expand(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``expand``/``broadcast_to``: new dims lead, the ordered dims keep their size."""
    x = args[0]
    out_shape = _meta_call(func, args, kwargs)
    if out_shape is None or not isinstance(x, Tensor) or ordered(args[1:], kwargs):
        return NATURAL
    lead = len(out_shape) - x.ndim
    want = {d + lead: o.at(d + lead) for d, o in _orders(x).items()}
    if any(out_shape[e] != x.shape[e - lead] for e in want):
        return NATURAL
    return _run(func, args, kwargs, lambda r, k: want)


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
RULES: dict[Any, Callable[..., Any]] = {}
for _f in _funcs(*_ELEMENTWISE):
    RULES[_f] = _elementwise
for _f in _funcs("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze",
                 "view_as", "reshape_as"):
    RULES[_f] = _view
for _f in _funcs("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"):
    RULES[_f] = _permuted
for _f in _funcs("sum", "mean", "amax", "amin", "nansum", "nanmean", "logsumexp", "all",
                 "any"):
    RULES[_f] = _reduction
for _f in _funcs("softmax", "log_softmax"):
    RULES[_f] = _keeps
for _f in _funcs("matmul", "mm", "bmm", "__matmul__"):
    RULES[_f] = _matmul
for _f in _funcs("chunk", "split", "tensor_split"):
    RULES[_f] = _pieces(2)
for _f in _funcs("repeat_interleave"):
    RULES[_f] = _pieces(2, default=None)
for _f in _funcs("expand", "broadcast_to"):
    RULES[_f] = _expand
for _f in _funcs("unbind"):
    RULES[_f] = _pieces(1, drops=True)
for _f in _funcs("cat", "concat", "concatenate", "stack"):
    RULES[_f] = _join
RULES[torch.autograd.backward] = RULES[torch.autograd.grad] = _order_aware
RULES[TensorMethod.__getitem__] = _getitem
RULES[F.linear] = _lead(1)
RULES[F.layer_norm] = _lead(-1)
RULES[F.rms_norm] = _lead(-1)
RULES[F.embedding] = _keeps
RULES[F.cross_entropy] = _cross_entropy

