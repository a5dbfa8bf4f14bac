"""A parallel plan as one value: the degrees (pp x dp x tp), FSDP over dp, the
tensor-parallel style of each module, activation recompute and the pipeline schedule;
and how to apply it with the objects ``parallelize_module``, ``fully_shard`` and
``pipeline`` take.

Invariants:
- A :class:`ParallelPlan` is a frozen value; applying it never reads data, so the same
  plan applies to a real model, a meta one, or the fake one ``auto_plan`` estimates.
- Its mesh has the axes of degree above 1, in the order ``pp``, ``dp``, ``tp`` (``dp``
  always): collectives over an axis of one device would be counted for nothing.
- ``tp_plan()`` is a ``parallelize_module`` plan (module patterns to DTensor-named
  styles); ``fully_shard`` wraps each block, then the root, over ``dp``; recompute
  wraps each block in torch's non-reentrant checkpoint.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardwise import pipelining
from shardwise.parallel import (
    ColwiseParallel,
    MixedPrecisionPolicy,
    ParallelStyle,
    RowwiseParallel,
    fully_shard,
    parallelize_module,
)
from shardwise.pipelining import PipelineSchedule, pipeline
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Sharded

__all__ = ["STYLE_NAMES", "ParallelPlan", "Recompute", "style_of"]

#: the tensor-parallel styles a plan names, as the objects ``parallelize_module`` takes
STYLE_NAMES = ("colwise", "rowwise", "colwise_sharded")


def style_of(name: str) -> ParallelStyle:
    """The style object of a style name (``colwise_sharded``: a column-parallel head
    whose class-sharded logits ``loss_parallel`` reads).

    >>> style_of("rowwise")
    RowwiseParallel()
    """
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_sharded":
        return ColwiseParallel(output_layouts=Sharded(-1))
    raise ValueError(f"Cannot name a tensor-parallel style. Got {name!r}; use one of "
                     f"{STYLE_NAMES}.")


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (torch's non-reentrant
    ``checkpoint``): it keeps only its input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees ``pp`` x ``dp`` x ``tp``; ``fsdp``: parameters sharded over ``dp``;
    ``styles``: (module pattern, style name) pairs; ``recompute``; the pipeline's
    ``schedule`` and ``microbatches``; ``param_dtype``: FSDP's mixed precision.

    >>> plan = ParallelPlan(dp=2, tp=2, fsdp=True, styles=(("layers.*.mlp.w1", "colwise"),
    ...                                                     ("layers.*.mlp.w2", "rowwise")))
    >>> plan.mesh(), str(plan)
    (DeviceMesh(dp=2, tp=2), 'dp2(fsdp) x tp2 [w1 colwise, w2 rowwise]')
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    styles: tuple[tuple[str, str], ...] = ()
    recompute: bool = False
    schedule: str = "1F1B"
    microbatches: int = 1
    param_dtype: Any = None
    devices: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def mesh(self) -> DeviceMesh:
        """The plan's mesh: axes ``pp``, ``dp``, ``tp`` of degree above 1 (``dp``
        always), on CPU devices 0..size-1 (or ``devices``)."""
        shape, names = [], []
        for name, n in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)):
            if n > 1 or name == "dp":
                shape.append(n)
                names.append(name)
        if self.devices:
            return DeviceMesh(self.devices, tuple(shape), tuple(names))
        return _cpu_mesh(tuple(shape), tuple(names))

    def tp_plan(self) -> dict[str, ParallelStyle]:
        """The ``parallelize_module`` plan of :attr:`styles`."""
        return {pattern: style_of(name) for pattern, name in self.styles}

    def split_points(self, layers: int) -> list[str]:
        """Where stages begin: the blocks cut as evenly as they go."""
        return [f"layers.{round(s * layers / self.pp)}" for s in range(1, self.pp)]

    def apply(self, model: nn.Module, loss_fn: Any = None) -> Any:
        """Lay ``model`` out by this plan (changing it, as ``parallelize_module`` does):
        the model, or with ``pp`` > 1 the ``PipelineSchedule`` over its stages (its
        ``loss_fn`` the loss of the logits). Returns what a training step calls."""
        mesh = self.mesh()
        if self.pp == 1:
            self._lay_out(model, mesh)
            return model
        layers = len(model.layers)  # type: ignore[arg-type]
        pipe = pipeline(model, mesh, split_points=self.split_points(layers))
        for st in pipe.local_stages:  # (every stage on the simulated mesh)
            self._lay_out(st.module, st.mesh)
        schedule: type[PipelineSchedule] = getattr(pipelining, f"Schedule{self.schedule}")
        return schedule(pipe, n_microbatches=self.microbatches, loss_fn=loss_fn)

    def _lay_out(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if self.tp > 1:
            held = [n for n, m in module.named_modules() if n and not isinstance(m, nn.Identity)]
            plan = {k: v for k, v in self.tp_plan().items()
                    if any(fnmatch.fnmatchcase(n, k) for n in held)}
            parallelize_module(module, mesh, plan, axis="tp")
        blocks = getattr(module, "layers", None)
        if self.recompute and blocks is not None:
            for i, block in enumerate(blocks):
                if not isinstance(block, nn.Identity):
                    blocks[i] = Recompute(block)
        if self.fsdp and self.dp > 1:
            policy = MixedPrecisionPolicy(param_dtype=self.param_dtype)
            for block in blocks or []:
                if not isinstance(block, nn.Identity):
                    fully_shard(block, mesh, axis="dp", mp_policy=policy)
            fully_shard(module, mesh, axis="dp", mp_policy=policy)

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pp{self.pp}({self.schedule}, m={self.microbatches})")
        if self.dp > 1 or self.size == 1:
            parts.append(f"dp{self.dp}" + ("(fsdp)" if self.fsdp and self.dp > 1 else ""))
        if self.tp > 1:
            styles = ", ".join(f"{p.rsplit('.', 1)[-1]} {s}" for p, s in self.styles)
            parts.append(f"tp{self.tp}" + (f" [{styles}]" if styles else ""))
        text = " x ".join(parts)
        return text + (", recompute" if self.recompute else "")


@functools.lru_cache(maxsize=256)
def _cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # one object per mesh: the search's caches (keyed by layouts) then compare meshes by
    # identity, not by their thousands of devices
    return DeviceMesh.cpu(shape, names)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
