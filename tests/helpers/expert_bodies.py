"""Expert parallelism on ``n`` devices: the same bodies run on the simulated mesh and on
``n`` Gloo processes (one launch runs them all, ``test_experts_gloo.py``). Every rank
computes the single-device reference itself (same seeds), so no result travels."""

from __future__ import annotations

import copy
from typing import Any

import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import ExpertParallel, loss_parallel, parallelize_module
from shardwise.parallel.dispatch import capacity_of, dropless_route
from tests.helpers.moe import (
    HostReads,
    MaskedExperts,
    expert_loop,
    experts_module,
    moe_gpt,
    routed,
)

BODIES = ["body_dropless", "body_capacity", "body_moe_gpt_dp2ep_tp"]

DIM, HIDDEN = 8, 12


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _me() -> int:
    """This process's device of a mesh over every process (0 on the simulated mesh:
    CommCounter counts device 0's bytes there)."""
    from shardwise.distributed import process_count, process_index

    return process_index() if process_count() > 1 else 0


def _route_bytes(counts: torch.Tensor, rows: int, ep: int, me: int, row_bytes: int) -> int:
    """What device ``me`` sends to the others: its rows for their experts (dispatch), and
    their rows back (combine)."""
    sizes = dropless_route(counts.reshape(-1, counts.shape[-1]).tolist(), rows, ep, me).sizes
    sent = sum(sizes[me]) - sizes[me][me]
    returned = sum(row[me] for row in sizes) - sizes[me][me]
    return (sent + returned) * row_bytes


def body_dropless(n: int) -> None:
    """ExpertParallel on ep = n, counts [E] and [G, E] (blocks spanning groups, empty
    experts): values and gradients equal the per-expert loop; one all_to_all each way,
    moving what the route says; balanced routing moves T*k*h*(ep-1)/ep per device."""
    mesh = DeviceMesh.cpu(n, "ep")
    experts = 2 * n
    for groups, rows in ((1, 4 * n + 1), (3, 6 * n)):
        x, counts = routed(rows, DIM, experts, groups, seed=groups)
        counts = counts[0] if groups == 1 else counts
        ref = experts_module(experts, DIM, HIDDEN, seed=groups)
        mod = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = expert_loop(ref.w1, ref.w2, ref.w3, xr, counts)
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
        (want * g).sum().backward()
        with CommCounter() as cc:
            got = mod(xs, counts)
            (got * g).sum().backward()
        what = f"dropless, {groups} group(s)"
        _close(got.to_torch(), want, what)
        _close(xs.grad, xr.grad, f"{what}: tokens' gradient")
        for name in ("w1", "w2", "w3"):
            _close(getattr(mod, name).grad.to_torch(), getattr(ref, name).grad,
                   f"{what}: {name}'s gradient")
        assert cc.counts["all_to_all"] == 2, cc.counts  # (and the loss sum's all_reduce)
        me = _me()
        assert cc.bytes["all_to_all"] == _route_bytes(counts, rows, n, me, DIM * 4)
    # balanced: one group per device, each expert R / E of its rows (T tokens x k = R)
    per = 2 * experts
    counts = torch.full((n, experts), per // experts)
    x = torch.randn(n * per, DIM)
    mod = parallelize_module(experts_module(experts, DIM, HIDDEN), mesh, ExpertParallel())
    with CommCounter() as cc:
        mod(x, counts)
    formula = per * DIM * (n - 1) // n * 4  # T*k*h*(ep-1)/ep floats, per direction
    assert cc.bytes["all_to_all"] == 2 * formula, (cc.bytes, formula)


def body_capacity(n: int) -> None:
    """ExpertParallel(capacity_factor): each (group, expert) keeps its first C rows, the
    rest output 0 (the loop with the same capacity); gradients too; no host read of the
    counts (with experts that make none themselves); even exchanges of fixed size."""
    mesh = DeviceMesh.cpu(n, "ep")
    experts, groups, rows = 2 * n, 2 * n, 8 * n
    x, counts = routed(rows, DIM, experts, groups, seed=7)
    for factor in (0.5, 1.5):
        cap = capacity_of(factor, rows // groups, experts)
        ref = experts_module(experts, DIM, HIDDEN, seed=3, cls=MaskedExperts)
        mod = parallelize_module(copy.deepcopy(ref), mesh,
                                 ExpertParallel(capacity_factor=factor))
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = expert_loop(ref.w1, ref.w2, ref.w3, xr, counts, cap)
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(6))
        (want * g).sum().backward()
        with CommCounter() as cc, HostReads() as reads:
            got = mod(xs, counts)
            (got * g).sum().backward()
        what = f"capacity_factor={factor} (C={cap})"
        assert reads.calls == [], f"{what}: host reads {reads.calls}"
        _close(got.to_torch(), want, what)
        _close(xs.grad, xr.grad, f"{what}: tokens' gradient")
        for name in ("w1", "w2", "w3"):
            _close(getattr(mod, name).grad.to_torch(), getattr(ref, name).grad,
                   f"{what}: {name}'s gradient")
        slots = groups // n * experts * cap * DIM * 4
        assert cc.counts["all_to_all"] == 2, cc.counts  # (and the loss sum's all_reduce)
        assert cc.bytes["all_to_all"] == 2 * slots * (n - 1) // n


def train_moe_gpt(mesh: DeviceMesh, steps: int, capacity_factor: float | None = None
                  ) -> dict[str, Any]:
    """examples/moe_gpt.py's model, dp2ep x TP x FSDP on ``mesh`` (dp, tp) beside
    single-device torch: per step (loss, reference loss), and every parameter's gradient
    of step 0 beside torch's."""
    cfg = moe_gpt.Config()
    torch.manual_seed(0)
    ref = moe_gpt.MoEGPT(cfg)
    model = moe_gpt.parallelize(copy.deepcopy(ref), mesh, capacity_factor=capacity_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))
    losses, grads = [], []
    for step in range(steps):
        ids, targets = moe_gpt.gpt.batch(cfg, 8, step)
        with loss_parallel():
            loss = model(sw.tensor(ids, sharding=data), sw.tensor(targets, sharding=data))
            loss.backward()
        want = ref(ids, targets)
        want.backward()
        if step == 0:
            theirs = dict(ref.named_parameters())
            grads = [(name, p.grad.to_torch(), theirs[name].grad)
                     for name, p in model.named_parameters()]
        for o, m in ((opt, model), (ref_opt, ref)):
            o.step()
            o.zero_grad()
            m.update_expert_bias()
        losses.append((loss.item(), want.item()))
    return {"model": model, "losses": losses, "grads": grads}


def body_moe_gpt_dp2ep_tp(n: int) -> None:
    """The MoE GPT on (dp=2, tp=n/2): experts over dp (dp2ep), attention and head over
    tp, dense parts fully sharded over dp; losses and step-0 gradients equal torch's,
    dropless and with fixed capacity that drops nothing."""
    mesh = DeviceMesh.cpu((2, n // 2), ("dp", "tp"))
    for factor in (None, float(moe_gpt.Config().experts)):
        run = train_moe_gpt(mesh, 3, factor)
        for step, (got, want) in enumerate(run["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (factor, step, got, want)
        for name, got, want in run["grads"]:
            _close(got, want, f"capacity_factor={factor}: {name}'s gradient")
        w1 = run["model"].get_parameter("layers.0.moe.experts.w1")
        assert w1.placements == (Sharded(0), Replicated())  # experts over dp, not FSDP'd
