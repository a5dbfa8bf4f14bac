"""The distributed Tensor: one global value laid out on a device mesh.

Invariants:
- A Tensor has a global ``shape`` and ``dtype``, a :class:`Layout` (mesh +
  where each dim and each Partial axis lives) and one local ``torch.Tensor``
  per mesh device (row-major). A single-device tensor is a one-device mesh.
- The global value is defined by the layout: sharded dims concatenate their
  shards (split rule of :mod:`shardwise.sharding.shapes`), replicated axes hold
  equal copies, Partial axes hold values whose reduction is the global value.
- It is a ``torch.Tensor`` (a wrapper with no storage): its torch metadata is the
  global value's, and every torch function goes through ``__torch_function__`` to
  the op registry (``HANDLERS``, filled by :data:`REGISTRY` on first use).
- Once a value held in a sequence order exists (``Layout.orders``: a load-balanced
  context-parallel region's), every torch function first passes the orders' dispatch
  (:data:`~shardwise.tensors.ordering.ORDERS`, :mod:`shardwise.ops.orders`), which keeps
  an order only where the op is exact on the held values; before that, one list test.
- Under a torch.func transform (which wraps it below ``__torch_function__``) each aten
  op reaches ``__torch_dispatch__`` and runs on the gathered values through the
  registry's fallback (exact; plain results, views stay Replicated Tensors); writes in
  place into it and wrapped values leaving a transform are refused. Any other aten op
  reaching it is refused.
- Under ``torch.compile`` it is a traceable wrapper subclass, whose flattening and
  routing while Dynamo and AOTAutograd trace are :class:`~shardwise.tensors.compiled.
  CompiledMixin`'s (:mod:`shardwise.tensors.compiled`); eagerly they cost one
  attribute read an op.
- Only torch's in-place ops (``add_``, ``copy_``, the optimizers' updates) mutate a
  Tensor, writing each distinct local buffer once; every other op leaves its inputs
  alone, so replicas share one buffer and shards may be views of a larger buffer.
  ``local()``/``shards`` expose those buffers: read them, never write them.
- What this process holds of the value is the runtime's (``_local``, a
  :class:`~shardwise.runtime.local.Local`): the blocks, or on a mesh the simulated
  runtime holds wholly the global value itself (blocks cut from it on demand, ops run
  once on it, autograd on it). Nothing here asks which: the Local answers (blocks,
  buffers, gradients, hooks) and the runtime's ``run_local`` runs the ops.
- The class is built from bases, each in its own module and each below this
  one: :class:`~shardwise.tensors.meta.MetaMixin` (the fields, torch metadata, mesh
  views) < :class:`~shardwise.tensors.relayout.RelayoutMixin` (layout changes) <
  :class:`~shardwise.tensors.grad.GradMixin` (autograd, gradients),
  :class:`~shardwise.tensors.values.ValuesMixin` (values out, DCP's hooks) and
  :class:`~shardwise.tensors.dtensor_names.DTensorNamesMixin` (DTensor's names), and
  beside them :class:`~shardwise.tensors.compiled.CompiledMixin` (torch.compile);
  torch.func's transforms are met by :mod:`~shardwise.tensors.transforms`. What a
  value keeps for ops lives in slots (:mod:`~shardwise.tensors.cache`), never in ``__dict__``. None
  subclasses ``torch.Tensor``; they precede it in the bases, so their properties
  (``shape``, ``grad``, ``requires_grad``, ``data``...) override torch's.
- Every torch function routed here runs as the current op of the program position
  (:mod:`shardwise.runtime.position`), which the multi-process collectives it
  causes carry in their fingerprint; the previous op is restored after it (the
  table and the route: :mod:`shardwise.tensors.routing`).
- Here: construction, torch's routing, Python protocols, ``backward`` (through
  ``torch.autograd.backward``, whose handler is the registry's ``autograd`` family),
  and the placing functions (``place``, ``to_layout``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.runtime import backend_for
from shardwise.runtime.local import Blocks, Local, Whole, hold
from shardwise.runtime.position import HERE
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import ShardingSpec
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.types import dtype_name
from shardwise.tensors import ordering
from shardwise.tensors.compiled import COMPILER, CompiledMixin
from shardwise.tensors.dtensor_names import DTensorNamesMixin
from shardwise.tensors.grad import GradMixin
from shardwise.tensors.meta import MetaMixin
from shardwise.tensors.relayout import RelayoutMixin
from shardwise.tensors.routing import FALLBACK, HANDLERS, REGISTRY, WRITE_OUT, route
from shardwise.tensors.transforms import functorch_caller, refuse_wrapped, under_transform
from shardwise.tensors.values import ValuesMixin

__all__ = ["FALLBACK", "HANDLERS", "REGISTRY", "WRITE_OUT", "Tensor", "pieces", "rehome",
           "route"]


#: ``ordering.ORDERS`` (the same list): the sequence orders' dispatch, once one exists
_ORDERS = ordering.ORDERS


# The mixins come first, so their properties (grad, data, shape...) override torch's;
# mypy flags each read-only property that replaces a writable torch attribute.
class Tensor(CompiledMixin, GradMixin, DTensorNamesMixin, ValuesMixin,  # type: ignore[misc,override]
             RelayoutMixin, MetaMixin, torch.Tensor):
    """A global value laid out on a :class:`DeviceMesh`; a ``torch.Tensor``.

    ``shape``/``dtype``/``device``/``requires_grad`` are the global ones, so
    ``nn.Module``, ``torch.optim`` and ``torch.*`` take it; every torch function
    goes through :meth:`__torch_function__` to the op registry, which propagates
    shardings and runs the torch op on the local shards.

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> x = shardwise.tensor(torch.arange(8.).reshape(4, 2),
    ...                      sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
    >>> x
    Tensor(shape=(4, 2), dtype=float32, layout=DeviceMesh(dp=2, tp=2)[S(dp), R])
    >>> isinstance(x, torch.Tensor), x.shape, x.layout
    (True, torch.Size([4, 2]), torch.strided)

    ::

        device   (dp,tp)   local block
        CPU(0)   (0,0)     x[0:2]   (same buffer as CPU(1))
        CPU(1)   (0,1)     x[0:2]
        CPU(2)   (1,0)     x[2:4]   (same buffer as CPU(3))
        CPU(3)   (1,1)     x[2:4]
    """

    # slots for the fields every op sets and what a value keeps (cheaper than the
    # instance dict, which torch.Tensor still provides for nn.Parameter's flag)
    __slots__ = ("_cache", "_device", "_dtype", "_grad_owner", "_grad_view", "_layout",
                 "_local", "_open", "_shape", "_size")

    @staticmethod
    def __new__(cls, shards: Sequence[torch.Tensor | None], layout: Layout,
                shape: Sequence[int], dtype: torch.dtype | None = None, *,
                open_dims: tuple[bool, ...] | None = None) -> Tensor:
        """Internal: build from per-device shards that already follow ``layout``
        (None for devices another process owns). Users build Tensors with
        ``shardwise.tensor``/``zeros``/``from_local``."""
        parts = tuple(shards)
        first = next((s for s in parts if s is not None), None)
        if dtype is None:
            assert first is not None, "a Tensor with no local shard needs its dtype"
            dtype = first.dtype
        device = first.device if first is not None else backend_for(layout.mesh).device_of(
            layout.mesh, 0)
        if layout.orders and not _ORDERS:  # (blocks received in a sequence order)
            ordering.activate()
        return cls.from_held(Blocks(parts), layout, torch.Size(shape), dtype, device, open_dims)

    @classmethod
    def from_held(cls, local: Local, layout: Layout, size: torch.Size, dtype: torch.dtype,
                  device: torch.device, open_dims: tuple[bool, ...] | None,
                  shape: tuple[int, ...] | None = None) -> Tensor:
        """Internal (shardwise's own modules): the Tensor of what the runtime holds,
        ``local`` (:mod:`shardwise.runtime.local`), laid out as ``layout``, of global
        ``size`` (``shape``: ``tuple(size)``, when the caller has it); ``device``: the
        torch device of its blocks."""
        # The wrapper holds no data (its C-level requires_grad stays False): values and
        # autograd live on what the runtime holds (``_local``), and every torch function
        # is routed to the registry.
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=device)
        self._local = local
        self._layout = layout
        self._shape = tuple(size) if shape is None else shape
        self._size = size
        self._dtype = dtype
        self._open = open_dims
        self._device = device
        self._cache = self._grad_view = self._grad_owner = None
        return self

    @classmethod
    def from_whole(cls, whole: torch.Tensor, layout: Layout,
                   open_dims: tuple[bool, ...] | None = None) -> Tensor:
        """Internal: the Tensor whose global value is ``whole``, held as the runtime
        holds it (:func:`~shardwise.runtime.local.hold`: the value itself on a mesh this
        process holds wholly, ops then running once on it; else its blocks, cut)."""
        return cls.from_held(hold(whole, layout), layout, whole.shape, whole.dtype, whole.device,
                         open_dims)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if COMPILER._is_compiling_flag:
            return cls.compiled_route(func, args, kwargs)
        if _ORDERS:  # some value is held in a sequence order: kept only where exact
            return _ORDERS[0](func, tuple(args), kwargs or {})
        if kwargs:
            return route(func, args, kwargs)
        # route's commonest call inlined (one frame less on every op): no
        # keywords, a registered handler, run as the program position's op
        handler = HANDLERS.get(func)
        if handler is None:
            return route(func, args, kwargs)
        here = HERE
        before = here.op
        here.op = func
        try:
            return handler(*args)
        finally:
            here.op = before

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        # Reached only if a torch function bypassed __torch_function__: torch.func's
        # transforms (they wrap the Tensor in C++ and run aten ops on the wrapper, their
        # own layers already peeled off), or a C++ path with torch functions disabled.
        # The wrapper has no data: under a transform the aten op runs on the gathered
        # values (the fallback: exact), elsewhere it is refused.
        transform = functorch_caller()
        if transform is not None:
            return under_transform(cls, transform, func, args, kwargs or {})
        if COMPILER._is_compiling_flag:
            if func is torch.ops.aten.detach.default and isinstance(args[0], cls):
                return args[0]._shallow_copy()  # (torch faking an input's autograd history)
            raise ShardingError(
                f"{func} has no sharding rule, and under torch.compile the gathered "
                "fallback (eager only) cannot run: the op would leave the graph. Run this "
                "part eagerly (torch.compiler.disable), gather first (x.to_torch() before "
                "the op, outside the compiled function), or add a rule for the op.")
        refuse_wrapped(cls, "a torch.func transform", func, args, kwargs or {})
        raise ShardingError(
            f"{func} reached torch's dispatcher with a shardwise.Tensor, which holds no data "
            "of its own (its shards do). This torch path bypasses __torch_function__; gather "
            "the value first with x.to_torch(), or report the call that led here. (After a "
            "torch.func transform: a value it returned may hold the transform's wrapped "
            "tensors, when the transformed function mixed its input with shardwise "
            "Tensors the transform does not see; return x.to_torch() from the function, "
            "or pass those Tensors through the transform.)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"Tensor(shape={self._shape}, dtype={dtype_name(self._dtype)}, "
                f"layout={self._layout}{grad})")

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d Tensor")
        return self._shape[0]

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise ShardingError(
                f"The truth value of {self!r} with {self.numel()} elements is ambiguous: use "
                "(x == y).all() or .any()."
            )
        return bool(self.item())

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        """A copy with its own buffers, keeping the sharing pattern of replicas and
        the leaf / requires_grad state (``copy.deepcopy(model)`` works)."""
        if id(self) in memo:
            return memo[id(self)]
        leaf_grad = self.is_leaf and self.requires_grad
        with torch.no_grad():
            out = self.map_buffers(lambda s: s.clone())
        if leaf_grad:
            out._local = out._local.with_grad(True, out._layout)
        for key, value in self.__dict__.items():
            if not key.startswith("_") or key == "_is_param":
                out.__dict__[key] = value
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ShardingError(
            f"{self!r} cannot be pickled: a shardwise.Tensor is written through its shards, "
            "never as opaque bytes. Save it with torch.distributed.checkpoint or "
            "shardwise.checkpoint (its blocks, loadable into any layout), or save "
            "x.to_torch() (the global value)."
        )

    # --- autograd's entry (the rest is GradMixin's): torch.autograd.backward, as
    # torch's own Tensor.backward calls it (routed to the registry's autograd family)
    def backward(self, gradient: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """Accumulate d(self)/d(leaf) into the ``.grad`` of every leaf it depends on
        (of ``inputs`` only, when given); ``gradient``: a Tensor in any layout or data
        of this global shape (None for a scalar)."""
        if not self.requires_grad:
            raise ShardingError(
                f"backward() on {self!r}, which does not require grad: no leaf it depends on "
                "has requires_grad. Call x.requires_grad_() on the inputs first."
            )
        if gradient is None and self._shape:
            raise ShardingError(
                f"backward() without a gradient needs a scalar; {self!r} has shape "
                f"{self._shape}. Pass gradient= (same global shape) or reduce first."
            )
        torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)


def with_open_dims(t: Tensor, sharding: object) -> Tensor:
    """``t`` with the open/closed dims ``sharding`` gives (a ShardingSpec's DimSpecs;
    any other form: all open). Shares ``t``'s shards; ``t`` itself is unchanged."""
    want = sharding.open_dims if isinstance(sharding, ShardingSpec) else None
    if want is not None and all(want):
        want = None
    if want == t._open or (want is not None and len(want) != t.ndim):
        return t
    return Tensor.from_held(t._local.alias(), t._layout, t._size, t._dtype, t._device, want)


def pieces(t: Tensor, operands: Sequence[Any]) -> list[tuple[torch.Tensor, list[Any]]] | None:
    """Per buffer of ``t`` (``t.held.buffers()``: its whole value, or each distinct
    block): the buffer, and ``operands`` with each Tensor among them replaced by its
    piece at the same place (its block on that device, or its whole value): the
    arguments of an op that runs on ``t``'s own buffers. None where that does not hold:
    ``t`` is Partial, a Tensor operand is laid out otherwise (a 0-d one may have any
    layout without Partial axes), or a plain torch tensor of more than 0 dims is among
    them.

    >>> t = place(torch.zeros(4), Layout(DeviceMesh.cpu(2, "x"), ((0,),), (None,)))
    >>> [(tuple(b.shape), [tuple(a.shape) for a in row]) for b, row in pieces(t, [t * 1])]
    [((4,), [(4,)])]
    """
    lay = t._layout
    if lay.is_partial:
        return None
    local = t._local
    if type(local) is Whole:  # (the simulated optimizers' case: one row, one pass)
        row = list(operands)
        for i, a in enumerate(operands):
            if isinstance(a, Tensor):
                al = a._layout
                if al is not lay and al != lay and (a._shape or al.is_partial):
                    return None
                held = a._local
                row[i] = held.value if type(held) is Whole else local.part(
                    held, 0, al, a._shape)
            elif isinstance(a, torch.Tensor) and a.ndim != 0:
                return None
        return [(local.value, row)]
    tensors = []
    for i, a in enumerate(operands):
        if isinstance(a, Tensor):
            al = a._layout
            if al is not lay and al != lay and (a._shape or al.is_partial):
                return None
            tensors.append(i)
        elif isinstance(a, torch.Tensor) and a.ndim != 0:
            return None
    if not tensors:
        row = list(operands)
        return [(b, row) for b in local.buffers()]
    out = []
    for j, b in enumerate(local.buffers()):
        row = list(operands)
        for i in tensors:
            a = row[i]
            row[i] = local.part(a._local, j, a._layout, a._shape)
        out.append((b, row))
    return out


# --- placing values (core: used by creation, the ops and autograd) -------------------------
def place(value: torch.Tensor, layout: Layout) -> Tensor:
    """A Tensor whose global value is ``value`` (not copied: shards are views of it
    where the devices share memory), laid out as ``layout``.

    >>> t = place(torch.arange(4.), Layout.replicated(DeviceMesh.cpu(2, "x"), 1))
    >>> [s.tolist() for s in t.shards]
    [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
    """
    mesh = layout.mesh
    backend = backend_for(mesh)
    mine = backend.owned(mesh)
    first = backend.device_of(mesh, mine[0]) if len(mine) else value.device
    if value.device != first and not value.is_meta:  # meta: shapes only (deferred init)
        value = value.to(first)
    if layout.orders:  # ``value`` is in natural order: reordered where it is cut
        return place(value, Layout.replicated(mesh, value.ndim)).relayout(layout)
    plain = layout.without_partial()
    t = Tensor.from_whole(value, plain)
    # the planner's make_partial steps lay identities down outer axis first, which
    # keeps the value for mixed reduce ops
    return t.relayout(layout) if layout.is_partial else t


def to_layout(x: Tensor, layout: Layout) -> Tensor:
    """``x``'s value laid out as ``layout``: a plan on one mesh, else through the
    global value onto the other mesh (differentiable either way).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = place(torch.arange(4.), Layout.replicated(mesh, 1))
    >>> y = to_layout(x, Layout(mesh, ((0,),), (None,)))
    >>> [s.tolist() for s in y.shards]
    [[0.0, 1.0], [2.0, 3.0]]
    """
    if layout.mesh == x.mesh:
        return x.relayout(layout)
    return place(x.global_value(), layout)


def rehome(x: Tensor, mesh: DeviceMesh, blocks: Sequence[torch.Tensor | None] | None = None
           ) -> Tensor:
    """``x``'s value, detached, with the same layout on ``mesh``, another mesh of the same
    shape: device ``k`` of ``mesh`` takes device ``k``'s block (the same coordinates), so
    a TP-sharded activation stays sharded on the receiving pipeline stage's tp group.
    Nothing is copied where the devices share memory. ``blocks`` (one per device of
    ``mesh``, None where another process holds it) replace ``x``'s own, for a transport
    that received them.

    >>> mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    >>> x = place(torch.arange(4.), Layout(mesh.submesh(pp=0), ((0,),), (None,)))
    >>> y = rehome(x, mesh.submesh(pp=1))
    >>> y.placements, y.mesh.devices, y.to_torch().tolist()
    ((Sharded(axis=0),), (CPU(2), CPU(3)), [0.0, 1.0, 2.0, 3.0])
    """
    if mesh.mesh_shape != x.mesh.mesh_shape:
        raise ShardingError(
            f"Cannot move {x!r} onto {mesh!r}: the layout keeps each block at the same mesh "
            f"coordinates, so the meshes need the same shape ({x.mesh.mesh_shape} vs "
            f"{mesh.mesh_shape}). Relayout it first (shardwise.shard).")
    layout = Layout(mesh, x._layout.dims, x._layout.partial, x._layout.orders)
    if blocks is not None:
        return Tensor(blocks, layout, x._shape, x._dtype, open_dims=x._open)
    local = x._local.rehome(layout)
    if layout.orders and not _ORDERS:
        ordering.activate()
    first = local.first()
    return Tensor.from_held(local, layout, x._size, x._dtype,
                        x._device if first is None else first.device, x._open)


def as_layout_of(value: Any, like: Tensor) -> Tensor:
    """``value`` (a Tensor or data of ``like``'s global shape) in ``like``'s layout.

    >>> like = place(torch.zeros(4), Layout(DeviceMesh.cpu(2, "x"), ((0,),), (None,)))
    >>> [s.tolist() for s in as_layout_of([1., 2., 3., 4.], like).shards]
    [[1.0, 2.0], [3.0, 4.0]]
    """
    if isinstance(value, Tensor):
        if value.shape != like.shape:
            raise ShardingError(
                f"Expected a value of global shape {tuple(like.shape)}, got {value!r}."
            )
        return to_layout(value, like.dist_layout)
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=like.dtype)
    if tuple(t.shape) != like._shape:
        raise ShardingError(
            f"Expected a value of global shape {tuple(like.shape)}, got shape "
            f"{tuple(t.shape)}."
        )
    return place(t.to(like.dtype), like.dist_layout)
