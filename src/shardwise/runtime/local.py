"""What this process holds of a value: the runtime's side of a Tensor.

A Tensor (floor 3) holds one :class:`Local`, made and read by the runtime: either
:class:`Blocks` (one torch tensor per mesh device, None where another process holds
the device; both runtimes) or :class:`Whole` (the simulated runtime only: the global
value in one buffer, its blocks cut from it on demand). The two answer the same
questions (blocks, the buffers autograd runs on, flags, gradients, hooks), so no
module above the runtime asks which one it holds; only the runtime's ``run_local``
and the operand cache's column requests depend on it, through :meth:`Local.whole_of`.

Invariants:
- A Local belongs to one value: it is never written in place (an in-place op writes
  its buffers, ``.data =`` and ``requires_grad_`` give the Tensor a new Local), so its
  identity and :meth:`Local.version` tell the operand cache whether what it kept
  is fresh.
- ``Blocks.blocks[k]`` is device ``k``'s block; replicas share one object. A
  :class:`Whole` is made only on a mesh this process holds wholly on one torch device
  (:func:`local_mesh`): its blocks are views of ``value`` for the layout's dims and,
  on Partial axes, the canonical decomposition (the value at coordinate 0 and the
  reduce op's identity elsewhere for SUM/PROD, the value everywhere for MIN/MAX/AVG).
  Autograd then runs on ``value``; the cut blocks are views it flows through, re-cut
  after an in-place write to a value that records gradients.
- :meth:`Local.buffers` are the tensors autograd runs on and in-place writes go to,
  each once: the whole value, or the distinct blocks here.
- A value held as blocks, without Partial axes, on a mesh held wholly here has a
  *derived whole* for compute ops (:meth:`Blocks.whole_of`), kept in its ``derived``
  slot while its blocks are unchanged: a view where one exists (a Replicated block,
  or blocks tiling one buffer) or a copy of at most :data:`COPY_BYTES`; none for
  blocks that are autograd leaves requiring grad (each use would copy afresh).
- Nothing here knows a Tensor: floor 2 sees torch tensors, layouts and plans.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, backward_steps, diverge_step, make_plan
from shardwise.runtime import backend_for
from shardwise.runtime import observe as comm
from shardwise.runtime.blocks import recording, tiling_view
from shardwise.runtime.owner import GradOwner
from shardwise.runtime.world import C10D
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["COPY_BYTES", "Blocks", "Local", "Whole", "cut", "failed", "hold", "local_mesh",
           "record_plan", "run_plan", "versions"]

_VERSION = operator.attrgetter("_version")

COPY_BYTES = 1 << 18
"""Derived wholes that copy are made for values of at most this many bytes: there an
op's per-block torch calls cost more than the copy; above it they are a small share
of the op, and a copy would cost a pass over the bytes and keep a second copy of the
value alive."""


def versions(buffers: Sequence[torch.Tensor]) -> int:
    """The sum of the buffers' version counters: any in-place write to one of them
    (or to a view of it) changes it (0 for inference tensors, which have none).

    >>> a = torch.zeros(2)
    >>> before = versions([a])
    >>> _ = a[:1].add_(1)
    >>> versions([a]) - before
    1
    """
    return sum([0 if b.is_inference() else b._version for b in buffers])


class Local:
    """What this process holds of a value (module doc): the common questions, each
    answered by :class:`Blocks` and :class:`Whole` in their own way."""

    __slots__ = ()

    blocks: tuple[torch.Tensor | None, ...]

    def unique(self) -> tuple[int, ...]:
        """The first device holding each distinct block here, in device order."""
        raise NotImplementedError

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors autograd runs on and in-place writes go to, each once."""
        raise NotImplementedError

    def whole_of(self, layout: Layout, shape: tuple[int, ...], itemsize: int,
                 copy: bool = True) -> torch.Tensor | None:
        """The global value in one buffer for a compute op (its own, or a derived one:
        module doc), or None; ``copy``: a derived whole may be a copy."""
        raise NotImplementedError

    def aliases_copy(self, result: torch.Tensor) -> bool:
        """Whether ``result`` is, or is a view of, a derived whole that copies the
        blocks (an op's result must then alias the blocks: it reruns on them)."""
        return False

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], layout: Layout) -> Local:
        """``fn`` on each buffer (elementwise functions: casts, clones, detaching),
        the result held the same way in ``layout`` (same block shapes)."""
        raise NotImplementedError

    def with_grad(self, flag: bool, layout: Layout) -> Local:
        """This value as a leaf that records gradients (``flag``) or not: a whole value
        becomes one leaf (a detached alias, never the caller's tensor), blocks one
        leaf each; a whole with Partial axes turns into its blocks."""
        raise NotImplementedError

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """The accumulated gradient of each buffer (:meth:`buffers`' order)."""
        return tuple(b.grad for b in self.buffers())

    def grad_local(self, grads: Sequence[torch.Tensor | None], layout: Layout) -> Local:
        """The gradients of :meth:`buffers` (same order; None: none arrived) held as
        this value is, in ``layout`` (the gradient's layout)."""
        raise NotImplementedError

    def set_grads(self, grad: Local | None, layout: Layout) -> None:
        """Set each buffer's ``.grad`` from ``grad`` (held in ``layout``, this value's),
        or clear them (None)."""
        for i, b in enumerate(self.buffers()):
            b.grad = None if grad is None else self.part(grad, i, layout).detach()

    def part(self, other: Local, i: int, layout: Layout,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """What ``other`` (another value of global ``shape``, this one's by default, held
        in ``layout``: this value's, or a 0-d value's any) holds where this value's
        buffer ``i`` lies: the same device's block, or the whole value."""
        raise NotImplementedError

    @property
    def requires_grad(self) -> bool:
        for b in self.buffers():  # noqa: SIM110 (any() over a generator costs a frame)
            if b.requires_grad:
                return True
        return False

    @property
    def is_leaf(self) -> bool:
        return all(b.is_leaf for b in self.buffers())

    @property
    def grad_fn(self) -> Any:
        return next((b.grad_fn for b in self.buffers()), None)

    def grad_leaf(self) -> bool:
        """Whether the value is an autograd leaf requiring grad (its first buffer is):
        relayouts of it belong to one step's graph, so nothing of it is kept."""
        first = next(iter(self.buffers()), None)
        return first is not None and first.requires_grad and first.grad_fn is None

    def version(self) -> int:
        """The sum of the buffers' versions (:func:`versions`)."""
        return versions(self.buffers())

    def first(self) -> torch.Tensor | None:
        """A torch tensor this process holds of the value (dtype, device, storage)."""
        return next(iter(self.buffers()), None)

    def moved(self, plan: Plan, target: Layout, diverge: tuple[int, ...] = (),
              owner: GradOwner | None = None, view: torch.Tensor | None = None) -> Local:
        """This value in layout ``target`` (``plan``: from its layout there, counted for
        CommCounter), through the backend's ``diverge`` over ``diverge`` (the gradient
        summed over those axes, less ``owner``'s). Blocks move; a value held whole
        moves as metadata (``view``: the identity view of it an op already used, where
        the counting hook goes)."""
        raise NotImplementedError

    def as_blocks(self) -> Blocks:
        """This value held as its blocks (a value held whole: its cut blocks, views)."""
        raise NotImplementedError

    def as_whole(self, layout: Layout, shape: tuple[int, ...], itemsize: int) -> Whole:
        """This value held whole, laid out as ``layout`` (a value held as blocks: its
        derived whole, which the caller knows it has)."""
        w = self.whole_of(layout, shape, itemsize)
        assert w is not None, "asked for a whole of a value that has none"
        return Whole(w, layout)

    def alias(self) -> Local:
        """This value for another Tensor of the same layout: the same blocks, or a
        value held whole as its own autograd node (one leaf keeps one ``.grad``)."""
        return self

    def rehome(self, layout: Layout) -> Local:
        """This value, detached, for another mesh of the same shape laid out as
        ``layout``: each device's block at the same coordinates."""
        raise NotImplementedError

    def global_value(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype
                     ) -> torch.Tensor:
        """The global value of this value laid out as ``layout``, fully Replicated."""
        raise NotImplementedError


class Blocks(Local):
    """One torch tensor per mesh device (None where another process holds it)."""

    __slots__ = ("blocks", "bufs", "derived", "pat", "uniq")

    def __init__(self, blocks: tuple[torch.Tensor | None, ...]) -> None:
        self.blocks = blocks
        self.uniq: tuple[int, ...] | None = None
        self.bufs: tuple[torch.Tensor, ...] | None = None
        self.derived: tuple[Any, ...] | None = None
        self.pat: tuple[int | None, ...] | None = None

    def __repr__(self) -> str:
        return f"Blocks({[None if b is None else tuple(b.shape) for b in self.blocks]})"

    def unique(self) -> tuple[int, ...]:
        uniq = self.uniq
        if uniq is None:
            seen: set[int] = set()
            reps = []
            for k, b in enumerate(self.blocks):
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    reps.append(k)
            uniq = self.uniq = tuple(reps)
        return uniq

    def buffers(self) -> tuple[torch.Tensor, ...]:
        bufs = self.bufs
        if bufs is None:
            blocks = self.blocks
            bufs = self.bufs = tuple(blocks[k] for k in self.unique())  # type: ignore[misc]
        return bufs

    def pattern(self) -> tuple[int | None, ...]:
        """Each device's index into :meth:`buffers` (None: another process's block);
        cached, as Dynamo's guards ask it on every call of a compiled function."""
        pat = self.pat
        if pat is None:
            blocks = self.blocks
            index = {id(blocks[k]): j for j, k in enumerate(self.unique())}
            pat = self.pat = tuple(None if b is None else index[id(b)] for b in blocks)
        return pat

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], layout: Layout) -> Local:
        done: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        for b in self.blocks:
            if b is None:
                out.append(None)
                continue
            r = done.get(id(b))
            if r is None:
                r = done[id(b)] = fn(b)
            out.append(r)
        return Blocks(tuple(out))

    def with_grad(self, flag: bool, layout: Layout) -> Local:
        for b in self.buffers():
            b.requires_grad_(flag)
        return self

    def grad_local(self, grads: Sequence[torch.Tensor | None], layout: Layout) -> Local:
        by_id = {id(b): g for b, g in zip(self.buffers(), grads)}
        reps = layout.representatives()
        blocks = self.blocks
        zeros: dict[int, torch.Tensor] = {}
        first_rep: dict[int, int] = {}  # buffer id -> the one rep device it lands on
        out: list[torch.Tensor | None] = []
        for k, b in enumerate(blocks):
            if b is None:
                out.append(None)
                continue
            s = blocks[reps[k]]
            if s is None:  # the representative lives in another process
                s = b
            # A buffer shared along a Partial axis (MIN/MAX/AVG hold the value on every
            # device) got one summed gradient: it lands once, the other devices get
            # zeros, so the Partial(SUM) gradient is not counted twice.
            g = by_id.get(id(s)) if first_rep.setdefault(id(s), reps[k]) == reps[k] else None
            if g is None:
                g = zeros.get(id(s))
                if g is None:
                    g = zeros[id(s)] = torch.zeros_like(s)
            out.append(g)
        return Blocks(tuple(out))

    def part(self, other: Local, i: int, layout: Layout,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        block = other.blocks[self.unique()[i]]
        assert block is not None, "the other value holds its blocks where this one does"
        return block

    def whole_of(self, layout: Layout, shape: tuple[int, ...], itemsize: int,
                 copy: bool = True) -> torch.Tensor | None:
        if C10D._default_pg is not None:
            return None  # (a process world runs every op on blocks: see local_mesh)
        kept = self.derived
        if kept is not None:
            # a view serves while the blocks are these (writes show through it), a copy
            # while their version is the same; either only in the autograd mode it was
            # made in, and while the blocks are no leaf requiring grad. (None is kept
            # too: a value with none pays these checks only.)
            w, copied, grad, level, version, first = kept
            if (grad is torch.is_grad_enabled() and level == fwAD._current_level
                    and not (first.requires_grad and first.grad_fn is None)
                    and (not copied or version == versions(self.bufs))):  # type: ignore[arg-type]
                return w if copy or not copied else None
        if layout.is_partial or not local_mesh(layout.mesh, self._device()):
            return None  # (a process world's values pay only this check)
        if self.grad_leaf():
            return None  # (each use would copy afresh: its blocks run the op)
        w, copied = _derive(self.blocks, self.unique(), layout, shape, itemsize)
        bufs = self.buffers()
        if bufs:
            self.derived = (w, copied, torch.is_grad_enabled(), fwAD._current_level,
                            versions(bufs), bufs[0])
        return w if copy or not copied else None

    def aliases_copy(self, result: torch.Tensor) -> bool:
        kept = self.derived
        if kept is None or not kept[1]:
            return False
        w = kept[0]
        return result is w or result._base is w

    def as_blocks(self) -> Blocks:
        return self

    def rehome(self, layout: Layout) -> Local:
        return Blocks(tuple(None if b is None else b.detach() for b in self.blocks))

    def global_value(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype
                     ) -> torch.Tensor:
        return backend_for(layout.mesh).global_value(
            self.blocks, layout, shape, dtype)  # type: ignore[arg-type]

    def _device(self) -> torch.device | None:
        first = self.first()
        return None if first is None else first.device

    def moved(self, plan: Plan, target: Layout, diverge: tuple[int, ...] = (),
              owner: GradOwner | None = None, view: torch.Tensor | None = None) -> Local:
        mesh = target.mesh
        blocks: Sequence[torch.Tensor | None] = self.blocks
        if plan.steps:
            blocks = run_plan(mesh, plan, blocks)
        if diverge:
            first = next((b for b in blocks if b is not None), None)
            blocks = backend_for(mesh).diverge(blocks, target, diverge,  # type: ignore[arg-type]
                                               owner=owner)
            if (first is not None and first.requires_grad and torch.is_grad_enabled()
                    and comm.active()):
                axes = owner.others(diverge) if owner is not None else diverge
                if axes:
                    step = diverge_step(target, plan.shape, plan.itemsize, axes)
                    blocks = _announced(blocks, step)
        return Blocks(tuple(blocks))


def _announced(out: Sequence[torch.Tensor | None], step: Any) -> list[torch.Tensor | None]:
    """``out`` with the gradient's all_reduce (``step``) announced to the CommCounter,
    hung on identity views of its own (the simulated diverge is the identity: the
    replicas share one buffer, which other uses of the value also read)."""
    views: dict[int, torch.Tensor] = {}
    hooked = [None if s is None else views.setdefault(id(s), s.view_as(s)) for s in out]
    comm.on_backward(hooked, (step,), comm.source_line())
    return hooked


def _derive(blocks: tuple[torch.Tensor | None, ...], uniq: tuple[int, ...], layout: Layout,
            shape: tuple[int, ...], itemsize: int) -> tuple[torch.Tensor | None, bool]:
    """(the whole, whether it is a copy) of ``blocks`` in ``layout`` (no Partial
    axes); the whole is None when this process does not hold them all or the copy
    would be above :data:`COPY_BYTES`."""
    if not uniq or len(uniq) != len(set(layout.representatives())):
        return None, False  # (a device without its block: never on a mesh held wholly)
    first = blocks[uniq[0]]
    assert first is not None
    if len(uniq) == 1 and tuple(first.shape) == shape:
        return first, False  # Replicated: the one buffer is the whole
    if not recording([blocks[k] for k in uniq]):  # type: ignore[misc]
        view = tiling_view(blocks, layout, shape)
        if view is not None:
            return view, False
    if math.prod(shape) * itemsize > COPY_BYTES:
        return None, False
    full = Layout.replicated(layout.mesh, len(shape))
    return backend_for(layout.mesh).assemble(
        blocks, layout, full, shape)[0], True  # type: ignore[arg-type]


class Whole(Local):
    """The global value in one buffer (Partial axes reduced), laid out as ``layout``;
    its blocks are cut from it on first use (the simulated runtime only)."""

    __slots__ = ("cut_at", "cut_blocks", "layout", "uniq", "value")

    def __init__(self, value: torch.Tensor, layout: Layout) -> None:
        self.value = value
        self.layout = layout
        self.cut_blocks: tuple[torch.Tensor, ...] | None = None
        self.cut_at = 0
        self.uniq: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Whole({tuple(self.value.shape)})"

    @property
    def blocks(self) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        blocks = self.cut_blocks
        value = self.value
        if blocks is None or (value.requires_grad and value._version != self.cut_at):
            # re-cut after an in-place write (an optimizer step) to a value that records
            # gradients: views cut before it would refuse autograd (multi-output views)
            blocks = self.cut_blocks = cut(value, self.layout)
            self.uniq = None
            if value.requires_grad:  # (inference tensors have no version counter)
                self.cut_at = value._version
        return blocks

    def unique(self) -> tuple[int, ...]:
        blocks = self.blocks
        uniq = self.uniq
        if uniq is None:
            seen: set[int] = set()
            reps = []
            for k, b in enumerate(blocks):
                if id(b) not in seen:
                    seen.add(id(b))
                    reps.append(k)
            uniq = self.uniq = tuple(reps)
        return uniq

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.value,)

    def part(self, other: Local, i: int, layout: Layout,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if type(other) is Whole:  # (the optimizers' operands: one call, no lookups)
            return other.value
        return self._part(other, layout, shape)

    def version(self) -> int:
        value = self.value
        return 0 if value.is_inference() else value._version

    # the questions Local answers from buffers(), answered from the one value
    @property
    def requires_grad(self) -> bool:
        return self.value.requires_grad

    @property
    def is_leaf(self) -> bool:
        return self.value.is_leaf

    @property
    def grad_fn(self) -> Any:
        return self.value.grad_fn

    def grad_leaf(self) -> bool:
        value = self.value
        return value.requires_grad and value.grad_fn is None

    def first(self) -> torch.Tensor | None:
        return self.value

    def whole_of(self, layout: Layout, shape: tuple[int, ...], itemsize: int,
                 copy: bool = True) -> torch.Tensor | None:
        return self.value

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], layout: Layout) -> Local:
        return Whole(fn(self.value), layout)

    def with_grad(self, flag: bool, layout: Layout) -> Local:
        value = self.value
        if layout.is_partial:  # the leaves are the canonical blocks
            return Blocks(self.blocks).with_grad(flag, layout)
        if value.requires_grad == flag:
            return self
        return Whole(value.detach().requires_grad_(flag), layout)

    def grad_local(self, grads: Sequence[torch.Tensor | None], layout: Layout) -> Local:
        g = grads[0]
        assert g is not None
        return Whole(g, layout)

    def _part(self, other: Local, layout: Layout, shape: tuple[int, ...] | None
              ) -> torch.Tensor:
        shape = tuple(self.value.shape) if shape is None else shape
        w = other.whole_of(layout, shape, self.value.dtype.itemsize, False)
        if w is None:  # held as blocks (a relayout's result): their global value
            full = Layout.replicated(layout.mesh, len(shape))
            w = backend_for(layout.mesh).assemble(
                other.blocks, layout, full, shape)[0]  # type: ignore[arg-type]
        return w

    def as_blocks(self) -> Blocks:
        return Blocks(self.blocks)

    def as_whole(self, layout: Layout, shape: tuple[int, ...], itemsize: int) -> Whole:
        return self

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        return (self.value.grad,)

    def alias(self) -> Local:
        value = self.value
        if not value.requires_grad:
            return self
        return Whole(value.view_as(value), self.layout)

    def rehome(self, layout: Layout) -> Local:
        return hold(self.value.detach(), layout)

    def global_value(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype
                     ) -> torch.Tensor:
        return self.value

    def moved(self, plan: Plan, target: Layout, diverge: tuple[int, ...] = (),
              owner: GradOwner | None = None, view: torch.Tensor | None = None) -> Local:
        # a layout change of a value held whole is metadata; its collectives (and its
        # gradient's, through a hook on an identity view) are counted as the blocks
        # would run them
        value = self.value
        if comm.active():
            where = comm.source_line()
            for step in plan.collectives:
                comm.record(step.kind, step.bytes_per_device, step, where=where)
            back = tuple(backward_steps(plan))
            axes = owner.others(diverge) if owner is not None else diverge
            if axes:
                back += (diverge_step(target, plan.shape, plan.itemsize, axes),)
            if back and torch.is_grad_enabled() and value.requires_grad:
                value = value.view_as(value) if view is None else view
                comm.on_backward([value], back, where)
        if comm.holding() and plan.collectives:
            # the moved blocks a process per device allocates: a buffer of its own here
            # (a view), which lives as long as the moved value does
            if value is self.value:
                value = value.view_as(value) if view is None else view
            comm.hold(value, target, plan.shape)
        return Whole(value, target)


def record_plan(plan: Plan) -> None:
    """Count ``plan``'s collectives for CommCounter without running them (a layout
    change of a value held whole)."""
    if comm.active():
        for step in plan.collectives:
            comm.record(step.kind, step.bytes_per_device, step)


def run_plan(mesh: DeviceMesh, plan: Plan, shards: Sequence[torch.Tensor | None]
             ) -> list[torch.Tensor]:
    """Execute ``plan`` on ``mesh``'s backend, counting its collectives (and, when a
    gradient is recorded, its gradient's) for CommCounter."""
    if not comm.active():
        return backend_for(mesh).execute_plan(plan, shards)  # type: ignore[arg-type]
    where = comm.source_line()
    for step in plan.collectives:
        comm.record(step.kind, step.bytes_per_device, step, where=where)
    out = backend_for(mesh).execute_plan(plan, shards)  # type: ignore[arg-type]
    comm.on_backward(out, backward_steps(plan), where)
    return out


_REPLICATED: dict[tuple[int, int], tuple[DeviceMesh, Layout]] = {}


def _replicated(mesh: DeviceMesh, ndim: int) -> Layout:
    """``Layout.replicated(mesh, ndim)``, cached by mesh identity (the mesh is kept)."""
    hit = _REPLICATED.get((id(mesh), ndim))
    if hit is None:
        hit = _REPLICATED[(id(mesh), ndim)] = (mesh, Layout.replicated(mesh, ndim))
    return hit[1]


def cut(value: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The blocks of ``value`` (the global value) that ``layout`` gives each device;
    Partial axes get the canonical decomposition (the planner's make_partial steps,
    local: nothing is counted as communication).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> [b.tolist() for b in cut(torch.arange(4.), Layout(mesh, ((0,),), (None,)))]
    [[0.0, 1.0], [2.0, 3.0]]
    >>> [b.tolist() for b in cut(torch.ones(2), Layout(mesh, ((),), (ReduceOp.SUM,)))]
    [[1.0, 1.0], [0.0, 0.0]]
    """
    mesh = layout.mesh
    shape = tuple(value.shape)
    backend = backend_for(mesh)
    if layout.is_partial:
        plain = layout.without_partial()
        plan = make_plan(plain, layout, shape, value.dtype.itemsize)
        return tuple(backend.execute_plan(plan, cut(value, plain)))
    return tuple(backend.assemble([value] * mesh.num_devices, _replicated(mesh, len(shape)),
                                  layout, shape))


_LOCAL: dict[tuple[int, torch.device | None], tuple[Any, bool]] = {}


def local_mesh(mesh: DeviceMesh, device: torch.device | None) -> bool:
    """Whether this process alone holds every device of ``mesh``, all on torch
    ``device``. Never in a process world (torch.distributed initialized): other
    processes may take part in ``mesh``'s collectives (a one-device mesh held here is
    still broadcast to them), so every process runs the ops block by block alike.

    >>> local_mesh(DeviceMesh.cpu(2, "x"), torch.device("cpu"))
    True
    """
    if C10D._default_pg is not None:
        return False
    hit = _LOCAL.get((id(mesh), device))
    if hit is None:
        backend = backend_for(mesh)
        ok = device is not None and len(backend.owned(mesh)) == mesh.num_devices and all(
            backend.device_of(mesh, k) == device for k in range(mesh.num_devices))
        hit = _LOCAL[(id(mesh), device)] = (mesh, ok)
    return hit[1]


def hold(value: torch.Tensor, layout: Layout) -> Local:
    """The runtime's holding of ``value`` (the global value) laid out as ``layout``: the
    value itself on a mesh this process holds wholly on its torch device (ops then run
    once on it), else the blocks this process holds, cut from it.

    >>> hold(torch.arange(4.), Layout(DeviceMesh.cpu(2, "x"), ((0,),), (None,)))
    Whole((4,))
    """
    if local_mesh(layout.mesh, value.device):
        return Whole(value, layout)
    return Blocks(cut(value, layout))


# --- running an op's local calls -------------------------------------------------------
def failed(op: str, call: Sequence[Any], shapes: Sequence[Sequence[int]], rule: str,
           err: Exception) -> ShardingError:
    """The error of ``op`` failing on the local arguments ``call`` of operands with
    global ``shapes`` under ``rule`` (raise it from ``err``)."""
    shown = [tuple(a.shape) for a in call if isinstance(a, torch.Tensor)]
    return ShardingError(
        f"{op} failed on the local blocks {shown} of operands with global shapes "
        f"{[list(s) for s in shapes]} (rule '{rule}'): {err}")


def run_blocks(op: str, fn: Callable[..., torch.Tensor], args: Sequence[Any],
               decided: Any, shaped: bool, views: Any = None
               ) -> tuple[Blocks, torch.Tensor | None]:
    """Run a decided op (``Backend.run_local``'s arguments; ``decided``: a
    ``runtime.Decided``) once per distinct row of the operands' blocks in their required
    layouts, one result shared by every device holding that row (replicas keep sharing
    one buffer, so simulated gradients are exact). A device another process holds is
    None in every operand and in the result. Returns the result's blocks and one of
    them (None when this process holds none). The process runtime's every op: one and
    two operands (the commonest) run in their own loops, in this one frame."""
    cols = decided.blocks(args)
    expect = decided.dec.local_shapes
    n = len(args)
    out: list[torch.Tensor | None] = []
    first = None
    if n == 1 and not shaped and cols[0] is not None:
        b0 = None
        memo1: dict[int, torch.Tensor] | None = None
        for k, b in enumerate(cols[0]):
            if b is None:
                out.append(None)
                continue
            if first is not None:
                if b is b0:  # a replica of the first: the same result
                    out.append(first)
                    continue
                if memo1 is None:
                    memo1 = {id(b0): first}
                r = memo1.get(id(b))
                if r is not None:
                    out.append(r)
                    continue
            try:
                r = fn(b)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                raise _failed(op, (b,), decided.factors, err) from err
            if r.shape != expect[k]:
                raise _misshapen(op, k, r, expect[k])
            if first is None:
                first, b0 = r, b
            else:
                memo1[id(b)] = r  # type: ignore[index]
            out.append(r)
        return Blocks(tuple(out)), first
    if n == 2 and not shaped and cols[0] is not None and cols[1] is not None:
        ys = cols[1]
        b0 = c0 = None
        memo2: dict[tuple[int, int], torch.Tensor] | None = None
        for k, b in enumerate(cols[0]):
            if b is None:
                out.append(None)
                continue
            c = ys[k]
            if first is not None:
                if b is b0 and c is c0:  # a replica of the first pair: the same result
                    out.append(first)
                    continue
                if memo2 is None:
                    memo2 = {(id(b0), id(c0)): first}
                r = memo2.get((id(b), id(c)))
                if r is not None:
                    out.append(r)
                    continue
            try:
                r = fn(b, c)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                raise _failed(op, (b, c), decided.factors, err) from err
            if r.shape != expect[k]:
                raise _misshapen(op, k, r, expect[k])
            if first is None:
                first, b0, c0 = r, b, c
            else:
                memo2[(id(b), id(c))] = r  # type: ignore[index]
            out.append(r)
        return Blocks(tuple(out)), first
    return _rows(op, fn, args, cols, expect, decided.factors, shaped)


def _rows(op: str, fn: Callable[..., torch.Tensor], args: Sequence[Any],
          cols: Sequence[Sequence[torch.Tensor | None] | None], expect: Sequence[Any],
          factors: Any, shaped: bool) -> tuple[Blocks, torch.Tensor | None]:
    """:func:`run_blocks` for any operands (constants among them, ``shaped``: ``fn`` also
    takes the expected block shape)."""
    where = [i for i, c in enumerate(cols) if c is not None]
    plain = len(where) == len(args) and not shaped  # every operand a Tensor: fn(*row)
    single = len(where) == 1
    picked = [cols[i] for i in where]
    memo: dict[Any, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    first = None
    for k, row in enumerate(zip(*picked)):
        key: Any = id(row[0]) if single else tuple(map(id, row))
        r = memo.get(key)
        if r is None:
            if row[0] is None:  # another process's device (None in every operand)
                out.append(None)
                continue
            if plain:
                call: Sequence[Any] = row
            else:
                call = list(args)
                for i, s in zip(where, row):
                    call[i] = s
                if shaped:
                    call.append(expect[k])
            try:
                r = fn(*call)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                raise _failed(op, call, factors, err) from err
            if r.shape != expect[k]:
                raise _misshapen(op, k, r, expect[k])
            memo[key] = r
            if first is None:
                first = r
        out.append(r)
    return Blocks(tuple(out)), first


def _failed(op: str, call: Sequence[Any], factors: Any, err: Exception) -> ShardingError:
    return failed(op, call, factors.shapes, factors.text, err)


def _misshapen(op: str, k: int, r: torch.Tensor, expect: Any) -> AssertionError:
    return AssertionError(f"{op}: device {k} computed a block of shape {tuple(r.shape)}, "
                          f"the layout gives {tuple(expect)}")
