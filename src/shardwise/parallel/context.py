"""Context parallelism: attention over a sequence sharded on a ``cp`` mesh axis.

``cp = context_parallel(mesh, axis="cp", method="ring", load_balance=True)`` is a
context manager and a plan style. Inside ``with cp:`` (or the forward of a module a
plan gives ``cp``), ``F.scaled_dot_product_attention`` on q/k/v whose sequence dim
(-2) is Sharded over ``axis`` runs context parallel
(:mod:`shardwise.parallel.context_attention`): the ring (KV blocks rotated by
``ppermute``, cp - 1 hops) or all-to-all (Ulysses: sequence-sharded to head-sharded
and back, 4 exchanges). Every other sdpa call, there and anywhere else, runs as before.

The region's order (DESIGN's decisions log): with ``load_balance=True`` each device
holds its block of the sequence in head-tail order
(:func:`~shardwise.sharding.orders.sequence_order`): a piece from the front and one
from the back, so causal work is even across the ``cp`` devices. The order is part of
the value's layout (``Layout.orders``), not of what users see: ``cp.shard`` reorders
what each device holds (a new Tensor, the caller's never changed); ``to_torch()``,
gathers and ops that need positions give natural order back
(:mod:`shardwise.ops.orders` keeps the order only where exact), and a natural-order
operand that spans the sequence (position ids, a mask) meets a region value in its
order. ``cp.unshard`` gathers the sequence in natural order for good.
``load_balance=False`` keeps the natural order (then ``cp.shard`` is a plain
``Sharded`` placement).

Invariants:
- Routing is per call: only sdpa calls with a shardwise Tensor whose dim -2 is Sharded
  over an active region's axis take the context-parallel path; the registry's own
  sdpa handler runs the rest. The handler is installed while a region is active.
- The output is laid out as q (its batch and head sharding kept), sequence over ``cp``
  in the region's order; q, k, v and the mask in another order (natural included) are
  brought to it first (a relayout: local where replicated, else counted).
- Bad input raises naming the fix: heads that do not divide by cp for all-to-all, a
  mask of the wrong shape or dtype, dropout, a mask with ``is_causal``, an unknown
  method or axis.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.parallel.context_attention import Attention, attend
from shardwise.parallel.placing import layout_on
from shardwise.parallel.style import ParallelStyle
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.sharding.mappings import as_layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.orders import SequenceOrder
from shardwise.sharding.placements import Sharded
from shardwise.tensors import ordering
from shardwise.tensors import tensor as core
from shardwise.tensors.tensor import Tensor, place

__all__ = ["ContextParallel", "context_parallel"]

METHODS = ("ring", "alltoall")


class ContextParallel(ParallelStyle):
    """A context-parallel region over mesh axis ``axis`` (module doc): a context
    manager, and a plan style whose module's forward is such a region.

    >>> mesh = DeviceMesh.cpu(2, "cp")
    >>> q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    >>> cp = context_parallel(mesh, axis="cp")
    >>> qs, ks, vs = (cp.shard(t, seq_dim=2) for t in (q, k, v))
    >>> with cp:
    ...     y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    >>> y.placements
    (Sharded(axis=2),)
    >>> want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(y.to_torch(), want, atol=1e-6)    # natural order
    True
    """

    def __init__(self, mesh: DeviceMesh | None = None, axis: str = "cp", *,
                 method: str = "ring", load_balance: bool = True) -> None:
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise ShardingTypeError(f"context_parallel needs a shardwise DeviceMesh. Got "
                                    f"{type(mesh).__name__}.")
        if not isinstance(axis, str) or (mesh is not None and axis not in mesh.axis_names):
            names = list(mesh.axis_names) if mesh is not None else "the plan's mesh axes"
            raise ShardingError(
                f"context_parallel(axis={axis!r}): the sequence is sharded over a mesh axis "
                f"named by a str; {mesh!r} has {names}. Pass axis=<one of them>.")
        if method not in METHODS:
            raise ShardingError(
                f"context_parallel(method={method!r}): use 'ring' (KV blocks rotated, any "
                "head count) or 'alltoall' (Ulysses: heads divisible by the cp size).")
        self.mesh, self.axis, self.method = mesh, axis, method
        self.load_balance = bool(load_balance)

    def __repr__(self) -> str:
        return (f"ContextParallel({self.mesh!r}, axis={self.axis!r}, method={self.method!r}, "
                f"load_balance={self.load_balance})")

    # --- the region ---------------------------------------------------------------------
    def __enter__(self) -> ContextParallel:
        _enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _leave(self)

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        """As a plan style: ``module``'s forward is a region (its parameters untouched)."""
        if mesh.axis_names[axis] != self.axis:
            raise ShardingError(
                f"{self!r} in a plan over mesh axis {mesh.axis_names[axis]!r}: the region "
                f"attends over {self.axis!r}. Call parallelize_module(..., axis="
                f"{self.axis!r}) for it, or build it with axis={mesh.axis_names[axis]!r}.")
        module.register_forward_pre_hook(lambda mod, args: _enter(self))
        module.register_forward_hook(lambda mod, args, out: _leave(self), always_call=True)

    # --- the order --------------------------------------------------------------------------
    def shard(self, x: Any, seq_dim: int | Sequence[int] = 1, sharding: Any = None) -> Tensor:
        """``x`` (the global value, natural order) held in the region's order, its first
        ``seq_dim`` Sharded over the axis: a new Tensor (``x`` is never changed) whose
        ``to_torch()`` is ``x``. A plain
        torch tensor is placed without communication; ``sharding`` (a sharding form,
        e.g. ``PlacementMapping(mesh, (Sharded(0), Replicated()))`` for a batch over dp)
        lays out the other mesh axes and picks the mesh (default: the region's).
        Several dims (a mask's rows and columns: ``seq_dim=(-2, -1)``) are all reordered.

        >>> cp = context_parallel(DeviceMesh.cpu(2, "cp"))
        >>> ids = cp.shard(torch.arange(8).view(1, 8))   # (batch, seq)
        >>> ids.placements, [s.tolist() for s in ids.shards]   # held: head-tail
        ((Sharded(axis=1),), [[[0, 1, 6, 7]], [[2, 3, 4, 5]]])
        >>> ids.to_torch().tolist()                            # seen: natural
        [[0, 1, 2, 3, 4, 5, 6, 7]]
        """
        value = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        dims = self._dims(value, seq_dim, "shard")
        mesh = self._mesh_of(sharding, "shard")
        a = mesh.axis_names.index(self.axis)
        base = (as_layout(sharding, value.ndim) if sharding is not None
                else Layout.replicated(mesh, value.ndim))
        if any(ax != a for ax in base.dims[dims[0]]):
            raise ShardingError(
                f"cp.shard: the sequence dim {dims[0]} is sharded over other mesh axes in "
                f"{sharding!r}; it is split over {self.axis!r} alone. Leave it Replicated "
                "there (shard the batch over dp instead).")
        target = layout_on(base, value.ndim, a, Sharded(dims[0]))
        target = target.with_orders(self._orders(value, dims, mesh.axis_size(self.axis)))
        if isinstance(value, Tensor):
            return value.relayout(target)
        return place(value, target)

    def unshard(self, y: Tensor, seq_dim: int | Sequence[int] = 1) -> Tensor:
        """``y`` (a value of the region) gathered over the axis, in natural order (one
        all_gather of the sequence; the other mesh axes keep their layout). ``to_torch()``
        and ops that need it put a region's value in natural order by themselves; this
        drops the order for good (``seq_dim`` is checked: a dim of ``y``).

        >>> cp = context_parallel(DeviceMesh.cpu(2, "cp"))
        >>> ids = cp.shard(torch.arange(8).view(1, 8))
        >>> cp.unshard(ids).placements, cp.unshard(ids).to_torch().tolist()
        ((Replicated(),), [[0, 1, 2, 3, 4, 5, 6, 7]])
        """
        if not isinstance(y, Tensor):
            raise ShardingTypeError(f"cp.unshard takes a shardwise Tensor of the region. "
                                    f"Got {type(y).__name__}.")
        self._dims(y, seq_dim, "unshard")
        if self.axis not in y.mesh.axis_names:
            raise ShardingError(f"cp.unshard: {y!r} is on {y.mesh!r}, which has no axis "
                                f"{self.axis!r}. Give a value of the region.")
        a = y.mesh.axis_names.index(self.axis)
        layout = y.dist_layout
        return y.relayout(Layout(y.mesh, tuple(tuple(ax for ax in axes if ax != a)
                                               for axes in layout.dims), layout.partial))

    def _orders(self, x: Any, dims: Sequence[int], size: int) -> tuple[SequenceOrder, ...]:
        """The region's order of ``x``'s ``dims`` (none in natural order); a dim of
        size 1 broadcasts and needs none."""
        if not self.load_balance:
            return ()
        return tuple(SequenceOrder(d, x.shape[d], size) for d in sorted(set(dims))
                     if x.shape[d] != 1)

    def _in_order(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        """``x`` with ``dims`` in the region's order, its orders stripped: the held
        values the attention body reads (a relayout first where ``x`` was in another
        order, natural included: counted, never silent)."""
        want = self._orders(x, dims, x.mesh.axis_size(self.axis))
        return ordering.strip(x.relayout(x.dist_layout.with_orders(want)))

    def _dims(self, x: Any, seq_dim: int | Sequence[int], what: str) -> tuple[int, ...]:
        items = (seq_dim,) if isinstance(seq_dim, int) else tuple(seq_dim)
        if not items:
            raise ShardingError(f"cp.{what}(seq_dim=()): name at least one sequence dim.")
        return tuple(normalize_dim(d, x.ndim, f"cp.{what} seq_dim") for d in items)

    def _mesh_of(self, sharding: Any, what: str) -> DeviceMesh:
        mesh = getattr(sharding, "mesh", None) if sharding is not None else self.mesh
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"cp.{what} needs a mesh: build the region with "
                                "context_parallel(mesh, ...) or pass sharding=.")
        if self.axis not in mesh.axis_names or (
                self.mesh is not None and mesh.axis_size(self.axis) !=
                self.mesh.axis_size(self.axis)):
            raise ShardingError(
                f"cp.{what}: {mesh!r} has no axis {self.axis!r} of the region's size. Give a "
                "sharding on the region's mesh or a slice of it (a pipeline stage's).")
        return mesh

    # --- attention --------------------------------------------------------------------------
    def attention(self, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                  is_causal: bool = False, *, scale: Any = None,
                  enable_gqa: bool = False) -> Tensor:
        """``F.scaled_dot_product_attention`` of the region's values, context parallel
        over the axis (what the routed sdpa calls); see the module doc."""
        mesh = next(t.mesh for t in (q, k, v) if isinstance(t, Tensor))
        q, k, v = (_on(t, mesh, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
        mask = None if attn_mask is None else _on(attn_mask, mesh, "attn_mask")
        groups = _check(q, k, v, mask, dropout_p, is_causal, enable_gqa)
        a = mesh.axis_names.index(self.axis)
        layouts = _layouts(q, k, mask, a, self.method)
        if self.method == "alltoall":
            _check_heads(q, layouts[0], mesh.axis_size(self.axis), self.axis)
        nd = q.ndim
        q, k, v = (self._in_order(t, (nd - 2,)) for t in (q, k, v))
        if mask is not None:
            mask = self._in_order(mask, [d for d in (mask.ndim - 2, mask.ndim - 1) if d >= 0])
        setting = Attention(self.axis, self.method, self.load_balance, bool(is_causal),
                            None if scale is None else float(scale), groups,
                            None if mask is None else
                            ("bool" if mask.dtype == torch.bool else "float"))
        out = attend(setting, q, k, v, mask, layouts)
        return ordering.relabel(out, out.dist_layout.with_orders(
            self._orders(out, (nd - 2,), mesh.axis_size(self.axis))))


def context_parallel(mesh: DeviceMesh, axis: str = "cp", method: str = "ring",
                     load_balance: bool = True) -> ContextParallel:
    """A context-parallel region over ``mesh``'s ``axis`` (see :class:`ContextParallel`):
    ``with context_parallel(mesh): ...`` or a plan style for ``parallelize_module``.

    >>> cp = context_parallel(DeviceMesh.cpu((2, 2), ("dp", "cp")), method="alltoall")
    >>> cp
    ContextParallel(DeviceMesh(dp=2, cp=2), axis='cp', method='alltoall', load_balance=True)
    """
    return ContextParallel(mesh, axis, method=method, load_balance=load_balance)


# --- checks and layouts ---------------------------------------------------------------------
def _on(x: Any, mesh: DeviceMesh, name: str) -> Tensor:
    if isinstance(x, Tensor):
        if x.mesh != mesh:
            raise ShardingError(f"Context-parallel attention: {name} lives on {x.mesh!r}, q "
                                f"on {mesh!r}. Put q, k, v and the mask on one mesh.")
        return x
    if not isinstance(x, torch.Tensor):
        raise ShardingTypeError(f"Context-parallel attention: {name} must be a tensor. Got "
                                f"{type(x).__name__}.")
    return place(x, Layout.replicated(mesh, x.ndim))  # the global value: no communication


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool, enable_gqa: bool) -> int:
    """Torch's rules for the call, on global shapes; the GQA group size."""
    if dropout_p:
        raise ShardingError(
            f"Context-parallel attention with dropout_p={dropout_p}: the dropout noise of "
            "the global attention weights has no block-by-block draw here. Pass "
            "dropout_p=0.0 (as long-context training does) or call sdpa outside "
            "context_parallel.")
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShardingError(
            f"Context-parallel attention needs q, k, v of one rank >= 2 (..., seq, dim). "
            f"Got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}.")
    if k.shape[-2] != v.shape[-2] or k.shape[-1] != q.shape[-1] or \
            k.shape[:-3] != q.shape[:-3] or v.shape[:-2] != k.shape[:-2]:
        raise ShardingError(
            f"Context-parallel attention: k must be (..., S, E) with q's batch dims and "
            f"head size E, v (..., S, Ev) with k's. Got q {list(q.shape)}, k "
            f"{list(k.shape)}, v {list(v.shape)}.")
    groups = 1
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        if not enable_gqa or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            raise ShardingError(
                f"Context-parallel attention: q has {q.shape[-3]} heads, k and v "
                f"{k.shape[-3]}. Equal head counts, or enable_gqa=True with the query heads "
                f"a multiple of the kv heads, as torch requires.")
        groups = q.shape[-3] // k.shape[-3]
    if mask is not None:
        if is_causal:
            raise ShardingError(
                "Context-parallel attention with both attn_mask and is_causal=True: torch "
                "refuses the pair. Fold the causal rule into the mask, or drop the mask.")
        weights = (*q.shape[:-1], k.shape[-2])
        try:
            fits = (mask.ndim <= len(weights)
                    and torch.broadcast_shapes(tuple(mask.shape), weights) == weights)
        except RuntimeError:
            fits = False
        if not fits or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ShardingError(
                f"Cannot run context-parallel attention with attn_mask of shape "
                f"{list(mask.shape)} ({mask.dtype}): it must be boolean or float and "
                f"broadcast to the attention weights' global shape {list(weights)} (q's "
                f"length {q.shape[-2]} by k's {k.shape[-2]}). Build it over the global "
                "sequence, in the region's order: cp.shard(mask, seq_dim=(-2, -1)).")
    return groups


def _layouts(q: Tensor, k: Tensor, mask: Tensor | None, a: int, method: str
             ) -> list[Layout]:
    """The layouts the attention body takes: q's on batch and heads (a head split that
    GQA groups cannot follow is dropped), the sequence over axis ``a`` alone, the head
    dim whole; k and v the same; the mask's rows as q's (ring) or whole."""
    mesh, nd = q.mesh, q.ndim
    none = (None,) * mesh.ndim
    dims = [tuple(ax for ax in axes if ax != a) for axes in q.dist_layout.dims]
    dims[-2], dims[-1] = (a,), ()
    if nd >= 3 and dims[-3]:
        pieces = 1
        for ax in dims[-3]:
            pieces *= mesh.mesh_shape[ax]
        if q.shape[-3] % pieces or k.shape[-3] % pieces:
            dims[-3] = ()
    ql = Layout(mesh, tuple(dims), none)
    kl = Layout(mesh, tuple(dims[d] if d >= nd - 3 or k.shape[d] == q.shape[d] else ()
                            for d in range(nd)), none)
    out = [ql, kl, kl]
    if mask is not None:
        md: list[tuple[int, ...]] = []
        for j in range(mask.ndim):
            d = nd - mask.ndim + j
            if d == nd - 2:
                md.append((a,) if method == "ring" else ())
            elif d == nd - 1 or mask.shape[j] != q.shape[d] or mask.shape[j] == 1:
                md.append(())
            else:
                md.append(dims[d])
        out.append(Layout(mesh, tuple(md), none))
    return out


def _check_heads(q: Tensor, layout: Layout, n: int, axis: str) -> None:
    heads = q.shape[-3] if q.ndim >= 3 else 1
    pieces = 1
    for ax in (layout.dims[-3] if q.ndim >= 3 else ()):
        pieces *= layout.mesh.mesh_shape[ax]
    local = heads // pieces
    if q.ndim < 3 or local % n:
        raise ShardingError(
            f"Cannot run all-to-all (Ulysses) context-parallel attention: each device's "
            f"query heads are split over {axis!r}, so they must divide by its size {n}. Got "
            f"{heads} heads ({local} per device after the other axes) for q "
            f"{list(q.shape)}; use method='ring', or a {axis} size that divides {local}.")


# --- routing --------------------------------------------------------------------------------
_ACTIVE: list[ContextParallel] = []  # the regions entered, innermost last
_ORDINARY: list[Any] = []  # the registry's own sdpa handler while a region is active


def _region_for(*tensors: Any) -> ContextParallel | None:
    for region in reversed(_ACTIVE):
        for t in tensors:
            if isinstance(t, Tensor) and t.ndim >= 2 and region.axis in t.mesh.axis_names:
                a = t.mesh.axis_names.index(region.axis)
                if a in t.dist_layout.dims[-2]:
                    return region
    return None


def _routed(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
            is_causal: bool = False, *, scale: Any = None, enable_gqa: bool = False) -> Any:
    """The registry's sdpa handler while a region is active."""
    region = _region_for(q, k, v)
    if region is not None:
        return region.attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa)
    handler = _ORDINARY[0] if _ORDINARY else None
    # the registry's attention reads held values: natural order first
    q, k, v, attn_mask = (_natural(t) for t in (q, k, v, attn_mask))
    args = (q, k, v, attn_mask, dropout_p, is_causal)
    kwargs = dict(scale=scale, enable_gqa=enable_gqa)
    if handler is None:
        return core.FALLBACK[0](F.scaled_dot_product_attention, args, kwargs)
    return handler(*args, **kwargs)


_routed.takes_orders = True  # type: ignore[attr-defined]  # (the orders' dispatch reads it)


def _natural(x: Any) -> Any:
    if isinstance(x, Tensor) and x.dist_layout.orders:
        return x.relayout(x.dist_layout.with_orders(()))
    return x


def _enter(region: ContextParallel) -> None:
    if not _ACTIVE:
        if not core.FALLBACK:  # the registry fills the handlers on its first use
            importlib.import_module(core.REGISTRY)
        _ORDINARY[:] = [core.HANDLERS.get(F.scaled_dot_product_attention)]
        core.HANDLERS[F.scaled_dot_product_attention] = _routed
    _ACTIVE.append(region)


def _leave(region: ContextParallel) -> None:
    for i in range(len(_ACTIVE) - 1, -1, -1):
        if _ACTIVE[i] is region:
            del _ACTIVE[i]
            break
    if not _ACTIVE and _ORDINARY:
        ordinary = _ORDINARY.pop()
        if ordinary is None:
            core.HANDLERS.pop(F.scaled_dot_product_attention, None)
        else:
            core.HANDLERS[F.scaled_dot_product_attention] = ordinary
