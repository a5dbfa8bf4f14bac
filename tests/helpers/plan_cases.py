"""The GPT under every plan style the estimate must get exactly right, built the same
way for ``shardwise.estimate`` (fake) and for a real step on the simulated mesh (its
``CommCounter`` and ``MemoryTracker`` the oracles).

Invariants:
- One case, one recipe: ``build(style)`` returns a fresh model, optimizer, step function,
  the inputs as types (for the estimate) and a maker of real inputs (fresh per step: a
  real training loop never feeds one input Tensor twice, and the operand cache would
  keep its relayouts).
- Small: examples/gpt.py's GPT at dim 32, so a real step costs a few hundred ms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, DistributedTensorType, PlacementMapping, Replicated, Sharded
from shardwise.parallel import MixedPrecisionPolicy, fully_shard, loss_parallel, parallelize_module
from tests.helpers.gpt_plans import megatron_plan, sequence_plan

STYLES = ("replicate", "megatron", "sequence", "fsdp", "tp_fsdp", "fsdp_bf16", "recompute",
          "uneven")


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (torch's checkpoint)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: Any, targets: Any) -> Any:
    """One step: loss (loss-parallel where the head is class-sharded), backward, AdamW."""
    with loss_parallel():
        loss = model(ids, targets)
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def build(style: str, batch: int = 8) -> dict[str, Any]:
    """Model, optimizer, mesh, the inputs' types and ``real()`` (fresh real inputs)."""
    gpt = example_gpt()
    c = gpt.Config(vocab=63 if style == "uneven" else 64)
    flat = style in ("fsdp", "fsdp_bf16")
    mesh = DeviceMesh.cpu(4, "dp") if flat else DeviceMesh.cpu((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = gpt.GPT(c)
    plans: dict[str, Callable[[], dict[str, Any]]] = {
        "replicate": dict, "megatron": megatron_plan, "sequence": sequence_plan,
        "tp_fsdp": megatron_plan, "recompute": megatron_plan, "uneven": megatron_plan}
    if style in plans:
        model = parallelize_module(model, mesh, plans[style]())
    if style == "recompute":
        for i, layer in enumerate(model.layers):
            model.layers[i] = Recompute(layer)
    if style in ("fsdp", "tp_fsdp", "fsdp_bf16", "recompute"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if style == "fsdp_bf16" \
            else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, mesh, axis="dp", mp_policy=policy)
        fully_shard(model, mesh, axis="dp", mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    placements = [Sharded(0)] + [Replicated()] * (mesh.ndim - 1)
    ids = DistributedTensorType(torch.int64, (batch, c.seq), mesh, placements)
    on_dp = PlacementMapping(mesh, placements)

    def real(step: int = 0) -> tuple[Any, Any]:
        idx, tgt = gpt.batch(c, batch, step)
        return sw.tensor(idx, sharding=on_dp), sw.tensor(tgt, sharding=on_dp)

    return {"model": model, "opt": opt, "mesh": mesh, "types": (ids, ids), "real": real}


def state_bytes(tensors: list[torch.Tensor], device: int) -> int:
    """Bytes of ``tensors``' blocks on mesh device ``device`` (a plain tensor: whole)."""
    total = 0
    for t in tensors:
        if isinstance(t, sw.Tensor):
            n = 1
            for size in t.local_shapes[device]:
                n *= size
            total += n * t.dtype.itemsize
        else:
            total += t.numel() * t.element_size()
    return total


def grad_bytes(model: nn.Module, device: int) -> int:
    """Bytes of ``model``'s gradients that mesh device ``device`` holds."""
    return state_bytes([p.grad for p in model.parameters() if p.grad is not None], device)


__all__ = ["STYLES", "DeviceMesh", "build", "grad_bytes", "state_bytes", "train_step"]
