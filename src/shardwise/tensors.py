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
- Only torch's in-place ops (``add_``, ``copy_``, the optimizers' updates) mutate a
  Tensor, writing each distinct local buffer once; every other op leaves its inputs
  alone, so replicas share one buffer and shards may be views of a larger buffer.
  ``local()``/``shards`` expose those buffers: read them, never write them.
- ``_whole``, when set, is the global value (Partial axes reduced) and the shards
  are cut from it on first use: views of it for the layout's dims, and for
  Partial axes the canonical decomposition (the value at coordinate 0, the
  reduce op's identity elsewhere; MIN/MAX/AVG: the value everywhere). It is set
  only on a mesh this process holds wholly. Autograd then runs on the whole
  (one node per op, torch's own arithmetic); shards cut from it are views that
  autograd flows through. A Tensor built from shards (``Tensor(...)``) has none.
- Gradients: ``.grad`` is in the tensor's own layout; the Partial(SUM) axes of
  a tensor hold equal gradients and come back Replicated, other Partial ops
  come back as per-device derivatives under Partial(SUM). A leaf holding a
  whole (``nn.Parameter`` over ``shardwise.tensor(...)``) accumulates into the
  whole's ``.grad``, shown in the leaf's layout.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise import chunks, dtensor_interop
from shardwise.devices import Device
from shardwise.planner import Plan, backward_steps, diverge_step, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ConversionError, ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mappings import DeviceMapping, NamedMapping, PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement, ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.sharding.types import DistributedTensorType, dtype_name

__all__ = ["Tensor"]


#: torch function -> handler, filled by :mod:`shardwise.ops` (the op registry).
HANDLERS: dict[Any, Callable[..., Any]] = {}
#: the module that fills HANDLERS and FALLBACK, loaded on the first torch call.
REGISTRY = "shardwise.ops.torch_api"
#: called for a torch function without a handler: ``(func, args, kwargs) -> result``.
FALLBACK: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = []


_REPLICATED: dict[tuple[int, int], tuple[DeviceMesh, Layout]] = {}


def _replicated(mesh: DeviceMesh, ndim: int) -> Layout:
    """``Layout.replicated(mesh, ndim)``, cached by mesh identity (the mesh is kept)."""
    hit = _REPLICATED.get((id(mesh), ndim))
    if hit is None:
        hit = _REPLICATED[(id(mesh), ndim)] = (mesh, Layout.replicated(mesh, ndim))
    return hit[1]


_LOCAL: dict[tuple[int, torch.device], tuple[DeviceMesh, bool]] = {}
_DIST = torch.distributed.is_available()


def _local_mesh(mesh: DeviceMesh, device: torch.device) -> bool:
    """Whether this process alone holds every device of ``mesh``, all on torch
    ``device``. Never in a process world (torch.distributed initialized): other
    processes may take part in ``mesh``'s collectives (a one-device mesh held here is
    still broadcast to them), so every process runs the ops block by block alike."""
    if _DIST and torch.distributed.is_initialized():
        return False
    hit = _LOCAL.get((id(mesh), device))
    if hit is None:
        backend = backend_for(mesh)
        ok = len(backend.owned(mesh)) == mesh.num_devices and all(
            backend.device_of(mesh, k) == device for k in range(mesh.num_devices))
        hit = _LOCAL[(id(mesh), device)] = (mesh, ok)
    return hit[1]


def _cut(whole: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The blocks of ``whole`` (the global value) that ``layout`` gives each device;
    Partial axes get the canonical decomposition (the planner's make_partial steps,
    local: nothing is counted as communication)."""
    mesh = layout.mesh
    shape = tuple(whole.shape)
    backend = backend_for(mesh)
    if layout.is_partial:
        plain = layout.with_partial((None,) * mesh.ndim)
        plan = make_plan(plain, layout, shape, whole.dtype.itemsize)
        return tuple(backend.execute_plan(plan, _cut(whole, plain)))
    return tuple(backend.assemble([whole] * mesh.num_devices, _replicated(mesh, len(shape)),
                                  layout, shape))


def record_plan(plan: Plan) -> None:
    """Count ``plan``'s collectives for :class:`~shardwise.debug.CommCounter` without
    running them (a layout change of a Tensor that keeps its whole value)."""
    if comm.active():
        for step in plan.collectives:
            comm.record(step.kind, step.bytes_per_device, step)


def _route_eager(func: Any, args: Any, kwargs: Any) -> Any:
    """One torch function on shardwise Tensors: its handler, else the fallback."""
    handler = HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **(kwargs or {}))
    if not FALLBACK:  # the registry is filled by the API floor's ops, named here as a
        importlib.import_module(REGISTRY)  # plugin (no static upward import)
        return _route_eager(func, args, kwargs)
    return FALLBACK[0](func, tuple(args), kwargs or {})


#: :func:`_route_eager` for torch.compile: Dynamo runs it eagerly (a graph break), as
#: the layout logic is Python. Eager calls skip the disabling wrapper (~3 us a call).
_route = torch.compiler.disable(_route_eager)
_compiling = torch.compiler.is_compiling


class Tensor(torch.Tensor):
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

    # slots for the fields every op sets (cheaper than the instance dict, which
    # torch.Tensor still provides for nn.Parameter's flag and our caches)
    __slots__ = ("_blocks", "_cut_at", "_device", "_dtype", "_layout", "_open", "_shape",
                 "_size", "_whole")

    _blocks: tuple[torch.Tensor, ...] | None  # None: not cut from ``_whole`` yet
    _cut_at: int  # ``_whole._version`` when ``_blocks`` were cut from it
    _layout: Layout
    _shape: tuple[int, ...]
    _size: torch.Size
    _dtype: torch.dtype
    _open: tuple[bool, ...] | None
    _device: torch.device
    # The global value the shards are cut from (views; canonical addends on Partial
    # axes), or None. Autograd then runs on it, and flows into the cut shards.
    _whole: torch.Tensor | None

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
        return cls._wrap(parts, None, layout, torch.Size(shape), dtype, device, open_dims)

    @classmethod
    def _wrap(cls, blocks: tuple[torch.Tensor | None, ...] | None,
              whole: torch.Tensor | None, layout: Layout, size: torch.Size,
              dtype: torch.dtype, device: torch.device,
              open_dims: tuple[bool, ...] | None) -> Tensor:
        # The wrapper holds no data (its C-level requires_grad stays False): values and
        # autograd live on the shards, and every torch function is routed to the registry.
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=device)
        self._blocks = blocks  # type: ignore[assignment]
        self._cut_at = 0  # read only while the whole records gradients
        self._layout = layout
        self._shape = tuple(size)
        self._size = size
        self._dtype = dtype
        self._open = open_dims
        self._device = device
        self._whole = whole
        return self

    @classmethod
    def from_whole(cls, whole: torch.Tensor, layout: Layout,
                   open_dims: tuple[bool, ...] | None = None) -> Tensor:
        """Internal: the Tensor whose blocks are cut from ``whole`` (the global value).
        On a mesh this process holds wholly the blocks are cut lazily and ops whose
        operands all hold wholes run once on them (see ``ops.execute``)."""
        if not _local_mesh(layout.mesh, whole.device):
            return cls(_cut(whole, layout), layout, whole.shape, whole.dtype,
                       open_dims=open_dims)
        return cls._wrap(None, whole, layout, whole.shape, whole.dtype, whole.device,
                         open_dims)

    @property
    def _shards(self) -> tuple[torch.Tensor, ...]:
        """Per-device local tensors (views of ``_whole`` cut on first use)."""
        blocks = self._blocks
        whole = self._whole
        if blocks is None or (whole is not None and whole.requires_grad
                              and whole._version != self._cut_at):
            # re-cut after an in-place write (an optimizer step) to a whole that records
            # gradients: views cut before it would refuse autograd (multi-output views)
            assert whole is not None
            blocks = self._blocks = _cut(whole, self._layout)
            if whole.requires_grad:  # (inference tensors have no version counter)
                self._cut_at = whole._version
        return blocks

    @_shards.setter
    def _shards(self, value: tuple[torch.Tensor, ...]) -> None:
        self._blocks = value
        self._whole = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if _compiling():
            return _route(func, args, kwargs)
        return _route_eager(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        # Reached only if a torch function bypassed __torch_function__ (e.g. a C++ path
        # with torch functions disabled): the wrapper has no data, so refuse by name.
        raise ShardingError(
            f"{func} reached torch's dispatcher with a shardwise.Tensor, which holds no data "
            "of its own (its shards do). This torch path bypasses __torch_function__; gather "
            "the value first with x.to_torch(), or report the call that led here."
        )

    # --- open / closed dims (sharding propagation) -------------------------------------
    @property
    def open_dims(self) -> tuple[bool, ...]:
        """Per dim: True when compute ops may reshard it freely (open), False when
        they change its sharding only if unavoidable (closed). Dims are closed when
        the Tensor was made from a ShardingSpec whose DimSpec is closed; every
        other Tensor (other sharding forms, results of ops) has open dims."""
        return (True,) * len(self._shape) if self._open is None else self._open

    # --- inspection -----------------------------------------------------------------
    # Python-level overrides of torch's metadata: they answer from the wrapper's own
    # fields without a trip through __torch_function__ (a few µs each otherwise).
    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._size

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._dtype

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None) -> Any:
        return self._size if dim is None else self._size[dim]

    def numel(self) -> int:
        return math.prod(self._shape)

    def is_complex(self) -> bool:
        return self._dtype.is_complex

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    @property
    def is_sparse(self) -> bool:  # type: ignore[override]
        return False

    nelement = numel

    def data_ptr(self) -> int:
        """0: the wrapper has no storage of its own (its shards do), as for torch's
        other storage-less wrapper tensors; DCP's stager then copies the shards."""
        return 0

    @property
    def layout(self) -> torch.layout:  # type: ignore[override]
        """torch's memory layout (always ``torch.strided``); shardwise's is :attr:`dist_layout`."""
        return torch.strided

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The torch device of the local shards (``cpu`` on a simulated CPU mesh); the
        mesh is :attr:`mesh`, a single device's shardwise device :attr:`dist_device`."""
        return self._device

    @property
    def dist_layout(self) -> Layout:
        """The canonical layout (mesh, per-dim mesh axes, Partial ops)."""
        return self._layout

    @property
    def mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._layout.to_placements()

    @property
    def sharding(self) -> DeviceMapping:
        """A PlacementMapping when the layout has one, else a NamedMapping."""
        try:
            return PlacementMapping(self.mesh, self._layout.to_placements())
        except ConversionError:
            return NamedMapping.from_layout(self._layout)

    @property
    def dist_device(self) -> Device:
        """The shardwise device of a single-device tensor (``CPU(0)``)."""
        mesh = self.mesh
        if not mesh.is_single:
            raise ShardingError(
                f"{self!r} lives on {mesh.num_devices} devices, so it has no single .dist_device. "
                "Use .mesh.devices, .sharding, or gather it with to_device(x, device)."
            )
        return mesh.devices[0]

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """Per-device local tensors, row-major over the mesh (shared buffers: read only)."""
        return self._shards

    def local(self, device: Any) -> torch.Tensor:
        """The local tensor ``device`` holds (shares memory with the Tensor: read only)."""
        shard = self._shards[self.mesh.device_index(device)]
        if shard is None:
            raise ShardingError(
                f"{device!r} is owned by another process, so its shard of {self!r} is not "
                "addressable here. Use .addressable_shards or .to_torch()."
            )
        return shard

    @property
    def addressable_shards(self) -> dict[Any, torch.Tensor]:
        """``{device: local tensor}`` for the devices this process holds."""
        return {d: s for d, s in zip(self.mesh.devices, self._shards) if s is not None}

    @property
    def local_shapes(self) -> list[tuple[int, ...]]:
        mesh = self.mesh
        return [local_shape(self._shape, self._layout, mesh.coord_of(k))
                for k in range(mesh.num_devices)]

    @property
    def dist_type(self) -> DistributedTensorType:
        """The symbolic type of this tensor (no data)."""
        return DistributedTensorType(self._dtype, self._shape, self.mesh, self.placements)

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
            out = self._map_unique(lambda s: s.clone()) if self._whole is None else (
                Tensor.from_whole(self._whole.clone(), self._layout, self._open))
        if leaf_grad:
            out = out._map_unique(lambda s: s.requires_grad_(True)) if out._whole is None else (
                out.requires_grad_(True))
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

    # --- torch.distributed.checkpoint: the blocks as chunks with global offsets --------
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        return chunks.write_items(fqn, self._shards, self._layout, self._shape, self._dtype)

    def __create_chunk_list__(self) -> list[Any]:
        return chunks.chunk_list(self._shards, self._layout, self._shape)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return chunks.tensor_shard(self._shards, self._layout, self._shape, index)

    def to_dtensor(self) -> Any:
        """This value as a torch ``DTensor`` on the same processes and placements (no
        copy where the uneven-split conventions agree); process meshes only."""
        return dtensor_interop.to_dtensor(self)

    # --- values -------------------------------------------------------------------------
    def _global(self) -> torch.Tensor:
        """The global value as one torch tensor (differentiable; may alias a shard)."""
        target = Layout.replicated(self.mesh, self.ndim)
        if self._whole is not None:
            if self._layout != target:
                record_plan(self.plan_to(target))
            return self._whole
        full = self if self._layout == target else self.relayout(target)
        return backend_for(self.mesh).global_value(full._shards, full._layout, full._shape,
                                                    full._dtype)

    def to_torch(self) -> torch.Tensor:
        """The global value as a new torch tensor (Partial axes reduced), on the
        first device of the mesh. Differentiable."""
        out = self._global()
        if self._whole is not None:
            return out.clone()
        storages = {s.untyped_storage()._cdata for s in self._shards if s is not None}
        if out.untyped_storage()._cdata in storages:
            out = out.clone()
        return out

    def numpy(self, *, force: bool = False) -> Any:
        return self.to_torch().detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.to_torch().tolist()

    def item(self) -> Any:
        # through the kept relayout: ``loss.item()`` then ``loss.backward()`` reduce once
        if self._whole is not None:
            return self._whole_as(Layout.replicated(self.mesh, self.ndim)).item()
        full = self._reused(Layout.replicated(self.mesh, self.ndim))
        return backend_for(self.mesh).global_value(full._shards, full._layout, full._shape,
                                                    full._dtype).item()

    def relayout(self, target: Layout) -> Tensor:
        """This value in layout ``target`` (same mesh), through the planner."""
        if target == self._layout:
            return self
        shards = run_plan(self.mesh, self.plan_to(target), self._shards)
        return Tensor(shards, target, self._shape, self._dtype)

    def _whole_as(self, target: Layout, diverge: tuple[int, ...] = (),
                  view: torch.Tensor | None = None) -> torch.Tensor:
        """The whole value as an op's operand that needs layout ``target`` (and, for its
        gradient, a sum over the ``diverge`` axes): the layout change is metadata, but
        its collectives are counted as :meth:`_reused` would run them, once per value
        (kept like ``_reused``'s results: the same operand for every later op, so one
        backward hook sees the summed gradient; leaves keep nothing), from the
        cheapest layout already reached. ``view``: an identity view of the whole that
        the op already used (the hook goes there, e.g. a bias inside addmm)."""
        whole = self._whole
        assert whole is not None
        layout = self._layout
        if not diverge and (target is layout or target == layout):
            return whole
        grad = torch.is_grad_enabled()
        leaf = whole.requires_grad and whole.grad_fn is None
        memo: dict[Any, Any] | None = None if leaf else self.__dict__.setdefault("_wreuse", {})
        key = (target, diverge, grad)
        if memo is not None:
            hit = memo.get(key)
            if hit is not None and hit[0] is whole and hit[1] == _version(whole):
                return hit[2]
        out = whole
        if comm.active():
            source = layout
            plan = make_plan(layout, target, self._shape, self._dtype.itemsize)
            for lay in self._whole_kept() if memo else ():
                other = make_plan(lay, target, self._shape, self._dtype.itemsize)
                if other.bytes_per_device < plan.bytes_per_device:
                    source, plan = lay, other
            where = comm.source_line()
            for step in plan.collectives:
                comm.record(step.kind, step.bytes_per_device, step, where=where)
            back = tuple(backward_steps(plan)) if source is layout else ()
            if diverge:
                back += (diverge_step(target, self._shape, self._dtype.itemsize, diverge),)
            if back and grad and whole.requires_grad:
                # its own node: the hook sees this use's gradient
                out = whole.view_as(whole) if view is None else view
                comm.on_backward([out], back, where)
        if memo is not None:
            memo[key] = (whole, _version(whole), out)
        return out

    def _whole_kept(self) -> tuple[Layout, ...]:
        """The layouts :meth:`_whole_as` reached for this value (grad mode alike)."""
        memo = self.__dict__.get("_wreuse")
        if not memo:
            return ()
        whole, grad = self._whole, torch.is_grad_enabled()
        return tuple(lay for (lay, div, g), (w, ver, _) in memo.items()
                     if g == grad and not div and w is whole and whole is not None
                     and ver == _version(whole))

    def _reused(self, target: Layout) -> Tensor:
        """:meth:`relayout` for an op's operand, done once per value: the result is
        kept on this tensor (keyed by ``target`` and grad mode) and every later use
        gets the same Tensor, so a Partial read by several ops is reduced once and
        autograd sums their gradients through one node. Built from the cheapest kept
        layout (e.g. an all_gather of a kept reduce_scatter instead of a second
        all_reduce). An in-place write to either tensor (a bumped ``_version``)
        drops the entry; leaves that require grad keep nothing (their relayout
        belongs to one step's graph). Never returned to users: ops only."""
        if target == self._layout:
            return self
        shards = self._shards
        uniq = self._unique()
        first = shards[uniq[0]] if uniq else None
        if first is not None and first.requires_grad and first.grad_fn is None:
            return self.relayout(target)
        memo: dict[Any, Any] | None = self.__dict__.get("_reuse")
        if memo is None:
            memo = self.__dict__["_reuse"] = {}
        grad = torch.is_grad_enabled()
        layout, version = self._layout, _versions(shards, uniq)

        def fresh(entry: tuple[Any, ...]) -> bool:
            src, lay, ver, kept, kept_ver = entry
            return (src is shards and lay is layout and ver == version
                    and kept_ver == _versions(kept._shards))

        hit = memo.get((target, grad))
        if hit is not None and fresh(hit):
            return hit[3]
        source, cost = self, self.plan_to(target).bytes_per_device
        for (lay, g), entry in list(memo.items()):
            kept = entry[3]
            if not fresh(entry):
                del memo[(lay, g)]  # written in place since: stale
            elif g == grad:
                c = kept.plan_to(target).bytes_per_device
                if c < cost:
                    source, cost = kept, c
        out = source.relayout(target)
        memo[(target, grad)] = (shards, layout, version, out, _versions(out._shards))
        return out

    def _kept_layouts(self) -> tuple[Layout, ...]:
        """The layouts :meth:`_reused` holds for this value now (grad mode alike): ops
        price them as free and plan from them."""
        memo = self.__dict__.get("_reuse")
        if not memo:
            return ()
        shards = self._shards
        grad = torch.is_grad_enabled()
        version = _versions(shards, self._unique())
        return tuple(lay for (lay, g), (src, src_lay, ver, kept, kept_ver) in memo.items()
                     if g == grad and src is shards and src_lay is self._layout
                     and ver == version and kept_ver == _versions(kept._shards))

    def plan_to(self, target: Layout) -> Plan:
        if target.mesh != self.mesh:
            raise ShardingError(
                f"Cannot plan from {self.mesh!r} to {target.mesh!r}: a plan stays on one mesh. "
                "Use to_device(x, sharding=...) to move between meshes."
            )
        return make_plan(self._layout, target, self._shape, self._dtype.itemsize)

    def unique_shards(self) -> tuple[list[int], list[torch.Tensor]]:
        """Representative device indices and their (distinct) local tensors."""
        reps = list(self._unique())
        return reps, [self._shards[k] for k in reps]

    def _unique(self) -> tuple[int, ...]:
        """Indices of the first device holding each distinct local tensor (cached)."""
        shards = self._shards
        cached = self.__dict__.get("_uniq")
        if cached is not None and cached[0] is shards:
            return cached[1]
        reps: list[int] = []
        seen: set[int] = set()
        for k, s in enumerate(shards):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                reps.append(k)
        out = tuple(reps)
        self.__dict__["_uniq"] = (shards, out)
        return out

    def _map_unique(self, fn: Any, layout: Layout | None = None) -> Tensor:
        """Apply ``fn`` once per distinct local tensor, keeping the sharing pattern."""
        layout = layout or self._layout
        done: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        for s in self._shards:
            if s is None:
                out.append(None)
                continue
            r = done.get(id(s))
            if r is None:
                r = done[id(s)] = fn(s)
            out.append(r)
        present = any(o is not None for o in out)
        return Tensor(out, layout, self._shape, None if present else self._dtype,
                      open_dims=self._open)

    # --- autograd ----------------------------------------------------------------------
    # Autograd runs on the shards (torch records each local op); these properties show
    # the global view of it, as torch's do for a plain tensor.
    @property
    def requires_grad(self) -> bool:
        whole = self._whole
        if whole is not None:
            return whole.requires_grad
        return any(s.requires_grad for s in self._shards if s is not None)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        whole = self._whole
        if whole is not None:
            return whole.is_leaf
        return all(s.is_leaf for s in self._shards if s is not None)

    @property
    def grad_fn(self) -> Any:  # type: ignore[override]
        """The autograd node of the whole value or the first local shard (None for leaves)."""
        whole = self._whole
        if whole is not None:
            return whole.grad_fn
        return next((s.grad_fn for s in self._shards if s is not None), None)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Make this tensor a leaf that records gradients (in place on the flag only)."""
        if not self.is_leaf:
            if not requires_grad:
                raise ShardingError(
                    "requires_grad_(False) on a non-leaf tensor: it is the result of an op "
                    "that records gradients. Use x.detach()."
                )
            return self
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            # the whole becomes the leaf (a detached alias: never flag the caller's
            # tensor); shards are re-cut from it so that they carry its autograd
            if whole.requires_grad != requires_grad:
                self._whole = whole.detach().requires_grad_(requires_grad)
                self._blocks = None
            return self
        for s in self.unique_shards()[1]:
            s.requires_grad_(requires_grad)
        if requires_grad:
            self._whole = None
        return self

    @property  # type: ignore[override]
    def data(self) -> Tensor:
        """The same value cut from autograd (shares memory), as torch's ``.data``."""
        return self.detach()

    @data.setter
    def data(self, value: Any) -> None:
        """Swap this tensor's contents for ``value``'s (``module.to(dtype)`` does this)."""
        if not isinstance(value, Tensor):
            raise ShardingTypeError(
                f"x.data = value needs a shardwise.Tensor value, got {type(value).__name__}. "
                "Wrap it first with shardwise.tensor(value, sharding=x.sharding)."
            )
        grad = self.requires_grad
        new = value.detach()
        if grad:
            new = new.requires_grad_(True) if new._whole is not None and not (
                new._layout.is_partial) else new._map_unique(lambda s: s.requires_grad_(True))
        self._blocks, self._whole = new._blocks, new._whole
        self._layout, self._dtype = new._layout, new._dtype
        self._shape, self._size, self._open = new._shape, new._size, new._open
        self._device = new._device
        # keep the C-level metadata (dtype, shape) that torch's C++ code reads in sync
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    def detach(self) -> Tensor:
        """The same value, cut from the autograd graph (shares memory)."""
        whole = self._whole
        if whole is not None:
            return Tensor.from_whole(whole.detach(), self._layout, self._open)
        return self._map_unique(lambda s: s.detach())

    def _grad_layout(self) -> Layout:
        partial = tuple(
            None if op is None or op is ReduceOp.SUM else ReduceOp.SUM
            for op in self._layout.partial
        )
        return self._layout.with_partial(partial)

    def _wrap_grads(self, grads: dict[int, torch.Tensor | None]) -> Tensor:
        """Gradients keyed by id() of this tensor's shard objects -> a Tensor."""
        layout = self._grad_layout()
        reps = layout.representatives()
        zeros: dict[int, torch.Tensor] = {}
        owner: dict[int, int] = {}  # buffer id -> the one rep device its gradient lands on
        out: list[torch.Tensor | None] = []
        for k in range(len(self._shards)):
            if self._shards[k] is None:
                out.append(None)
                continue
            s = self._shards[reps[k]]
            if s is None:  # the representative lives in another process
                s = self._shards[k]
            # A buffer shared along a Partial axis (MIN/MAX/AVG hold the value on every
            # device) got one summed gradient: it lands once, the other devices get zeros,
            # so the Partial(SUM) gradient is not counted twice.
            first = owner.setdefault(id(s), reps[k])
            g = grads.get(id(s)) if first == reps[k] else None
            if g is None:
                g = zeros.get(id(s))
                if g is None:
                    g = zeros[id(s)] = torch.zeros_like(s)
            out.append(g)
        return Tensor(out, layout, self._shape, self._dtype)

    @property  # type: ignore[override]
    def grad(self) -> Tensor | None:
        """Accumulated gradient, in this tensor's layout; None before any backward."""
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            g = whole.grad
            if g is None:
                return None
            cached = self.__dict__.get("_whole_grad")
            if cached is not None and cached[0] is g:
                return cached[1]
            out = Tensor.from_whole(g, self._layout)
            self.__dict__["_whole_grad"] = (g, out)
            return out
        shards = self._shards
        grads = [shards[k].grad for k in self._unique()]
        if all(g is None for g in grads):
            return None
        # the same shard gradients give the same Tensor (optimizers read .grad often)
        cached = self.__dict__.get("_grad_cache")
        if cached is not None and len(cached[0]) == len(grads) and all(
                a is b for a, b in zip(cached[0], grads)):
            return cached[1]
        out = self._wrap_grads({id(s): s.grad for s in shards if s is not None})
        self.__dict__["_grad_cache"] = (grads, out)
        return out

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        """``p.grad = None`` (what ``zero_grad()`` does) or a Tensor of ``p``'s shape."""
        whole = self._whole
        if value is None:
            if whole is not None:
                whole.grad = None
                return
            for s in self._shards:
                if s is not None:
                    s.grad = None
            return
        if not isinstance(value, Tensor) or value.shape != self.shape:
            raise ShardingTypeError(
                f"p.grad must be None or a shardwise.Tensor of shape {self._shape}; got "
                f"{value!r:.120}. Build it with shardwise.tensor(g, sharding=p.sharding)."
            )
        if self._layout.is_partial:
            raise ShardingError(
                f"Setting .grad of {self!r}, whose layout is Partial: the gradient of a "
                "Partial value has no single per-device form. Reduce the tensor first."
            )
        g = value.detach().relayout(self._layout) if value.mesh == self.mesh else None
        if g is None:
            raise ShardingError(
                f"p.grad lives on {value.mesh!r} but p on {self.mesh!r}: move it with "
                "shardwise.to_device(g, sharding=p.sharding) first."
            )
        if whole is not None:
            whole.grad = (g._whole if g._whole is not None else g._global()).detach()
            return
        shards = self._shards
        for k in self._unique():
            shards[k].grad = g._shards[k]

    def _roots(self) -> Tensor:
        """This value with Partial axes reduced (the differentiable global)."""
        if not self._layout.is_partial:
            return self
        target = self._layout.with_partial((None,) * self.mesh.ndim)
        if self._whole is not None:  # the whole is the reduced value already
            return Tensor.from_whole(self._whole_as(target), target, self._open)
        return self._reused(target)

    def backward(self, gradient: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """Accumulate d(self)/d(leaf) into the ``.grad`` of every leaf it depends on."""
        if inputs is not None:
            raise ShardingError(
                "backward(inputs=...) is not supported on a shardwise.Tensor; call "
                "backward() and read the .grad of the tensors you need."
            )
        if not self.requires_grad:
            raise ShardingError(
                f"backward() on {self!r}, which does not require grad: no leaf it depends on "
                "has requires_grad. Call x.requires_grad_() on the inputs first."
            )
        roots = self._roots()
        if gradient is None:
            if self._shape:
                raise ShardingError(
                    f"backward() without a gradient needs a scalar; {self!r} has shape "
                    f"{self._shape}. Pass gradient= (same global shape) or reduce first."
                )
            first = next(s for s in roots._shards if s is not None)
            gradient = torch.ones((), dtype=self._dtype, device=first.device)
        g = as_layout_of(gradient, roots)
        if roots._whole is not None:  # one root: the whole value autograd ran on
            gw = g._whole if g._whole is not None else g._global()
            torch.autograd.backward([roots._whole], [gw], retain_graph=retain_graph,
                                    create_graph=create_graph)
            return
        reps, outs = roots.unique_shards()
        torch.autograd.backward(outs, [g._shards[k] for k in reps], retain_graph=retain_graph,
                                create_graph=create_graph)


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (0 for an inference tensor, which has none and is
    never written under autograd)."""
    return 0 if t.is_inference() else int(t._version)


def _versions(shards: Sequence[torch.Tensor | None], uniq: Sequence[int] | None = None
              ) -> int:
    """The sum of the distinct local buffers' version counters: any in-place write
    to one of them (or to a view of it) changes it."""
    if uniq is None:
        seen: set[int] = set()
        total = 0
        for s in shards:
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                total += s._version
        return total
    return sum(int(shards[k]._version) for k in uniq)  # type: ignore[union-attr,misc]


def run_plan(mesh: DeviceMesh, plan: Plan, shards: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
    """Execute ``plan`` on ``mesh``'s backend, counting its collectives (and, when a
    gradient is recorded, its gradient's) for :class:`~shardwise.debug.CommCounter`."""
    if not comm.active():
        return backend_for(mesh).execute_plan(plan, shards)
    where = comm.source_line()
    for step in plan.collectives:
        comm.record(step.kind, step.bytes_per_device, step, where=where)
    out = backend_for(mesh).execute_plan(plan, shards)
    comm.on_backward(out, backward_steps(plan), where)
    return out


def with_open_dims(t: Tensor, sharding: object) -> Tensor:
    """``t`` with the open/closed dims ``sharding`` gives (a ShardingSpec's DimSpecs;
    any other form: all open). Shares ``t``'s shards; ``t`` itself is unchanged."""
    from shardwise.sharding.mappings import ShardingSpec

    want = sharding.open_dims if isinstance(sharding, ShardingSpec) else None
    if want is not None and all(want):
        want = None
    if want == t._open or (want is not None and len(want) != t.ndim):
        return t
    return Tensor(t._shards, t._layout, t._shape, t._dtype, open_dims=want)


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
    if value.device != first:
        value = value.to(first)
    plain = layout.with_partial((None,) * mesh.ndim)
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
    return place(x._global(), layout)


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

