"""The machinery of ``fully_shard`` (:mod:`shardwise.parallel.fsdp`): one unit's
gather before forward, its gradient reduction in backward, and the saved-tensor
hooks that keep gathered parameters out of autograd.

Invariants:
- Between forwards every parameter a unit manages is an ``nn.Parameter`` over a
  shardwise Tensor additionally Sharded over the FSDP axis (its *sharded layout*):
  ``module.parameters()``, ``state_dict()`` (original names) and the optimizer see only
  these, so optimizer state made by ``zeros_like(p)`` is sharded too.
- A unit (one ``fully_shard`` call) gathers its parameters over the FSDP axis just
  before its forward (after the mixed-precision cast; one flat all_gather per dtype,
  :mod:`~shardwise.parallel.fsdp_flat`, and the planner for parameters no flat
  buffer can take) and swaps the gathered values into their modules for that forward.
- One path: one autograd node per unit forward (``_Gather``) maps the buffers of the
  sharded parameters (``Local.buffers``) to those of the gathered values; its
  backward sums the gathered gradient over the FSDP axis and cuts it back to the
  sharded layout: one reduce_scatter per flat buffer. :meth:`Unit.gather` and
  :meth:`Unit.reduce` are its two halves.
- Whole values: on a mesh this process holds wholly every sharded parameter holds
  its global value (``fully_shard`` makes it so; its blocks are views of it). The
  gathered value of a parameter is then a view of that global value (a cast copy
  under ``param_dtype``), its ops run once on it, and autograd hands the backward the
  gradient summed over every device, which is the reduce_scatter's result in the
  whole's form. The all_gathers and reduce_scatters are counted as the flat buffers
  would run them.
- With ``reshard_after_forward`` autograd never holds a gathered block: saved-tensor
  hooks store a reference instead and the first unpack in backward re-gathers the unit
  (for whole values: views of the parameters again, or new cast copies).
- Gradient routes: on a mesh this process holds wholly (simulated) the replicas of a
  gathered block share one buffer, so autograd already sums the devices' shares and
  the backward cuts the sum (counted as the reduce_scatter it stands for). On the
  multi-process runtime a gathered block feeding an op directly hands its share to
  the unit (the gathered Tensor's :class:`~shardwise.runtime.owner.GradOwner`, read by
  the backend's ``diverge`` instead of an all_reduce, and by CommCounter) and the
  backward reduce_scatters the shares; any other use arrives fully reduced and is cut.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardwise.parallel.fsdp_flat import Blocks, Flat, one_all_gather
from shardwise.parallel.precision import MixedPrecisionPolicy
from shardwise.planner import Plan, make_plan
from shardwise.runtime import backend_for, observe, position
from shardwise.runtime.local import Blocks as HeldBlocks
from shardwise.runtime.local import hold
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor

__all__ = ["UNIT", "Param", "Unit", "sharded_layout"]

UNIT = "_sw_fsdp_unit"  # attribute of a fully_shard-ed module: its Unit


@dataclass(eq=False)
class Param:
    """One managed parameter: where it is registered and its two layouts."""

    owners: list[tuple[nn.Module, str]]
    sharded: Tensor  # an nn.Parameter over a shardwise Tensor
    gathered: Layout
    dim: int


class _Call:
    """One forward of a unit, until its backward: which output block is which, the
    shares handed over by ``diverge``, and the blocks re-gathered for backward."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.index: list[list[int | None]] = []  # per param, per device: output index
        self.blocks: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.shares: dict[int, torch.Tensor] = {}
        self.regathered: list[list[torch.Tensor]] | None = None  # per param: per storage
        self.hooks: Any = None
        self.held: list[Any] = []  # per param: its gathered value as the runtime holds it
        self.outputs: list[range] = []  # per param: its buffers' outputs of the gather
        self.freed = False  # gathered copies freed after forward (views of the params: not)

    def share(self, j: int, g: torch.Tensor) -> None:
        have = self.shares.get(j)
        self.shares[j] = g if have is None else have + g

    def storage_block(self, i: int, ordinal: int) -> torch.Tensor:
        if self.regathered is None:
            with torch.no_grad():
                self.regathered = [_storages(held.buffers())[1]
                                   for held in self.unit.gather()]
        return self.regathered[i][ordinal]


def _get(got: dict[int, torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """The gather's output for the gathered buffer ``b`` (autograd's own tensor)."""
    return got[id(b)]


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lies in (its identity: fake tensors' data pointers are all 0)."""
    return int(t.untyped_storage()._cdata)


def _storages(shards: Any) -> tuple[list[int], list[torch.Tensor]]:
    """The distinct storages of ``shards`` (:func:`_storage_key`, one block of each), in
    order."""
    ptrs: list[int] = []
    firsts: list[torch.Tensor] = []
    for s in shards:
        if s is None:
            continue
        ptr = _storage_key(s)
        if ptr not in ptrs:
            ptrs.append(ptr)
            firsts.append(s)
    return ptrs, firsts


# storage key -> (call, param index, storage ordinal) of the gathered blocks of
# units that reshard after forward, while their forward runs (packs happen only then)
_LIVE: dict[int, tuple[_Call, int, int]] = {}


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps instead of a view of a gathered block."""

    call: _Call
    param: int
    ordinal: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor) -> Any:
    if not _LIVE or isinstance(t, Tensor) or t.layout is not torch.strided:
        return t
    hit = _LIVE.get(_storage_key(t))
    if hit is None:
        return t
    return _Saved(hit[0], hit[1], hit[2], t.size(), t.stride(), int(t.storage_offset()))


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved
    base = saved.call.storage_block(saved.param, saved.ordinal)
    return base.as_strided(saved.size, saved.stride, saved.offset)


class _Gather(torch.autograd.Function):
    """all_gather over the FSDP axis in forward; reduce_scatter of the gradient in
    backward (one of each per flat buffer of the unit, :meth:`Unit.gather` and
    :meth:`Unit.reduce`). Its inputs are the buffers of the sharded parameters, its
    outputs those of the gathered values (``Local.buffers``: the blocks, or on a mesh
    held wholly the whole values)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *leaves: torch.Tensor) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)
        outs: list[torch.Tensor] = []
        for held in call.unit.gather():
            buffers = held.buffers()
            call.held.append(held)
            call.outputs.append(range(len(outs), len(outs) + len(buffers)))
            outs.extend(buffers)
            if not call.unit.wholes:  # which output each device's block is (hand_off)
                at = {id(b): j for b, j in zip(buffers, call.outputs[-1])}
                call.index.append([None if b is None else at[id(b)] for b in held.blocks])
        call.blocks = [(b.shape, b.dtype, b.device) for b in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        unit = call.unit
        if unit.reshard and not call.freed:
            # gathered views of the parameters hold no memory of their own, so none
            # was freed and autograd kept them: count the re-gather it stands for
            unit.record_gathers()
        with position.at(position.backward_of(unit.site)), \
                position.issuing("reduce_scatter gradients"):
            out = unit.reduce(call, grads)
        call.regathered = None
        return (None, *out)


class _Share(torch.autograd.Function):
    """identity in forward; backward hands the gradient share to the unit (which
    reduce_scatters the shares) and sends nothing further back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Any) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.sink(g)
        return None, None


class Unit:
    """The state of one ``fully_shard`` call: its parameters, in flat groups (one
    all_gather and one reduce_scatter per dtype) and alone (gathered by the planner)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, axis: int,
                 params: list[Param], reshard: bool, policy: MixedPrecisionPolicy) -> None:
        self.module, self.mesh, self.axis, self.params = module, mesh, axis, params
        self.site = position.site(type(module).__name__, "fully_shard")  # fully_shard names it
        self.reshard, self.policy = reshard, policy
        self.owned = list(backend_for(mesh).owned(mesh))
        self.local = len(self.owned) == mesh.num_devices
        self.call: _Call | None = None
        by_dtype: dict[torch.dtype, list[int]] = {}
        self.alone: list[int] = []
        for i, fp in enumerate(params):
            p = fp.sharded
            if one_all_gather(p.dist_layout, fp.gathered, tuple(p.shape), axis):
                by_dtype.setdefault(self.dtype(i), []).append(i)
            else:
                self.alone.append(i)
        self.groups = [(idx, Flat(mesh, axis, [
            (tuple(params[i].sharded.shape), params[i].sharded.dist_layout,
             params[i].gathered, params[i].dim) for i in idx])) for idx in by_dtype.values()]
        self.wholes = self._all_whole()

    def _all_whole(self) -> bool:
        """Whether every parameter holds its global value on a mesh held here wholly
        (checked per forward too: ``x.data = ...`` may swap a whole for blocks)."""
        return self.local and cache.runs_whole([fp.sharded for fp in self.params])

    def record_gathers(self) -> None:
        """Count one gather's all_gathers for CommCounter, where the whole-value path
        runs none."""
        if observe.active():
            for plan in self._gather_plans():
                _record(plan)

    def _gather_plans(self) -> list[Plan]:
        out = [flat.gather_plan(self.dtype(idx[0]).itemsize) for idx, flat in self.groups]
        for i in self.alone:
            fp = self.params[i]
            out.append(make_plan(fp.sharded.dist_layout, fp.gathered,
                                 tuple(fp.sharded.shape), self.dtype(i).itemsize))
        return out

    def gather_wholes(self, wholes: Any = None) -> list[torch.Tensor]:
        """Per parameter: its whole value in ``param_dtype`` (the gathered value on a
        mesh this process holds wholly: the parameter's own storage, or a cast copy),
        counted as the unit's all_gathers."""
        if wholes is None:
            wholes = [cache.whole_of(fp.sharded) for fp in self.params]
        self.record_gathers()
        out = []
        for i, w in enumerate(wholes):
            dtype = self.dtype(i)
            out.append(w.view_as(w) if w.dtype == dtype else w.to(dtype))
        if observe.holding():  # the gathered blocks, which a process per device allocates
            for fp, g in zip(self.params, out):
                observe.hold(g, fp.gathered, tuple(fp.sharded.shape))
        return out

    def reduce_wholes(self, grads: tuple[torch.Tensor | None, ...]) -> list[Any]:
        """The sharded parameters' whole gradients from the gathered ones (autograd
        summed them over every device): cast through ``reduce_dtype``; the unit's
        reduce_scatters are counted."""
        n = len(self.params)
        reds = [self.policy.reduce_dtype or self.dtype(i) for i in range(n)]
        if observe.active():
            for idx, flat in self.groups:
                if any(grads[i] is not None for i in idx):
                    _record(flat.plan(reds[idx[0]].itemsize))
            for i in self.alone:
                fp = self.params[i]
                if grads[i] is not None:
                    _record(make_plan(self._partial(fp.gathered), fp.sharded.dist_layout,
                                      tuple(fp.sharded.shape), reds[i].itemsize))
        out: list[Any] = []
        for i, g in enumerate(grads):
            out.append(None if g is None else g.to(reds[i]).to(self.params[i].sharded.dtype))
        return out

    def dtype(self, i: int) -> torch.dtype:
        """The dtype parameter ``i`` is gathered and computed in."""
        return self.policy.param_dtype or self.params[i].sharded.dtype

    # --- forward ----------------------------------------------------------------------
    def gather_all(self) -> list[Blocks]:
        """Per parameter, per device: its gathered block, cast to ``param_dtype`` first."""
        values = []
        for i, fp in enumerate(self.params):
            t, dtype = fp.sharded.detach(), self.dtype(i)
            values.append(t if t.dtype == dtype else t.map_blocks(
                lambda s, d=dtype: s.to(d)))
        out: list[Blocks] = [[] for _ in self.params]
        for idx, flat in self.groups:
            for i, blocks in zip(idx, flat.gather([values[i] for i in idx], self.owned)):
                out[i] = blocks
        for i in self.alone:
            out[i] = list(values[i].relayout(self.params[i].gathered).shards)
        return out

    def refresh(self) -> None:
        """Take each parameter from its module again: ``to_empty``, ``.to()`` or an
        assignment may have registered a new Parameter object (a meta-device model
        made real, say), which must keep the sharded layout."""
        for fp in self.params:
            owner, name = fp.owners[0]
            now = owner._parameters.get(name)
            if now is fp.sharded:
                continue
            if (not isinstance(now, Tensor) or now.dist_layout != fp.sharded.dist_layout
                    or now.shape != fp.sharded.shape):
                raise ShardingError(
                    f"fully_shard: {type(owner).__name__}.{name} was replaced by "
                    f"{now!r}, not a shardwise Tensor laid out as {fp.sharded!r}. Replace "
                    "parameters before fully_shard, or assign one with the same layout.")
            fp.sharded = now
            for other, other_name in fp.owners[1:]:
                other._parameters[other_name] = now

    def gather(self) -> list[Any]:
        """Per parameter, its gathered value (cast to ``param_dtype`` first) as the
        runtime holds it (a ``Local``): the blocks of the flat all_gathers (and the
        planner's, for parameters no flat buffer takes); on whole values (a mesh this
        process holds wholly, :attr:`wholes`) the parameter's own value (a view, or a
        cast copy), counted as those all_gathers."""
        if self.wholes:
            return [hold(w, fp.gathered) for w, fp in zip(self.gather_wholes(), self.params)]
        return [HeldBlocks(tuple(blocks)) for blocks in self.gather_all()]

    def leaves(self) -> list[torch.Tensor]:
        """The sharded parameters' buffers the gather differentiates: their whole values
        where :meth:`gather` runs on them, else their distinct blocks (views of a whole
        value, which autograd flows through)."""
        return [b for fp in self.params for b in (
            fp.sharded.held if self.wholes else fp.sharded.held.as_blocks()).buffers()]

    def unshard(self) -> None:
        self.refresh()
        call = self.call = _Call(self)
        self.wholes = self._all_whole()
        leaves = self.leaves()
        outs = _Gather.apply(call, *leaves)
        for i, fp in enumerate(self.params):
            held = call.held[i]
            got = {id(b): outs[j] for b, j in zip(held.buffers(), call.outputs[i])}
            held = held.map(functools.partial(_get, got), fp.gathered)
            full = Tensor.from_held(held, fp.gathered, fp.sharded.shape, self.dtype(i),
                                    fp.sharded.device, None)
            # the unit sums this gradient over its axis (a reduce_scatter, counted
            # there): the runtime's diverge neither all_reduces nor counts it
            full.grad_owner = GradOwner((self.axis,),
                                        None if self.local else self._hand_off(call, i))
            for owner, name in fp.owners:
                owner._parameters[name] = full  # type: ignore[assignment]
        call.held = []  # (the gathered values live in their modules only: freeable)
        if self.reshard:
            # gathered copies are freed after forward (autograd keeps a reference and
            # the first unpack in backward re-gathers); views of the parameters are not,
            # unless a memory tracker listens: it counts the gathered blocks a process
            # per device holds, so autograd must not keep the views past forward either
            own = set() if observe.holding() else {_storage_key(b) for b in leaves}
            for i in range(len(self.params)):
                ptrs = _storages([outs[j] for j in call.outputs[i]])[0]
                if any(p not in own for p in ptrs):
                    call.freed = True
                    for ordinal, ptr in enumerate(ptrs):
                        _LIVE[ptr] = (call, i, ordinal)
            if call.freed:
                call.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
                call.hooks.__enter__()

    @staticmethod
    def _hand_off(call: _Call, i: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Device ``k``'s gathered block of parameter ``i`` as an identity whose
        gradient share goes to ``call`` (reduce_scattered by the unit's backward)."""
        index = call.index[i]

        def hand_off(k: int, block: torch.Tensor) -> torch.Tensor:
            j = index[k]
            assert j is not None, "a process hands off only the blocks it holds"
            return _Share.apply(block, lambda g: call.share(j, g))
        return hand_off

    def reshard_params(self) -> None:
        """Put the sharded parameters back into their modules (after forward)."""
        call = self.call
        self.call = None
        for fp in self.params:
            for owner, name in fp.owners:
                owner._parameters[name] = fp.sharded  # type: ignore[assignment]
        if call is None:
            return
        for ptr in [p for p, hit in _LIVE.items() if hit[0] is call]:
            del _LIVE[ptr]
        if call.hooks is not None:
            call.hooks.__exit__(None, None, None)
            call.hooks = None

    # --- backward ---------------------------------------------------------------------
    def reduce(self, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> list[Any]:
        """The gradients of the sharded parameters' buffers (``_Gather``'s inputs) from
        those of the gathered values' (its outputs): on whole values autograd summed
        them over every device already (:meth:`reduce_wholes`), else
        :meth:`reduce_blocks`."""
        if self.wholes:
            return self.reduce_wholes(tuple(grads[r.start] for r in call.outputs))
        return self.reduce_blocks(call, grads)

    def reduce_blocks(self, call: _Call, grads: tuple[torch.Tensor | None, ...]
                      ) -> list[Any]:
        """The sharded leaves' gradients: gathered-block gradients that arrive summed
        (autograd's accumulation, or the runtime's diverge) are cut to the sharded
        block; shares handed over by ``diverge`` are reduce-scattered."""
        n = len(self.params)
        reds = [self.policy.reduce_dtype or self.dtype(i) for i in range(n)]
        full: list[Blocks | None] = [None] * n
        share: list[Blocks | None] = [None] * n
        for i, fp in enumerate(self.params):
            index = call.index[i]
            g = [None if j is None else grads[j] for j in index]
            if any(x is not None for x in g):
                full[i] = list(self._tensor(call, index, g, reds[i], fp.gathered, fp)
                               .relayout(fp.sharded.dist_layout).shards)
            got = [None if j is None else call.shares.pop(j, None) for j in index]
            if any(x is not None for x in got):
                share[i] = got
        for idx, flat in self.groups:
            if self.local and any(full[i] is not None for i in idx):
                _record(flat.plan(reds[idx[0]].itemsize))
            if any(share[i] is not None for i in idx):
                blank: Blocks = [None] * self.mesh.num_devices
                summed = flat.scatter([share[i] or blank for i in idx], reds[idx[0]],
                                      self.owned)
                for i, blocks in zip(idx, summed):
                    share[i] = blocks
        for i in self.alone:
            fp = self.params[i]
            if self.local and full[i] is not None:
                _record(make_plan(self._partial(fp.gathered), fp.sharded.dist_layout,
                                  tuple(fp.sharded.shape), reds[i].itemsize))
            mine = share[i]
            if mine is not None:
                share[i] = list(self._tensor(call, call.index[i], mine, reds[i],
                                             self._partial(fp.gathered), fp)
                                .relayout(fp.sharded.dist_layout).shards)
        out: list[Any] = []
        for i, fp in enumerate(self.params):
            a, b = full[i], share[i]
            for k in fp.sharded.unique_shards()[0]:
                parts = [x[k] for x in (a, b) if x is not None]
                total = parts[0] if len(parts) == 1 else parts[0] + parts[1] if parts else None
                out.append(None if total is None else total.to(fp.sharded.dtype))
        return out

    def _partial(self, layout: Layout) -> Layout:
        partial = list(layout.partial)
        partial[self.axis] = ReduceOp.SUM
        return layout.with_partial(tuple(partial))

    @staticmethod
    def _tensor(call: _Call, index: list[int | None], grads: Blocks, dtype: torch.dtype,
                layout: Layout, fp: Param) -> Tensor:
        blocks: Blocks = []
        for j, g in zip(index, grads):
            if j is None:
                blocks.append(None)
                continue
            if g is None:
                shape, _, device = call.blocks[j]
                g = torch.zeros(shape, dtype=dtype, device=device)
            blocks.append(g.to(dtype))
        return Tensor(blocks, layout, fp.sharded.shape, dtype)


def _record(plan: Plan) -> None:
    """Count ``plan``'s collectives for CommCounter without running them (the sum
    they would compute already happened in autograd's accumulation, or the gathered
    value is the whole value this process holds)."""
    if observe.active():
        for step in plan.collectives:
            observe.record(step.kind, step.bytes_per_device, step)


def sharded_layout(layout: Layout, axis: int, shape: tuple[int, ...]) -> tuple[Layout, int]:
    """``layout`` additionally Sharded over mesh ``axis`` and the dim it shards: dim 0
    as FSDP2 (``axis`` the minor axis of the dim, so that gathering it is one
    all_gather), else the first dim where that holds (an uneven split of dim 0 that
    another axis already shards), else dim 0.

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> tp_rows = Layout(mesh, ((1,), ()), (None, None))          # S(0) over tp
    >>> sharded_layout(tp_rows, 0, (8, 4))[0].spec_entries()
    (('tp', 'dp'), None)
    """
    if not shape:
        raise ShardingError(
            f"fully_shard cannot shard a 0-d parameter over mesh axis {axis}: it has no dim. "
            "Keep it outside the unit, or give it shape (1,).")

    def with_axis(d: int) -> Layout:
        dims = list(layout.dims)
        dims[d] = dims[d] + (axis,)
        return layout.with_dims(tuple(dims))

    for d in range(len(shape)):
        cand = with_axis(d)
        if one_all_gather(cand, layout, shape, axis):
            return cand, d
    return with_axis(0), 0
