"""The bookkeeping under ``MemoryTracker`` and ``shardwise.estimate``: every storage a
step allocates, charged to the mesh devices whose blocks it holds, and the context each
torch op runs in.

Invariants:
- A storage is charged from its allocation (seen by a dispatch mode) to its death (a
  finalizer on the storage), to the devices of one mesh: *exactly* by the layout of a
  value that holds it (a whole value: each device its block; blocks: each device the
  blocks it holds), else by the op that made it: an op-internal buffer (a norm's saved
  statistics, a gradient in backward) takes the layout of the op's operand or result
  with as many elements, or the result's share of every device. Pre-existing values
  are charged where they are first seen (as operands, or at :meth:`Ledger.discover`).
- A value held whole may stand for other blocks than its storage's first value's:
  :func:`shardwise.runtime.observe.hold` announces those. A moved value takes its
  storage's charge over (the source's blocks are what a process per device frees after
  the move); a pinned storage (parameters, gradients, optimizer state) keeps its charge
  and the moved blocks get a buffer of their own, as long as the announced tensor lives.
- Ops run in *frames* (a torch-function mode: each torch call of the step, with its
  operands and results) and, in backward, in autograd nodes, each tagged at its frame's
  end with that frame's context (its mesh, its values, the share of the op's work each
  device does); a node made outside frames takes the last context seen.
- Nothing is kept alive by the ledger: finalizers, node metadata and summaries of
  values (shapes and layouts), never tensors.
- :meth:`Ledger.replay` turns the log into per-device live bytes over time: no loop over
  devices per event when every charge is alike on every device (a number, not a vector).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.runtime import observe
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.tensor import Tensor

__all__ = ["CATEGORIES", "Context", "Ledger", "Peak", "block_bytes"]

CATEGORIES = ("params", "grads", "optimizer", "activations")
_PINNED = frozenset({"params", "grads", "optimizer"})
_KEY = "shardwise.ledger"  # autograd node metadata: the context of the node's frame

Bytes = int | np.ndarray
"""Bytes per device of one mesh: an int where every device holds the same."""


def block_bytes(layout: Layout, shape: tuple[int, ...], itemsize: int) -> Bytes:
    """Bytes of each device's block (row-major over ``layout.mesh``) of a value of
    ``shape``: one number where the split is even.

    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> block_bytes(Layout(mesh, ((0,), ()), (None,)), (8, 2), 4)
    16
    >>> block_bytes(Layout(mesh, ((0,), ()), (None,)), (6, 2), 4).tolist()
    [16, 16, 8, 8]
    """
    return _block_bytes(layout, tuple(shape), itemsize)


_BLOCKS: dict[tuple[Layout, tuple[int, ...], int], Bytes] = {}


def _block_bytes(layout: Layout, shape: tuple[int, ...], itemsize: int) -> Bytes:
    key = (layout, shape, itemsize)
    hit = _BLOCKS.get(key)
    if hit is not None:
        return hit
    mesh_shape = layout.mesh.mesh_shape
    even = itemsize
    coords: np.ndarray | None = None
    per: np.ndarray | None = None
    for size, axes in zip(shape, layout.dims):
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n == 0:
            even *= size // n
            continue
        if coords is None or per is None:
            coords = np.indices(mesh_shape).reshape(len(mesh_shape), -1)
            per = np.ones(coords.shape[1], dtype=np.int64)
        piece = np.zeros(coords.shape[1], dtype=np.int64)
        for a in axes:
            piece = piece * mesh_shape[a] + coords[a]
        per = per * (size // n + (piece < size % n))
    out: Bytes = even if per is None else per * even
    if len(_BLOCKS) > 1 << 16:
        _BLOCKS.clear()
    _BLOCKS[key] = out
    return out


def _scaled(charge: Bytes, factor: float) -> Bytes:
    if isinstance(charge, int):
        return int(charge * factor)
    return (charge * factor).astype(np.int64)


@dataclass(eq=False, slots=True)
class _Value:
    """What a context knows of one value: elements, layout, shape, itemsize."""

    numel: int
    layout: Layout
    shape: tuple[int, ...]
    itemsize: int

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.shape))


@dataclass(eq=False)
class Context:
    """Where an op runs: ``mesh``, the values of its frame (operands, results), and
    ``work``: the share of the op's whole-value work each device of ``mesh`` does (one
    over the devices its result's sharded and Partial axes span)."""

    mesh: DeviceMesh | None
    values: list[_Value] = field(default_factory=list)
    result: _Value | None = None
    work: float = 1.0

    def charge_of(self, rec: _Storage) -> tuple[DeviceMesh, Bytes] | None:
        """The charge of an op-internal buffer in this context: the layout of a value of
        its sizes (in any order: a transposed gradient), else of as many elements, else
        the result's share of every device."""
        if self.mesh is None:
            return None
        numel, nbytes, itemsize = rec.numel, rec.nbytes, rec.itemsize
        for same in (lambda v: v.sizes == rec.sizes, lambda v: v.numel == numel):
            for v in self.values:
                if same(v):
                    return v.layout.mesh, _block_bytes(v.layout, v.shape, itemsize)
        main = self.result or max(self.values, key=lambda v: v.numel, default=None)
        if main is None or main.numel == 0:
            return self.mesh, nbytes
        share = _block_bytes(main.layout, main.shape, main.itemsize)
        return main.layout.mesh, _scaled(share, nbytes / (main.numel * main.itemsize))


@dataclass(eq=False, slots=True)
class _Storage:
    """One storage (or a buffer a holder announced): its bytes, charge and category."""

    nbytes: int
    numel: int
    itemsize: int
    sizes: tuple[int, ...] = ()  # the sizes (sorted) of the tensor first seen in it
    charge: tuple[DeviceMesh, Bytes] | None = None
    exact: bool = False
    category: str = "activations"


@dataclass(frozen=True)
class Peak:
    """A replayed step: ``peak`` bytes on the most loaded device (``device``, an index
    into ``devices``), what each category held on it then (``at_peak``), each device's
    own peak (``per_device``), each category's largest holding on that device during
    the step (``most``), and ``final`` (bytes per category on it at the end)."""

    peak: int
    device: int
    devices: tuple[Any, ...]
    per_device: tuple[int, ...]
    at_peak: dict[str, int]
    most: dict[str, int]
    final: dict[str, int]


class _Frame:
    __slots__ = ("ctx", "new", "ops")

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.new: list[_Storage] = []
        self.ops: list[Any] = []


OpSink = Callable[[Context, list[Any], bool], None]
"""Called with a context, the op records of a frame or node, and whether in backward
(every forward frame on shardwise Tensors, with ops or none, and every other with ops)."""


class Ledger:
    """Storages, charges and op contexts of a step (module doc). ``start()`` installs
    the modes and the holder, ``stop()`` removes them, ``replay()`` reads the log."""

    def __init__(self, op_record: Callable[[Any, Any, Any, Any], Any] | None = None,
                 op_sink: OpSink | None = None) -> None:
        self.live: dict[int, _Storage] = {}
        self.log: list[tuple[str, _Storage, Any]] = []
        self.frames: list[_Frame] = []
        self.meshes: list[DeviceMesh] = []
        self.op_record, self.op_sink = op_record, op_sink
        self.last: Context | None = None  # the last context seen in backward
        self.running = False
        self._finalizers: list[weakref.finalize] = []
        self._modes: tuple[Any, Any] | None = None

    # --- start, stop ------------------------------------------------------------------
    def start(self) -> None:
        self.running = True
        observe.add_holder(self.hold)
        self._modes = (_Frames(self), _Allocations(self))
        for m in self._modes:
            m.__enter__()

    def stop(self) -> None:
        if self._modes is not None:
            for m in reversed(self._modes):
                m.__exit__(None, None, None)
            self._modes = None
        observe.remove_holder(self.hold)
        self.running = False
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    # --- storages ---------------------------------------------------------------------
    def _mesh(self, mesh: DeviceMesh) -> None:
        if mesh not in self.meshes:
            self.meshes.append(mesh)

    def _record(self, storage: torch.UntypedStorage, itemsize: int) -> _Storage:
        key = storage._cdata
        rec = self.live.get(key)
        if rec is None:
            nbytes = storage.nbytes()
            rec = self.live[key] = _Storage(nbytes, nbytes // max(itemsize, 1), itemsize)
            self.log.append(("+", rec, None))
            self._finalizers.append(weakref.finalize(storage, self._died, key, rec))
        return rec

    def _died(self, key: int | None, rec: _Storage) -> None:
        if not self.running:
            return
        if key is not None:
            if self.live.get(key) is not rec:
                return
            del self.live[key]
        self.log.append(("-", rec, None))

    def _set(self, rec: _Storage, charge: tuple[DeviceMesh, Bytes]) -> None:
        """Charge ``rec`` from its allocation on (it had no exact charge yet)."""
        rec.charge, rec.exact = charge, True
        self._mesh(charge[0])

    def charge_value(self, t: Tensor, category: str | None = None) -> None:
        """Charge the storages of shardwise Tensor ``t`` by its layout (those not
        charged exactly already), and give them ``category``."""
        layout, shape, itemsize = t.dist_layout, tuple(t.shape), t.dtype.itemsize
        held = t.held
        buffers = held.buffers()
        if len(buffers) == 1 and tuple(buffers[0].shape) == shape:
            rec = self._record(buffers[0].untyped_storage(), itemsize)
            if not rec.exact:
                self._set(rec, (layout.mesh, _block_bytes(layout, shape, itemsize)))
            if category is not None:
                rec.category = category
            return
        per: dict[int, tuple[_Storage, np.ndarray]] = {}
        for k, b in enumerate(held.blocks):
            if b is None:
                continue
            st = b.untyped_storage()
            hit = per.get(st._cdata)
            if hit is None:
                hit = per[st._cdata] = (self._record(st, itemsize),
                                        np.zeros(layout.mesh.num_devices, dtype=np.int64))
            hit[1][k] += b.numel() * itemsize
        for rec, charge in per.values():
            if not rec.exact:
                self._set(rec, (layout.mesh, charge))
            if category is not None:
                rec.category = category

    def charge_plain(self, t: torch.Tensor, mesh: DeviceMesh) -> None:
        """Charge a plain torch tensor used on ``mesh`` as replicated there."""
        rec = self._record(t.untyped_storage(), t.dtype.itemsize)
        if not rec.exact and rec.charge is None:
            rec.charge = (mesh, rec.nbytes)
            self._mesh(mesh)

    def categorize(self, t: Any, category: str) -> None:
        """Give the storages of ``t`` (a shardwise Tensor or a torch tensor) ``category``
        (and charge a shardwise Tensor by its layout)."""
        if isinstance(t, Tensor):
            self.charge_value(t, category)
        elif isinstance(t, torch.Tensor):
            self._record(t.untyped_storage(), t.dtype.itemsize).category = category

    def hold(self, buffer: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> None:
        """``observe.hold``: ``buffer`` stands for the blocks of ``layout`` (module doc)."""
        itemsize = buffer.dtype.itemsize
        charge = (layout.mesh, _block_bytes(layout, tuple(shape), itemsize))
        self._mesh(layout.mesh)
        rec = self._record(buffer.untyped_storage(), itemsize)
        if not rec.exact:
            self._set(rec, charge)
        elif rec.category in _PINNED:
            own = _Storage(0, 0, itemsize, (), charge, True)
            self.log.append(("+", own, None))
            self._finalizers.append(weakref.finalize(buffer, self._died, None, own))
        else:  # (rec.charge stays the charge at its allocation, which replay starts from)
            self.log.append(("=", rec, charge))

    def discover(self, values: Any) -> None:
        """Charge every shardwise Tensor in ``values`` (held before the step)."""
        for v in values:
            if isinstance(v, Tensor):
                self.charge_value(v)

    # --- frames and ops ---------------------------------------------------------------
    def _context(self, operands: list[Any]) -> Context:
        ctx = Context(None)
        for t in operands:
            if isinstance(t, Tensor):
                if ctx.mesh is None:
                    ctx.mesh = t.mesh
                ctx.values.append(_value(t))
        if ctx.mesh is not None:  # plain tensors beside them: replicated on the mesh
            for t in operands:
                if not isinstance(t, Tensor):
                    shape = tuple(t.shape)
                    ctx.values.append(_Value(math.prod(shape), Layout.replicated(
                        ctx.mesh, len(shape)), shape, t.dtype.itemsize))
        return ctx

    def enter(self, args: Any, kwargs: Any) -> _Frame:
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        ctx = self._context(flat)
        frame = _Frame(ctx)
        if ctx.mesh is not None:
            for t in flat:
                if isinstance(t, Tensor):
                    self.charge_value(t)
                else:
                    self.charge_plain(t, ctx.mesh)
        self.frames.append(frame)
        return frame

    def exit(self, frame: _Frame, out: Any) -> None:
        self.frames.pop()
        ctx = frame.ctx
        results = [r for r in tree_flatten(out)[0] if isinstance(r, Tensor)]
        for r in results:
            self.charge_value(r)
            v = _value(r)
            ctx.values.append(v)
            if ctx.result is None:
                ctx.result, ctx.mesh = v, ctx.mesh or r.mesh
                ctx.work = 1.0 / _span(r.dist_layout)
        for rec in frame.new:
            if not rec.exact and rec.charge is None:
                rec.charge = ctx.charge_of(rec)
        if self.op_sink is not None and (frame.ops or ctx.mesh is not None):
            # a call on shardwise Tensors is sunk without ops too (a view): its frame costs
            self.op_sink(ctx, frame.ops, False)
        if ctx.mesh is not None:
            self._mesh(ctx.mesh)
            for r in results:
                for b in r.held.buffers():
                    _tag(b.grad_fn, ctx)

    def dispatched(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        node = torch._C._current_autograd_node()
        ctx: Context | None = None
        frame: _Frame | None = None
        if node is not None:
            ctx = node.metadata.get(_KEY) or self.last  # type: ignore[attr-defined]
            self.last = ctx
        elif self.frames:
            frame = self.frames[-1]
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or isinstance(t, Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata in self.live:
                continue
            rec = self._record(st, t.dtype.itemsize)
            rec.sizes = tuple(sorted(t.shape))
            if frame is not None:
                frame.new.append(rec)
            elif ctx is not None:
                rec.charge = ctx.charge_of(rec)
        if self.op_record is not None:
            op = self.op_record(func, args, kwargs, out)
            if op is not None:
                if frame is not None:
                    frame.ops.append(op)
                elif ctx is not None and self.op_sink is not None:
                    self.op_sink(ctx, [op], True)

    # --- replay -----------------------------------------------------------------------
    def replay(self, devices: tuple[Any, ...] | None = None) -> Peak:
        """Live bytes per device over the log: the peak, where and of what."""
        if devices is None:
            seen: dict[Any, None] = {}
            for mesh in sorted(self.meshes, key=lambda m: -m.num_devices):
                seen.update(dict.fromkeys(mesh.devices))
            devices = tuple(seen)
        return _Replay(devices).run(self.log)


def _value(t: Tensor) -> _Value:
    shape = tuple(t.shape)
    return _Value(math.prod(shape), t.dist_layout, shape, t.dtype.itemsize)


def _span(layout: Layout) -> int:
    """Devices one result element's work is split over: the mesh axes that shard a dim
    of ``layout`` or are Partial in it."""
    axes = {a for dim in layout.dims for a in dim} | set(layout.partial_axes)
    return math.prod(layout.mesh.mesh_shape[a] for a in axes)


def _tag(node: Any, ctx: Context) -> None:
    """Tag ``node`` and the nodes behind it not tagged yet with ``ctx``."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is None:
            continue
        meta = n.metadata
        if _KEY in meta:
            continue
        meta[_KEY] = ctx
        todo.extend(nxt for nxt, _ in n.next_functions)


class _Frames(TorchFunctionMode):
    """Each torch call of the step as a frame of the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        frame = self.ledger.enter(args, kwargs)
        out: Any = None
        try:
            out = func(*args, **kwargs)
        finally:
            self.ledger.exit(frame, out)
        return out


class _Allocations(TorchDispatchMode):
    """Every aten op's new storages (and its op record) for the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ledger.dispatched(func, args, kwargs, out)
        return out


class _Replay:
    """Live bytes per device and category over a ledger's log."""

    def __init__(self, devices: tuple[Any, ...]) -> None:
        self.devices = devices
        self.at = {d: i for i, d in enumerate(devices)}
        self.n = len(devices)
        self.index: dict[DeviceMesh, np.ndarray | None] = {}

    def _where(self, mesh: DeviceMesh) -> np.ndarray | None:
        """Global indices of ``mesh``'s devices (None: every device, in order)."""
        if mesh not in self.index:
            idx = np.array([self.at[d] for d in mesh.devices], dtype=np.int64)
            whole = len(idx) == self.n and len(set(idx.tolist())) == self.n
            self.index[mesh] = None if whole else idx
        return self.index[mesh]

    def _vector(self, charge: tuple[DeviceMesh, Bytes] | None, rec: _Storage) -> Bytes:
        if charge is None:  # a plain tensor no op used on a mesh: persistent state is
            return rec.nbytes if rec.category in _PINNED else 0  # whole on every device
        mesh, per = charge
        idx = self._where(mesh)
        if idx is None:
            if isinstance(per, int):
                return per
            out = np.zeros(self.n, dtype=np.int64)
            out[np.array([self.at[d] for d in mesh.devices])] = per
            return out
        out = np.zeros(self.n, dtype=np.int64)
        out[idx] += per
        return out

    def run(self, log: list[tuple[str, _Storage, Any]]) -> Peak:
        n = self.n
        if n == 0:  # no mesh seen: nothing was held on a device
            zero = dict.fromkeys(CATEGORIES, 0)
            return Peak(0, 0, self.devices, (), zero, dict(zero), dict(zero))
        scalar = dict.fromkeys(CATEGORIES, 0)
        vector = {c: np.zeros(n, dtype=np.int64) for c in CATEGORIES}
        most = {c: np.zeros(n, dtype=np.int64) for c in CATEGORIES}  # per device
        high = dict.fromkeys(CATEGORIES, 0)  # scalar part's largest since vector[c] moved
        total_s, total_v = 0, np.zeros(n, dtype=np.int64)
        vmax, vwhere = 0, 0
        per_device = np.zeros(n, dtype=np.int64)
        stretch = 0  # the largest scalar total since the vector total last changed
        best, where, at_peak = 0, 0, dict.fromkeys(CATEGORIES, 0)
        cur: dict[int, Bytes] = {}
        for op, rec, arg in log:
            key = id(rec)
            if op == "+":
                new: Bytes = self._vector(rec.charge, rec)
                old: Bytes = 0
            elif key not in cur:
                continue
            elif op == "-":
                new, old = 0, cur.pop(key)
            else:
                new, old = self._vector(arg, rec), cur[key]
            if op != "-":
                cur[key] = new
            c = rec.category
            moved_v = False
            for amount, sign in ((old, -1), (new, 1)):
                if isinstance(amount, int):
                    scalar[c] += sign * amount
                    total_s += sign * amount
                else:
                    if not moved_v:  # (the stretches end: fold them into the maxima)
                        np.maximum(per_device, total_v + stretch, out=per_device)
                        np.maximum(most[c], vector[c] + high[c], out=most[c])
                        moved_v = True
                    vector[c] += sign * amount
                    total_v += sign * amount
            if moved_v:
                stretch, high[c] = total_s, scalar[c]
                vwhere = int(total_v.argmax())
                vmax = int(total_v[vwhere])
            stretch = max(stretch, total_s)
            high[c] = max(high[c], scalar[c])
            if total_s + vmax > best:
                best, where = total_s + vmax, vwhere
                at_peak = {k: scalar[k] + int(vector[k][where]) for k in CATEGORIES}
        np.maximum(per_device, total_v + stretch, out=per_device)
        for c in CATEGORIES:
            np.maximum(most[c], vector[c] + high[c], out=most[c])
        return Peak(best, where, self.devices, tuple(int(x) for x in per_device), at_peak,
                    {k: int(most[k][where]) for k in CATEGORIES},
                    {k: scalar[k] + int(vector[k][where]) for k in CATEGORIES})


def iter_tensors(values: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``values`` (nested lists, tuples, dicts)."""
    for v in tree_flatten(values)[0]:
        if isinstance(v, torch.Tensor):
            yield v
