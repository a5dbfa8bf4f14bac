"""3-D composition on the simulated 2x2x2 mesh (pp, dp, tp): TP and FSDP stages, stock
AdamW, clip_grad_norm_ across stages, and DCP checkpoints that load on another pp
degree, all against single-device torch."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.checkpoint import load, save
from shardwise.parallel import fully_shard, parallelize_module
from shardwise.pipelining import (
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    clip_grad_norm_,
    pipeline,
)
from tests.helpers import pp_models as pm

MESH3 = DeviceMesh.cpu((2, 2, 2), ("pp", "dp", "tp"))


def build(model: torch.nn.Module, mesh: DeviceMesh, splits: list[str], v: int = 1,
          fsdp: bool = True, style: str = "loop") -> Any:
    pipe = pipeline(model, mesh, split_points=splits, stages_per_rank=v, style=style)
    for st in pipe.stages:
        parallelize_module(st.module, st.mesh, pm.plan_for(st.module), axis="tp")
        if fsdp:
            for layer in st.module.layers:
                fully_shard(layer, st.mesh, axis="dp")
            fully_shard(st.module, st.mesh, axis="dp")
    return pipe


def data(pipe: Any, x: torch.Tensor, t: torch.Tensor) -> tuple[sw.Tensor, sw.Tensor]:
    """The batch Sharded(0) over dp on the first stage, the target on the last."""
    def on(mesh: DeviceMesh, v: torch.Tensor) -> sw.Tensor:
        return sw.tensor(v, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
    return on(pipe.stages[0].mesh, x), on(pipe.stages[-1].mesh, t)


@pytest.mark.parametrize("cls,v,style", [(Schedule1F1B, 1, "loop"),
                                         (ScheduleInterleavedZeroBubble, 2, "loop"),
                                         (ScheduleZBVZeroBubble, 2, "v")])
def test_pp_dp_tp_adamw_clip(cls: Any, v: int, style: str) -> None:
    layers = 2 * v
    ref = pm.make(layers)
    pipe = build(copy.deepcopy(ref), MESH3, [f"layers.{k}" for k in range(1, 2 * v)], v,
                 style=style)
    m = 4
    sched = cls(pipe, n_microbatches=m, loss_fn=pm.loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        x, t = pm.batch(pm.config(layers), 8, step)
        losses: list[Any] = []
        xs, ts = data(pipe, x, t)
        sched.step(xs, target=ts, losses=losses)
        want, _ = pm.reference(ref, x, t, m)
        for a, b in zip(losses, want, strict=True):
            assert abs(float(pm.values(a)) - b) <= 1e-5 * abs(b)
        if step == 0:
            pm.assert_grads(list(pipe.named_parameters()), ref)
        norm = clip_grad_norm_(pipe.parameters(), 0.5, pipe=pipe)
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=0)
        if step == 0:
            pm.assert_grads(list(pipe.named_parameters()), ref)  # clipped alike
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    want_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        pm.assert_close(p, want_params[name].detach(), name, rtol=1e-4)


def test_clip_inf_norm_and_plain_params() -> None:
    ref = pm.make(2)
    pipe = build(copy.deepcopy(ref), MESH3, ["layers.1"], fsdp=False)
    x, t = pm.batch(pm.config(2), 4)
    Schedule1F1B(pipe, n_microbatches=2, loss_fn=pm.loss_fn).step(x, target=t)
    pm.reference(ref, x, t, 2)
    norm = clip_grad_norm_(list(pipe.parameters()), 1e-3, norm_type=float("inf"))
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=float("inf"))
    torch.testing.assert_close(norm, rnorm, rtol=1e-6, atol=0)
    pm.assert_grads(list(pipe.named_parameters()), ref)


def _values(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: pm.values(v) for k, v in state.items()}


def test_checkpoint_across_pp_degrees(tmp_path: Path) -> None:
    """pp=2 -> pp=1 and pp=1 -> pp=2, keyed by the original model's names."""
    mesh1 = DeviceMesh.cpu((1, 2, 2), ("pp", "dp", "tp"))
    a = pm.make(2, seed=1)
    two = build(copy.deepcopy(a), MESH3, ["layers.1"])
    assert two.state_dict().keys() == a.state_dict().keys()
    save(two.state_dict(), tmp_path / "pp2")
    one = build(pm.make(2, seed=2), mesh1, [])
    state = one.state_dict()
    load(state, tmp_path / "pp2")
    got = _values(one.state_dict())
    for k, want in a.state_dict().items():
        assert torch.equal(got[k], want), k

    b = pm.make(2, seed=3)
    save(build(copy.deepcopy(b), mesh1, []).state_dict(), tmp_path / "pp1")
    two = build(pm.make(2, seed=4), MESH3, ["layers.1"])
    load(two.state_dict(), tmp_path / "pp1")
    got = _values(two.state_dict())
    for k, want in b.state_dict().items():
        assert torch.equal(got[k], want), k
