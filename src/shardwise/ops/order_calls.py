"""The calls the sequence-order rules share: which operands are ordered, running an op
on stripped operands (:func:`run_stripped`) and aligning an operand to an order
(:func:`aligned`). The rules are :mod:`shardwise.ops.order_rules` and
:mod:`shardwise.ops.order_shapes`; the dispatch, :mod:`shardwise.ops.orders`.

Invariants:
- :func:`run_stripped` runs the registry's handler once, on the operands' held values
  (their orders stripped, their operand caches shared), and relabels each result with
  the orders its rule knows to hold: never an order it did not compute.
- :func:`aligned` moves values only through relayouts (counted), never in place.
- :data:`NATURAL` is a rule's answer where keeping the orders is not exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.registry import TensorMethod
from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import SequenceOrder
from shardwise.tensors import ordering
from shardwise.tensors.tensor import Tensor, place, route

__all__ = ["NATURAL", "Orders", "aligned", "funcs", "mesh_of", "ordered", "orders_of",
           "run_stripped", "tree_map", "writes"]

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


def orders_of(x: Any) -> Orders:
    """``{dim: order}`` of a Tensor held in sequence orders (empty for anything else).

    >>> cp = shardwise.parallel.context_parallel(DeviceMesh.cpu(2, "cp"))
    >>> orders_of(cp.shard(torch.ones(1, 4))), orders_of(torch.ones(4))
    ({1: SequenceOrder(dim=1, length=4, parts=2, inner=1)}, {})
    """
    if isinstance(x, Tensor):
        return {o.dim: o for o in x.dist_layout.orders}
    return {}


def run_stripped(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
         marks: Callable[[Tensor, int], Orders]) -> Any:
    """``func`` on the stripped operands; each Tensor result ``k`` relabelled with
    ``marks(result, k)``; a result that is a stripped operand is that operand.

    >>> cp = shardwise.parallel.context_parallel(DeviceMesh.cpu(2, "cp"))
    >>> x = cp.shard(torch.arange(4.).view(1, 4))
    >>> y = run_stripped(torch.neg, (x,), {}, lambda r, k: orders_of(x))
    >>> y.dist_layout.orders == x.dist_layout.orders, y.to_torch().tolist()
    (True, [[-0.0, -1.0, -2.0, -3.0]])
    """
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


def aligned(x: Any, want: Orders, offset: int, mesh: Any) -> Any:
    """``x`` (an operand whose dim ``e`` is the output's ``e + offset``) with every dim
    that spans an ordered output dim in that order (a relayout: local where the dim is
    whole); size-1 dims broadcast and need none; :data:`NATURAL` where an order does
    not fit its dim.

    >>> mesh = DeviceMesh.cpu(2, "cp")
    >>> pos = aligned(torch.arange(4.), {1: SequenceOrder(1, 4, 2)}, 1, mesh)
    >>> [b.tolist() for b in pos.shards], pos.to_torch().tolist()   # held, seen
    ([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]], [0.0, 1.0, 2.0, 3.0])
    """
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return x
    have = orders_of(x)
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


def mesh_of(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The mesh of the first Tensor among ``args`` (and lists in them) or ``kwargs``.

    >>> mesh = DeviceMesh.cpu(2, "cp")
    >>> x = shardwise.tensor(torch.ones(2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> mesh_of(([torch.ones(1), x],), {})
    DeviceMesh(cp=2)
    """
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a.mesh
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    return b.mesh
    return None


def writes(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``,
    ``__setitem__``).

    >>> writes(torch.Tensor.add_), writes(torch.Tensor.__iadd__), writes(torch.add)
    (True, True, False)
    """
    name = getattr(func, "__name__", "")
    return name.startswith("__i") or name == "__setitem__" or (
        name.endswith("_") and not name.endswith("__"))


def funcs(*names: str) -> list[Any]:
    """The torch functions named ``names`` (``torch.x``, ``Tensor.x``, ``F.x``,
    ``torch.special.x``), each once: a rule table's keys.

    >>> funcs("linear") == [F.linear]
    True
    """
    found = []
    for name in names:
        for mod in (torch, TensorMethod, F, torch.special):
            f = getattr(mod, name, None)
            if f is not None and f not in found:
                found.append(f)
    return found
