"""Ops on values held in a sequence order (``Layout.orders``): kept only where exact.

From the first value in a sequence order on (``cp.shard`` of a load-balanced
context-parallel region), every torch function on Tensors passes :func:`dispatch`
before the registry; an op with no ordered operand goes straight on.

Invariants:
- A whitelist, never the rules: an op keeps its operands' orders only where its
  result, computed on the held (permuted) values, is the permuted result: the ops of
  :data:`~shardwise.ops.order_rules.RULES` (elementwise ops, a natural-order operand
  that spans an ordered dim reordered to match first; ops that leave the ordered dims
  whole; views and transposes, the order following its dim; reductions; losses), and
  handlers marked ``takes_orders`` (the context-parallel attention, which reorders
  its operands itself).
- Every other op first returns its ordered operands to natural order (a relayout:
  the gather is counted by CommCounter), so its result is torch's; a write in place
  into an ordered value that is not elementwise is refused, naming ``cp.unshard``.
- Backward runs through the same local ops (autograd on the held values), so
  gradients keep the invariants.
"""

from __future__ import annotations

from typing import Any

from shardwise.ops.order_calls import NATURAL, ordered, tree_map, writes
from shardwise.ops.order_rules import RULES
from shardwise.sharding.errors import ShardingError
from shardwise.tensors import ordering
from shardwise.tensors.tensor import HANDLERS, Tensor, route

__all__ = ["dispatch", "natural"]


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
    """``func(*args, **kwargs)`` with the orders kept where exact (module doc).

    >>> cp = shardwise.parallel.context_parallel(DeviceMesh.cpu(2, "cp"))
    >>> x = cp.shard(torch.arange(6.).view(1, 6))
    >>> str(dispatch(torch.mul, (x, 2), {}).dist_layout)    # elementwise: kept
    'DeviceMesh(cp=2)[R, S(cp)] order 1:ht6/2'
    >>> dispatch(torch.cumsum, (x, 1), {}).to_torch().tolist()   # natural first
    [[0.0, 1.0, 3.0, 6.0, 10.0, 15.0]]
    """
    if not ordered(args, kwargs):
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
        return route(func, tree_map(args, natural), {
            k: v if k == "out" else tree_map(v, natural) for k, v in kwargs.items()})
    rule = RULES.get(func)
    if rule is not None:
        out = rule(func, args, kwargs)
        if out is not NATURAL:
            return out
    first = args[0] if args else None
    if isinstance(first, Tensor) and first.dist_layout.orders and writes(func):
        raise _refused(func, first)
    return route(func, *tree_map((args, kwargs), natural))


# --- helpers ---------------------------------------------------------------------------------
def _refused(func: Any, target: Any) -> ShardingError:
    orders = ", ".join(map(str, target.dist_layout.orders))
    return ShardingError(
        f"{getattr(func, '__name__', func)} writes in place into {target!r}, held in a "
        f"context-parallel region's sequence order ({orders}), and only elementwise "
        "writes keep that order. Write out of place (y = f(x)), or bring it to natural "
        "order first: x = cp.unshard(x, seq_dim).")


ordering.DISPATCH[:] = [dispatch]
