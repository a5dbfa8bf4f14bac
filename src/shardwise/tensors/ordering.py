"""Values held in a sequence order: relabelling and reordering (``Layout.orders``).

A layout's orders (:mod:`shardwise.sharding.orders`) say that some tensor dims are
held permuted; blocks are contiguous in the held coordinates. Here: the two
metadata moves (:func:`relabel`, :func:`strip`) and the one move of values between
orders (:func:`reorder`), which :meth:`~shardwise.tensors.relayout.RelayoutMixin.relayout`
takes whenever the source or the target layout has orders.

Invariants:
- :func:`reorder` is exact and differentiable: the dims whose order changes are
  gathered (the planner's collectives, counted), permuted by one local
  ``index_select`` per dim on what each device holds, and cut to the target (local).
  A dim whose order stays is never gathered.
- :func:`relabel` and :func:`strip` share the held buffers (and autograd's graph):
  they change what the value *means*, never what is held; ops run on stripped
  operands (:mod:`shardwise.ops.orders` decides when that is exact).
- Nothing here imports :mod:`shardwise.tensors.tensor`: Tensors are built as
  ``type(x)(...)``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, Protocol, Self, TypeVar

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from shardwise.runtime.local import Local
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import SequenceOrder
from shardwise.tensors.cache import OperandCache

__all__ = ["DISPATCH", "ORDERS", "ORDER_RULES", "activate", "relabel", "reorder", "reorder_index",
           "strip"]



class Ordered(Protocol):
    """What this module reads of a Tensor (:class:`~shardwise.tensors.tensor.Tensor`)."""

    _local: Local
    _layout: Layout
    _shape: tuple[int, ...]
    _size: torch.Size
    _dtype: torch.dtype
    _device: torch.device
    _open: tuple[bool, ...] | None
    _cache: OperandCache | None
    _grad_owner: GradOwner | None

    @classmethod
    def from_held(cls, local: Local, layout: Layout, size: torch.Size, dtype: torch.dtype,
                  device: torch.device, open_dims: tuple[bool, ...] | None,
                  shape: tuple[int, ...] | None = None) -> Self: ...

    def relayout(self, target: Layout, *, keep_whole: bool = False) -> Self: ...

    def map_buffers(self, fn: Any, layout: Layout | None = None,
                    dtype: torch.dtype | None = None) -> Self: ...


T = TypeVar("T", bound=Ordered)

#: ``[dispatch]`` once a value held in a sequence order exists, else empty: every torch
#: function on Tensors then goes through ``dispatch(func, args, kwargs)`` (so programs
#: that never reorder pay one list test per op).
ORDERS: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = []
#: ``[dispatch]``, registered by :data:`ORDER_RULES` when it loads (a plugin, as the op
#: registry: loaded by the first value in a sequence order, which copies it to ORDERS)
DISPATCH: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = []
ORDER_RULES = "shardwise.ops.orders"


def relabel(x: T, layout: Layout) -> T:
    """``x``'s held values read as ``layout`` (same dims and partial, other orders):
    metadata only, the buffers and autograd's graph shared.

    >>> from shardwise.tensors.tensor import place
    >>> x = place(torch.arange(4.), Layout.replicated(DeviceMesh.cpu(2, "cp"), 1))
    >>> y = relabel(x, x.dist_layout.with_orders((SequenceOrder(0, 4, 2),)))
    >>> y.shards[0].tolist(), y.to_torch().tolist()     # held [0, 1, 2, 3], read as
    ([0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 3.0, 1.0])
    """
    if layout is x._layout:
        return x
    if layout.orders and not ORDERS:
        activate()
    out = type(x).from_held(x._local, layout, x._size, x._dtype, x._device, x._open, x._shape)
    out._grad_owner = x._grad_owner
    return out


def activate() -> None:
    """From now on every torch function passes the orders' dispatch (a value in a
    sequence order exists; idempotent).

    >>> activate(); ORDERS == DISPATCH != []
    True
    """
    if not DISPATCH:
        importlib.import_module(ORDER_RULES)
    ORDERS[:] = DISPATCH


def strip(x: T) -> T:
    """``x``'s held values with no order: what the local ops see. Every stripped
    twin of ``x`` shares ``x``'s operand cache, so q, k and v projected from one value
    still share its relayouts and one gradient sum (``cache.blocks``).

    >>> from shardwise.tensors.tensor import place
    >>> lay = Layout.replicated(DeviceMesh.cpu(2, "cp"), 1)
    >>> x = place(torch.arange(4.), lay.with_orders((SequenceOrder(0, 4, 2),)))
    >>> strip(x).to_torch().tolist()                     # held: head-tail
    [0.0, 3.0, 1.0, 2.0]
    """
    if not x._layout.orders:
        return x
    if x._cache is None:
        x._cache = OperandCache()
    out = relabel(x, x._layout.with_orders(()))
    out._cache = x._cache
    return out


def reorder(x: T, target: Layout, keep_whole: bool = False) -> T:
    """``x`` in ``target``, whose orders differ from ``x``'s (module doc).

    >>> from shardwise.tensors.tensor import place
    >>> mesh = DeviceMesh.cpu(2, "cp")
    >>> x = place(torch.arange(6.), Layout(mesh, ((0,),), (None,)))
    >>> y = reorder(x, x.dist_layout.with_orders((SequenceOrder(0, 6, 2),)))
    >>> [b.tolist() for b in y.shards], y.to_torch().tolist()
    ([[0.0, 1.0, 5.0], [2.0, 3.0, 4.0]], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    src = x._layout
    changed = [d for d in range(len(target.dims)) if src.order_of(d) != target.order_of(d)]
    bare = target.with_orders(())
    held = strip(x)
    if not changed:
        return relabel(held.relayout(bare, keep_whole=keep_whole), target)
    # the reordered dims whole on every device, the others as the target has them
    mid = bare.with_dims(tuple(() if d in changed else axes
                               for d, axes in enumerate(bare.dims)))
    gathered = held.relayout(mid, keep_whole=keep_whole)
    for d in changed:
        index = reorder_index(src.order_of(d), target.order_of(d), x._shape[d])
        if torch.compiler.is_compiling():  # a constant of the graph, not a real tensor
            index = torch.tensor(index.tolist(), dtype=torch.long)
        gathered = gathered.map_buffers(functools.partial(_select, d, index))
    return relabel(gathered.relayout(bare, keep_whole=keep_whole), target)


def _select(dim: int, index: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    return held.index_select(dim, index.to(held.device))


@functools.lru_cache(maxsize=256)
def reorder_index(src: SequenceOrder | None, dst: SequenceOrder | None, size: int
                  ) -> torch.Tensor:
    """The ``index_select`` index that takes a dim of ``size`` held in order ``src``
    to order ``dst`` (None: natural): a real tensor (cached), made outside torch's fake
    mode even when first asked while torch.compile traces on fake tensors (a fake index
    in the cache would reach the next eager call).

    >>> reorder_index(None, SequenceOrder(0, 4, 2), 4).tolist()
    [0, 3, 1, 2]
    >>> reorder_index(SequenceOrder(0, 4, 2), None, 4).tolist()
    [0, 2, 3, 1]
    """
    with unset_fake_temporarily():  # (a cache miss only: hits return the real index)
        want = torch.tensor(dst.positions(size) if dst is not None else range(size),
                            dtype=torch.long)
        if src is None:
            return want
        where = torch.empty(size, dtype=torch.long)  # natural index -> held index in src
        where[torch.tensor(src.positions(size), dtype=torch.long)] = torch.arange(size)
        return where[want]
