"""Train examples/gpt.py's GPT sharded by hand (Megatron-style over tp, batch over dp),
save mid-run, resume on another mesh: shared by the simulated and Gloo tests."""

from __future__ import annotations

from typing import Any

import torch

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded

# module path suffix -> placement of the weight's dims over tp (Megatron: column then row)
_TP = {"attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
       "mlp.w1.weight": 0, "mlp.w1.bias": 0, "mlp.w2.weight": 1, "head.weight": 0}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Every parameter a shardwise Tensor on ``mesh`` (dp, tp): Megatron tp, replicas on dp."""
    for name, p in list(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        dim = next((d for k, d in _TP.items() if name.endswith(k)), None)
        tp = Replicated() if dim is None else Sharded(dim)
        sharded = sw.tensor(p.detach(), sharding=PlacementMapping(mesh, [Replicated(), tp]))
        setattr(owner, name.rpartition(".")[2], torch.nn.Parameter(sharded))
    return model


def build(mesh: DeviceMesh, seed: int = 0) -> tuple[Any, torch.optim.Optimizer, Any]:
    gpt = example_gpt()
    torch.manual_seed(seed)
    config = gpt.Config(seq=8, layers=1)  # small: the test is about state, not size
    model = parallelize(gpt.GPT(config), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, config


def step(model: Any, opt: torch.optim.Optimizer, config: Any, mesh: DeviceMesh, i: int
         ) -> float:
    ids, targets = example_gpt().batch(config, 8, i)
    on_dp = PlacementMapping(mesh, [Sharded(0), Replicated()])
    loss = model(sw.tensor(ids, sharding=on_dp), sw.tensor(targets, sharding=on_dp))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def run(mesh: DeviceMesh, steps: range, model: Any = None, opt: Any = None,
        config: Any = None) -> list[float]:
    if model is None:
        model, opt, config = build(mesh)
    return [step(model, opt, config, mesh, i) for i in steps]
