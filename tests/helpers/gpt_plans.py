"""The shared GPT (examples/gpt.py, imported by path), its tensor-parallel plans and a
training loop beside single-device torch: used by the simulated tests and by the
Gloo bodies (tests/helpers/tp_bodies.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    fully_shard,
    loss_parallel,
    parallelize_module,
)


def megatron_plan() -> dict[str, Any]:
    """Megatron-LM: vocab-parallel embedding, column-parallel q/k/v and w1, row-parallel
    wo and w2 (one all_reduce each), column-parallel head kept sharded for the loss."""
    return {
        "tok": RowwiseParallel(),
        "layers.*.attn.w[qkv]": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(),
        "layers.*.mlp.w1": ColwiseParallel(),
        "layers.*.mlp.w2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Sharded(-1)),
    }


def sequence_plan() -> dict[str, Any]:
    """Megatron with sequence parallelism: norms and residuals Sharded(1) over tp; an
    all_gather before attention and MLP, a reduce_scatter after them."""
    seq = Sharded(1)
    gather = PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicated())
    return {
        "tok": RowwiseParallel(output_layouts=seq),
        "layers.*.ln[12]": SequenceParallel(),
        "layers.*.attn": gather,
        "layers.*.attn.w[qkv]": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp": gather,
        "layers.*.mlp.w1": ColwiseParallel(),
        "layers.*.mlp.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Sharded(-1)),
    }


def mesh_of(dp: int, tp: int) -> DeviceMesh:
    return DeviceMesh.cpu((dp, tp), ("dp", "tp"))


def train(mesh: DeviceMesh, plan: dict[str, Any], steps: int = 10, batch: int = 8,
          lr: float = 1e-2, fsdp: bool = False, meta: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps of the planned GPT and of the same GPT on one device, from
    the same initial weights and batches (data Sharded(0) on dp). ``fsdp``: then
    ``fully_shard`` over dp, per block and on the root (TP x FSDP). ``meta``: the
    planned GPT is built on the meta device, planned, made real with ``to_empty`` and
    initialized by its modules' ``reset_parameters`` (torchtitan's deferred init), the
    single-device GPT likewise from the same seed. Returns both models, the losses and
    the first forward's collectives."""
    gpt = example_gpt()
    c = gpt.Config()
    torch.manual_seed(0)
    ref = gpt.GPT(c)
    if meta:
        with torch.device("meta"):
            model = parallelize_module(gpt.GPT(c), mesh, plan)
    else:
        model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh, axis="dp")
        fully_shard(model, mesh, axis="dp")
    if meta:
        model.to_empty(device="cpu")
        for m in (ref, model):
            torch.manual_seed(1)
            for sub in m.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    data = PlacementMapping(mesh, [Sharded(0), Replicated()])
    losses, ref_losses, comm = [], [], None
    for step in range(steps):
        idx, tgt = gpt.batch(c, batch, step)
        with CommCounter() as cc, loss_parallel():
            loss = model(sw.tensor(idx, sharding=data), sw.tensor(tgt, sharding=data))
        comm = comm or cc
        rloss = ref(idx, tgt)
        opt.zero_grad()
        ropt.zero_grad()
        loss.backward()
        rloss.backward()
        opt.step()
        ropt.step()
        losses.append(float(loss.detach()))
        ref_losses.append(float(rloss.detach()))
    return {"model": model, "ref": ref, "losses": losses, "ref_losses": ref_losses,
            "comm": comm, "opt": opt}


def assert_parity(run: dict[str, Any], rtol: float = 1e-4) -> None:
    """Losses and final parameters equal single-device torch's to ``rtol`` relative."""
    for step, (a, b) in enumerate(zip(run["losses"], run["ref_losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs torch {b}"
    params = dict(run["model"].named_parameters())
    for name, q in run["ref"].named_parameters():
        p = params[name]
        got = p.detach().to_torch() if isinstance(p, sw.Tensor) else p.detach()
        want = q.detach()
        err = float((got - want).abs().max())
        assert err <= rtol * float(want.abs().max()), f"{name}: max error {err}"
