"""A pipeline stage holding context-parallel attention (pp=2 x cp=2), and the natural
order: a model parallelized on the whole mesh before ``pipeline()`` trains as one
parallelized stage by stage after it; both against single-device torch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded, ShardingError
from shardwise.debug import CommCounter
from shardwise.parallel import context_parallel, fully_shard, parallelize_module
from shardwise.pipelining import Schedule1F1B, pipeline
from tests.helpers import pp_models as pm


class Net(nn.Module):
    """Features in, causal attention blocks, features out: its forward chains its
    children, so ``pipeline`` can cut it."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        c = pm.gpt.Config(dim=16, heads=2, layers=layers)
        self.embed = nn.Linear(6, c.dim)
        self.layers = nn.ModuleList(pm.gpt.Block(c) for _ in range(layers))
        self.head = nn.Linear(c.dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_stage_holds_context_parallel_attention(method: str) -> None:
    torch.manual_seed(0)
    ref = Net()
    mesh = DeviceMesh.cpu((2, 2), ("pp", "cp"))
    pipe = pipeline(copy.deepcopy(ref), mesh, split_points=["layers.1"])
    cp = context_parallel(mesh, "cp", method=method)
    for stage in pipe.local_stages:   # each stage's attention is a region over its cp
        parallelize_module(stage.module, stage.mesh, {"layers.*.attn": cp}, axis="cp")
    m, loss_fn = 2, nn.MSELoss()
    sched = Schedule1F1B(pipe, n_microbatches=m, loss_fn=loss_fn)
    x, t = torch.randn(4, 10, 6), torch.randn(4, 10, 3)   # 10 tokens: uneven over 2*cp
    first, last = (PlacementMapping(s.mesh, [Replicated()]) for s in (pipe.stages[0],
                                                                      pipe.stages[-1]))
    losses: list[Any] = []
    with CommCounter() as cc:
        sched.step(cp.shard(x, 1, first), target=cp.shard(t, 1, last), losses=losses)
    want, _ = pm.reference(ref, x, t, m, loss_fn)
    for got, w in zip(losses, want, strict=True):
        assert abs(float(pm.values(got)) - w) <= 1e-5 * abs(w)
    pm.assert_grads(list(pipe.named_parameters()), ref)
    kind = "ppermute" if method == "ring" else "all_to_all"
    per_call = 1 if method == "ring" else 4
    assert cc.counts[kind] == 2 * m * per_call   # 2 attentions, m microbatches
    assert "all_gather" not in cc.counts


def _tp_pipe(model: nn.Module, mesh: DeviceMesh, first: bool) -> Any:
    if first:   # the natural order: the whole model, then the pipeline
        parallelize_module(model, mesh, pm.TP_PLAN, axis="tp")
        return pipeline(model, mesh, split_points=["layers.1"])
    pipe = pipeline(model, mesh, split_points=["layers.1"])
    for stage in pipe.local_stages:
        parallelize_module(stage.module, stage.mesh, pm.plan_for(stage.module), axis="tp")
    return pipe


def test_parallelize_before_or_after_pipeline() -> None:
    ref = pm.make(2)
    mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    x, t = pm.batch(pm.config(2), 4)
    want, _ = pm.reference(ref, x, t, 2)
    for first in (True, False):
        pipe = _tp_pipe(copy.deepcopy(pm.make(2)), mesh, first)
        for stage in pipe.stages:   # every planned value on its stage's slice, TP kept
            for p in stage.module.parameters():
                assert not isinstance(p, sw.Tensor) or p.mesh == stage.mesh
        w1 = pipe.stages[1].module.layers[0].mlp.w1.weight
        assert w1.placements == (Sharded(0),)
        losses: list[Any] = []
        Schedule1F1B(pipe, n_microbatches=2, loss_fn=pm.loss_fn).step(x, target=t,
                                                                      losses=losses)
        for got, w in zip(losses, want, strict=True):
            assert abs(float(pm.values(got)) - w) <= 1e-5 * abs(w), first
        pm.assert_grads(list(pipe.named_parameters()), ref)


def test_whole_mesh_fsdp_before_pipeline_names_local_stages() -> None:
    model = pm.make(2)
    mesh = DeviceMesh.cpu((2, 2), ("pp", "dp"))
    fully_shard(model, mesh, axis="dp")
    with pytest.raises(ShardingError, match=r"fully_shard.*pipe.local_stages"):
        pipeline(model, mesh, split_points=["layers.1"])
    split = pm.make(2)
    w = split.layers[0].mlp.w1
    w.weight = nn.Parameter(sw.tensor(w.weight.detach(), sharding=PlacementMapping(
        mesh, [Sharded(0), Replicated()])))
    with pytest.raises(ShardingError, match=r"split over the pipeline axis.*local_stages"):
        pipeline(split, mesh, split_points=["layers.1"])


def test_stage_planned_on_another_slice_names_local_stages() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    model = pm.make(2)
    # layers.1 belongs to stage 1, planned here on stage 0's slice
    parallelize_module(model.layers[1], mesh.submesh(pp=0),
                       {"mlp.w1": pm.TP_PLAN["layers.*.mlp.w1"]}, axis="tp")
    with pytest.raises(ShardingError, match=r"neither the pipeline's mesh.*local_stages"):
        pipeline(model, mesh, split_points=["layers.1"])
