"""``ExpertParallel``: an experts module's experts over one mesh axis (torchtitan's name),
its tokens dispatched to them by all_to_all and combined back.

The experts module has torchtitan's shape: every parameter of its own holds the experts
on dim 0 (``w1 [E, H, D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]`` for SwiGLU experts), and
its forward is ``(tokens [N, D] sorted by expert, num_tokens_per_expert) -> [N, D]``,
the counts being ``[E]`` (torchtitan's) or ``[G, E]``: ``G`` groups of ``N / G``
consecutive rows, each sorted by expert (one group per sequence routes a batch sharded
over ``dp`` with no global sort).

Invariants:
- The plan's axis (``ep``) shards dim 0 of every parameter of the module's own;
  ``E`` must be divisible by its size.
- Forward runs as a ``shard_map`` over the parameters' mesh: each device sends its
  rows of the tokens (``Sharded(0)`` over ``ep``) to the devices holding their experts
  (``lax.ragged_all_to_all``: variable splits, or fixed ones with capacity), runs the module's
  own forward on its local experts with the rows they got (sorted by local expert,
  counts ``[E / ep]``), and sends the results back. The output is ``[N, D]``,
  ``Sharded(0)`` over ``ep``.
- Dropless (the default): values and gradients are those of the module's forward on
  one device. The split sizes are read from the counts on the host, once per forward
  (as torchtitan's ``.tolist()``), and checked there.
- ``capacity_factor``: each (group, expert) takes at most ``C = ceil(capacity_factor *
  N / G / E)`` rows, the first ones; the others output 0 (GShard's dropping). The
  exchange has fixed sizes, so the counts are never read on the host (no device sync);
  it needs the groups to divide over ``ep``.
- Other mesh axes (``tp`` on dp2ep): tokens and experts are Replicated there, and every
  device of them computes the same rows (coordinate 0's result is the value).
- The module's own forward runs per device on plain tensors (a shallow copy of the
  module holding the local blocks), so it must not keep state on ``self``.

On ``DeviceMesh(ep=2)`` with 4 experts (torchtitan's dispatch, then combine)::

    device   experts   tokens held      computes for           returns
    0        0, 1      rows 0..N/2      rows of experts 0, 1   rows 0..N/2
    1        2, 3      rows N/2..N      rows of experts 2, 3   rows N/2..N
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardwise.ops import graph_breaks
from shardwise.parallel.dispatch import (
    capacity_of,
    capacity_slots,
    dropless_route,
    host_counts,
)
from shardwise.parallel.placing import shard_parameter
from shardwise.parallel.style import ParallelStyle, mark
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Sharded
from shardwise.spmd import lax
from shardwise.spmd.shard_map import shard_map
from shardwise.tensors.traced import traced

__all__ = ["ExpertParallel"]


class ExpertParallel(ParallelStyle):
    """Experts ``Sharded(0)`` over the plan's axis, tokens dispatched to them and combined
    back by all_to_all (see the module doc); ``capacity_factor`` fixes each expert's
    capacity per group (no host read of the counts; rows past it output 0).

    >>> import torch.nn.functional as F
    >>> from shardwise.parallel import parallelize_module
    >>> class Experts(torch.nn.Module):          # torchtitan's shape, one loop per expert
    ...     def __init__(self, experts, dim, hidden):
    ...         super().__init__()
    ...         self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, dim))
    ...         self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden))
    ...         self.w3 = torch.nn.Parameter(torch.randn(experts, hidden, dim))
    ...     def forward(self, x, num_tokens_per_expert):
    ...         rows = x.split(num_tokens_per_expert.tolist())
    ...         return torch.cat([(F.silu(r @ w1.T) * (r @ w3.T)) @ w2.T
    ...                           for r, w1, w2, w3 in zip(rows, self.w1, self.w2, self.w3)])
    >>> torch.manual_seed(0); experts = Experts(4, 8, 16)
    <torch._C.Generator object at ...>
    >>> x, counts = torch.randn(6, 8), torch.tensor([1, 2, 2, 1])
    >>> want = experts(x, counts)
    >>> experts = parallelize_module(experts, DeviceMesh.cpu(2, "ep"), ExpertParallel())
    >>> experts.w1.placements
    (Sharded(axis=0),)
    >>> with shardwise.debug.CommCounter() as cc:
    ...     got = experts(x, counts)
    >>> torch.allclose(got.to_torch(), want, atol=1e-5), dict(cc.counts)  # dispatch, combine
    (True, {'all_to_all': 2})
    """

    def __init__(self, *, capacity_factor: float | None = None) -> None:
        if capacity_factor is not None and (
                isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                or not capacity_factor > 0):
            raise ShardingTypeError(
                f"ExpertParallel(capacity_factor=...) is a number > 0 (1.0: each expert "
                f"takes its even share of a group's rows) or None (dropless). Got "
                f"{capacity_factor!r}.")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        where = repr(name) if name else type(module).__name__
        params = [(n, p) for n, p in module._parameters.items() if p is not None]
        if not params:
            raise ShardingError(
                f"ExpertParallel shards the experts module's own parameters (w1 [E, H, D], "
                f"w2, w3: experts on dim 0); {where} ({type(module).__name__}) has none. "
                "Plan the experts module itself, e.g. 'layers.*.moe.experts'.")
        experts = params[0][1].shape[0] if params[0][1].ndim else 0
        odd = [(n, list(p.shape)) for n, p in params if p.ndim == 0 or p.shape[0] != experts]
        if odd:
            raise ShardingError(
                f"ExpertParallel: every parameter of {where} holds the experts on dim 0, but "
                f"{params[0][0]!r} has {experts} and {odd[0][0]!r} has shape {odd[0][1]}. "
                "Give each parameter the experts as its first dim (torchtitan's w1 [E, H, D]).")
        ep = mesh.mesh_shape[axis]
        if experts % ep:
            raise ShardingError(
                f"Cannot shard the {experts} experts of {where} across {ep} devices of mesh "
                f"axis {mesh.axis_names[axis]!r}: the expert count must be divisible by "
                f"{ep}. Use an ep axis whose size divides {experts}, or another number of "
                "experts.")
        for pname, _ in params:
            shard_parameter(module, pname, mesh, axis, Sharded(0))
        plan = _Plan(type(module).forward, tuple(n for n, _ in params), mesh,
                     mesh.axis_names[axis], experts, self.capacity_factor, where)
        # fixed slots: one node of a compiled graph (its exchanges have static sizes);
        # dropless reads the counts on the host: under compile a listed graph break
        forward = (functools.partial(_dropless_forward, plan) if plan.capacity_factor is None
                   else traced(functools.partial(_forward, plan)))
        module.forward = types.MethodType(forward, module)
        mark(module, mesh, name, "ExpertParallel")


@dataclass(frozen=True)
class _Plan:
    """One planned experts module: its class's forward, parameter names, mesh, ep axis,
    expert count, capacity factor and name (for errors)."""

    forward: Callable[..., Any]
    names: tuple[str, ...]
    mesh: DeviceMesh
    axis: str
    experts: int
    capacity_factor: float | None
    where: str


def _forward(plan: _Plan, module: nn.Module, x: Any, num_tokens_per_expert: Any) -> Any:
    """The planned module's forward: checks, then the exchange in a shard_map."""
    counts = num_tokens_per_expert
    if not isinstance(x, torch.Tensor) or not isinstance(counts, torch.Tensor):
        raise ShardingTypeError(
            f"ExpertParallel: {plan.where} takes (tokens [N, D], num_tokens_per_expert "
            f"[E] or [G, E]) tensors. Got {type(x).__name__} and {type(counts).__name__}.")
    if counts.ndim not in (1, 2) or counts.shape[-1] != plan.experts:
        raise ShardingError(
            f"ExpertParallel: num_tokens_per_expert has shape {list(counts.shape)} but "
            f"{plan.where} has {plan.experts} experts: the router and the experts disagree on "
            f"the number of experts. Build both with num_experts={plan.experts} (counts "
            f"[{plan.experts}], or [G, {plan.experts}] for G groups of rows).")
    rows = x.shape[0] if x.ndim == 2 else -1
    groups = counts.shape[0] if counts.ndim == 2 else 1
    if rows < 0 or rows % groups:
        raise ShardingError(
            f"ExpertParallel: {plan.where} takes tokens [N, D] in {groups} group(s) of "
            f"N / {groups} rows (num_tokens_per_expert {list(counts.shape)}). Got tokens "
            f"of shape {list(x.shape)}; flatten them to [N, D] with N a multiple of "
            f"{groups}.")
    ep = plan.mesh.axis_size(plan.axis)
    params = [module._parameters[n] for n in plan.names]
    spread = (plan.axis, None)
    if plan.capacity_factor is None:
        body = functools.partial(_dropless, plan, module, rows)
        counts_spec: Any = None  # every device reads every group's counts
    else:
        if groups % ep:
            raise ShardingError(
                f"ExpertParallel(capacity_factor={plan.capacity_factor:g}) on {plan.where}: "
                f"the {groups} group(s) of tokens do not divide over the {ep} devices of "
                f"{plan.axis!r}, so a device's slots would depend on another's counts. Pass "
                f"num_tokens_per_expert as [G, {plan.experts}] with G a multiple of {ep} "
                "(e.g. one group per sequence), or leave capacity_factor unset (dropless).")
        capacity = capacity_of(plan.capacity_factor, rows // groups, plan.experts)
        body = functools.partial(_capacity, plan, module, rows // groups, capacity)
        counts_spec = spread  # each device routes its own groups
    run = shard_map(body, plan.mesh, in_specs=(spread, counts_spec, *[(plan.axis,)] * len(params)),
                    out_specs=spread, out_shapes=tuple(x.shape))
    return run(x, counts.reshape(groups, plan.experts), *params)


def _dropless_forward(plan: _Plan, module: nn.Module, x: Any, num_tokens_per_expert: Any
                      ) -> Any:
    """The dropless forward (its name is the cause of its graph break under compile)."""
    return _forward(plan, module, x, num_tokens_per_expert)


graph_breaks.explain(
    "_dropless_forward", "dropless ExpertParallel reads the token counts on the host to "
    "size its exchanges, so it runs eagerly; ExpertParallel(capacity_factor=...) (fixed "
    "slots, static exchanges) compiles")


def _local(plan: _Plan, module: nn.Module, blocks: Sequence[torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` whose own parameters are this device's blocks (one
    per device thread on the simulated runtime: the module itself is never changed)."""
    local = copy.copy(module)
    local.__dict__["_parameters"] = {**module._parameters, **dict(zip(plan.names, blocks))}
    return local


def _dropless(plan: _Plan, module: nn.Module, rows: int, x: torch.Tensor,
              counts: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
    """One device: its rows to their experts' devices (variable splits) and back."""
    ep, me = lax.axis_size(plan.axis), lax.axis_index(plan.axis)
    route = dropless_route(host_counts(counts, rows, plan.experts), rows, ep, me)
    sent = x if route.send is None else x.index_select(0, route.send.to(x.device))
    got = lax.ragged_all_to_all(sent, plan.axis, route.sizes)
    arrange = None if route.arrange is None else route.arrange.to(x.device)
    mine = got if arrange is None else got.index_select(0, arrange)
    local_counts = torch.tensor(route.counts, dtype=counts.dtype, device=counts.device)
    out = plan.forward(_local(plan, module, blocks), mine, local_counts)
    if arrange is not None:
        out = out.index_select(0, torch.argsort(arrange))
    back = lax.ragged_all_to_all(out, plan.axis, tuple(zip(*route.sizes)))
    if route.send is None:
        return back
    return back.index_select(0, torch.argsort(route.send.to(x.device)))


def _capacity(plan: _Plan, module: nn.Module, per_group: int, capacity: int,
              x: torch.Tensor, counts: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
    """One device: its groups' rows into fixed slots ``[groups, E, C]``, each device's
    experts' slots to it and back, in exchanges of one fixed size: no host read of
    ``counts``."""
    ep = lax.axis_size(plan.axis)
    groups, experts, dim = counts.shape[0], plan.experts, x.shape[1]
    local, width = experts // ep, groups * capacity
    slot = capacity_slots(counts, per_group, capacity)
    slots = x.new_zeros(groups * experts * capacity + 1, dim).index_copy(0, slot, x)[:-1]
    sent = slots.view(groups, experts, capacity, dim).transpose(0, 1).reshape(-1, dim)
    even = ((local * width,) * ep,) * ep  # every device's slots for every device's experts
    got = lax.ragged_all_to_all(sent, plan.axis, even)  # [ep, local, groups, C] rows
    mine = got.view(ep, local, width, dim).transpose(0, 1).reshape(-1, dim)  # expert-major
    if torch.compiler.is_compiling():
        # one call per expert with a one-count tensor: a constant a traced graph can read
        # on the host (the module's forward may split rows by the counts)
        rows = ep * width
        out = torch.cat([plan.forward(
            _local(plan, module, [b[e:e + 1] for b in blocks]), mine[e * rows:(e + 1) * rows],
            torch.tensor([rows], dtype=counts.dtype, device=counts.device))
            for e in range(local)])
    else:
        local_counts = torch.full((local,), ep * width, dtype=counts.dtype,
                                  device=counts.device)
        out = plan.forward(_local(plan, module, blocks), mine, local_counts)
    out = out.view(local, ep, width, dim).transpose(0, 1).reshape(-1, dim)
    back = lax.ragged_all_to_all(out, plan.axis, even)  # [E, groups, C] rows
    back = back.view(experts, groups, capacity, dim).transpose(0, 1).reshape(-1, dim)
    return torch.cat([back, back.new_zeros(1, dim)]).index_select(0, slot)
