"""TP x FSDP: parallelize_module over tp, then fully_shard over dp per block and on the
root (2-D parallelism), on the GPT of examples/gpt.py: 10 AdamW steps equal single-device
torch and each device holds at most 60% of the parameters and optimizer state."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.parallel import memory_per_device
from tests.helpers import gpt_plans


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> object:
    """Tiny blocks on a loaded 2-core machine: torch's thread pool only adds waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = {id(p): p for p in model.parameters()}
    for state in opt.state.values():
        tensors.update({id(v): v for v in state.values() if isinstance(v, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("plan", ["megatron", "sequence"])
@pytest.mark.parametrize("shape", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_tp_x_fsdp_gpt_matches_torch(plan: str, shape: tuple[int, int]) -> None:
    mesh = gpt_plans.mesh_of(*shape)
    run = gpt_plans.train(mesh, getattr(gpt_plans, f"{plan}_plan")(), fsdp=True)
    gpt_plans.assert_parity(run)
    model = run["model"]
    w1 = model.get_parameter("layers.0.mlp.w1.weight")
    assert w1.dist_layout.dims[0] == (1, 0)  # rows split over tp, then over dp within
    head = model.get_parameter("head.weight")
    assert set(head.dist_layout.dims[0]) == {0, 1}
    # what one device holds of the parameters and AdamW state, against one device
    # holding all of it (single-device torch)
    whole = _bytes(run["ref"], torch.optim.AdamW(run["ref"].parameters()))
    whole += sum(v.numel() * v.element_size() for s in run["opt"].state.values()
                 for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    per_device = memory_per_device(model, run["opt"])
    assert max(per_device) <= 0.6 * whole, (per_device, whole)


@pytest.mark.parametrize("fsdp", [False, True], ids=["tp", "tp_x_fsdp"])
def test_meta_device_init_matches_torch(fsdp: bool) -> None:
    """Built on the meta device, planned, made real with to_empty, initialized by the
    modules' own reset_parameters: the same weights and training as torch's."""
    run = gpt_plans.train(gpt_plans.mesh_of(2, 2), gpt_plans.megatron_plan(), steps=3, fsdp=fsdp,
                          meta=True)
    for name, p in run["model"].named_parameters():  # no block left on meta
        blocks = p.shards if isinstance(p, sw.Tensor) else [p]
        assert all(b.device.type == "cpu" for b in blocks), name
    gpt_plans.assert_parity(run)


def test_clip_grad_norm_is_one_all_reduce_per_mesh_axis_group() -> None:
    """clip_grad_norm_ on TP x FSDP: torch's foreach path, one all_reduce per distinct
    group of mesh axes sharding the gradients (dp alone; dp and tp), not one per
    parameter; the norm and the clipped gradients equal single-device torch's."""
    run = gpt_plans.train(gpt_plans.mesh_of(2, 2), gpt_plans.megatron_plan(), steps=1, fsdp=True)
    model, ref = run["model"], run["ref"]
    grads = [p.grad for p in model.parameters()]
    groups = {frozenset(g.dist_layout.sharded_axes) for g in grads}
    assert len(grads) > 20 and groups == {frozenset({0}), frozenset({0, 1})}, groups
    per_tensor = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
    with sw.debug.CommCounter() as cc:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    assert dict(cc.counts) == {"all_reduce": len(groups)}, cc
    assert cc.backward_total == 0
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert total.dist_layout.spec_entries() == ()  # a Replicated scalar
    assert float(total) == float(per_tensor)  # the same sums, reduced together
    assert float(total) == pytest.approx(float(want), rel=1e-6)
    params = dict(model.named_parameters())
    for name, q in ref.named_parameters():
        torch.testing.assert_close(params[name].grad.to_torch(), q.grad, rtol=1e-5,
                                   atol=1e-8)
