"""The executor and torch's schedule classes on the simulated mesh: every schedule's
per-microbatch losses, output and gradients equal single-device torch's (1e-5 relative)
for m in {1, p, 2p, 4p}, pp=2 and pp=4 (interleaved: two stages per rank); user tables
(CSV round trip), forward only, and the errors that name the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Sharded, ShardingError
from shardwise.parallel import parallelize_module
from shardwise.pipelining import (
    Schedule1F1B,
    ScheduleFromTable,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SimTransport,
    parse_table,
    pipeline,
)
from shardwise.pipelining.executor import split_microbatches
from tests.helpers import pp_models as pm

SCHEDULES: dict[str, tuple[Any, int, str]] = {  # class, stages per rank, placement
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2, "v"),
}
WIDTH = 8


def mlp(n_stages: int, seed: int = 0) -> nn.Sequential:
    """Two layers per stage (Linear, Tanh): split points every 2 children."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(n_stages):
        mods += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*mods)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def check_step(pipe: Any, sched: Any, ref: nn.Module, x: torch.Tensor, t: torch.Tensor,
               m: int, loss: Any) -> None:
    x0, t0 = x.clone(), t.clone()
    losses: list[Any] = []
    out = sched.step(x, target=t, losses=losses)
    assert torch.equal(x, x0) and torch.equal(t, t0)  # inputs never mutated
    want_losses, want_out = pm.reference(ref, x, t, m, loss)
    assert len(losses) == m
    for i, (a, b) in enumerate(zip(losses, want_losses, strict=True)):
        assert abs(float(pm.values(a)) - b) <= 1e-5 * abs(b), f"microbatch {i}: {a} vs {b}"
    pm.assert_close(out, want_out, "output")
    pm.assert_grads(list(pipe.named_parameters()), ref)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
def test_schedule_equals_torch(name: str, p: int) -> None:
    cls, v, style = SCHEDULES[name]
    n = p * v
    for m in (1, p, 2 * p, 4 * p):
        ref = mlp(n)
        pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu(p, "pp"),
                        split_points=[str(2 * k) for k in range(1, n)],
                        stages_per_rank=v, style=style)
        sched = cls(pipe, n_microbatches=m, loss_fn=mse)
        g = torch.Generator().manual_seed(m)
        x, t = torch.randn(m + 1, WIDTH, generator=g), torch.randn(m + 1, WIDTH, generator=g)
        check_step(pipe, sched, ref, x, t, m, mse)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pp_x_tp_gpt(name: str) -> None:
    """pp=2 x tp=2: TP-parallelized GPT stages, activations crossing as shardwise Tensors."""
    cls, v, style = SCHEDULES[name]
    layers = 2 * v  # one block per stage, and the embedding / head beside the first / last
    ref = pm.make(layers)
    splits = [f"layers.{k}" for k in range(1, 2 * v)]
    pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu((2, 2), ("pp", "tp")),
                    split_points=splits, stages_per_rank=v, style=style)
    for st in pipe.stages:
        parallelize_module(st.module, st.mesh, pm.plan_for(st.module))
    m = 4
    x, t = pm.batch(pm.config(layers), m)
    check_step(pipe, cls(pipe, n_microbatches=m, loss_fn=pm.loss_fn), ref, x, t, m,
               pm.loss_fn)


def test_activation_keeps_its_layout_across_stages() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    a, b = mesh.submesh(pp=0), mesh.submesh(pp=1)
    x = sw.tensor(torch.arange(8.0).reshape(4, 2), sharding=PlacementMapping(a, [Sharded(1)]))
    y = x * 2
    tr = SimTransport([a, b])
    tr.send({"h": y, "n": 3, "none": None}, 0, 1, "F0")
    got = tr.recv(0, 1, "F0")
    assert got["n"] == 3 and got["none"] is None
    h = got["h"]
    assert h.mesh == b and h.placements == (Sharded(1),)
    assert h.is_leaf and not h.requires_grad
    assert torch.equal(h.to_torch(), y.to_torch())
    with pytest.raises(ShardingError, match="never sent"):
        tr.recv(0, 1, "F0")


def test_user_table_and_csv_round_trip() -> None:
    ref = mlp(2)
    pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu(2, "pp"), split_points=["2"])
    rows = [["0F0", "0F1", "", "", "0B1", "0B0"], ["", "1F0", "1F1", "1B1", "1B0"]]
    sched = ScheduleFromTable(pipe, rows, n_microbatches=2, loss_fn=mse)
    assert sched.actions == parse_table(rows)
    again = ScheduleFromTable(pipe, sched.to_csv(), n_microbatches=2, loss_fn=mse)
    assert again.actions == sched.actions
    text = str(sched)
    assert "rank 0: 0F0" in text and "1B0" in text
    x, t = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    check_step(pipe, again, ref, x, t, 2, mse)


def test_lowered_table_runs() -> None:
    """SEND/RECV and UNSHARD/RESHARD actions of a lowered table are implied, skipped."""
    from shardwise.pipelining import compute_table, lower

    ref = mlp(2)
    pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu(2, "pp"), split_points=["2"])
    table = lower(compute_table("1F1B", 2, 2, 3), fsdp=True)
    sched = ScheduleFromTable(pipe, table, n_microbatches=3, loss_fn=mse)
    x, t = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    check_step(pipe, sched, ref, x, t, 3, mse)


def test_forward_only_and_shardwise_inputs() -> None:
    ref = mlp(2)
    mesh = DeviceMesh.cpu((2, 2), ("pp", "dp"))
    pipe = pipeline(copy.deepcopy(ref), mesh, split_points=["2"])
    sched = Schedule1F1B(pipe, n_microbatches=3)
    x = torch.randn(6, WIDTH)
    xs = sw.tensor(x, sharding=PlacementMapping(pipe.stages[0].mesh, [Sharded(0)]))
    out = sched.step(xs)
    assert isinstance(out, sw.Tensor) and out.mesh == pipe.stages[1].mesh
    pm.assert_close(out, ref(x).detach(), "forward-only output")
    assert all(p.grad is None for p in pipe.parameters())


def test_microbatches_of_a_batch_split_over_dp_stay_split() -> None:
    """Each dp rank computes its rows of every microbatch (torchtitan's split), not the
    whole microbatch: the parts keep the batch's layout, their values torch's split."""
    mesh = DeviceMesh.cpu((2, 2), ("pp", "dp")).submesh(pp=0)
    x = torch.randn(7, WIDTH)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
    parts = split_microbatches((xs, 2.0), 3, "the inputs")
    want = torch.tensor_split(x, 3)
    for (part, scale), ref in zip(parts, want, strict=True):
        assert part.placements == (Sharded(0),) and scale == 2.0
        assert torch.equal(part.to_torch(), ref)
    assert xs.placements == (Sharded(0),)  # the caller's batch is untouched

    ref_model = mlp(2)
    pipe = pipeline(copy.deepcopy(ref_model), DeviceMesh.cpu((2, 2), ("pp", "dp")),
                    split_points=["2"])
    assert pipe.stages[0].mesh == mesh
    seen: list[Any] = []
    for st in pipe.stages:
        st.module.register_forward_hook(lambda mod, args, out: seen.append(out.placements))
    out = Schedule1F1B(pipe, n_microbatches=3).step(xs)
    # every stage's rows of every microbatch stayed split over dp
    assert seen == [(Sharded(0),)] * 6
    pm.assert_close(out, ref_model(x).detach(), "pp x dp output")


def test_a_step_without_outputs_keeps_none_and_gathers_nothing() -> None:
    """``return_outputs=False`` (torch's option): the same losses and gradients, None
    back, and no microbatch output kept or concatenated (a batch split over dp would
    be gathered to be concatenated: CommCounter sees only the batch's split)."""
    from shardwise.debug import CommCounter

    mesh = DeviceMesh.cpu((2, 2), ("pp", "dp"))
    x, t = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    on_dp = [Sharded(0)]

    def whole(v: Any) -> torch.Tensor:
        return v.to_torch() if isinstance(v, sw.Tensor) else v
    runs = []
    for keep in (True, False):
        torch.manual_seed(0)
        pipe = pipeline(mlp(2), mesh, split_points=["2"])
        xs = sw.tensor(x, sharding=PlacementMapping(pipe.stages[0].mesh, on_dp))
        ts = sw.tensor(t, sharding=PlacementMapping(pipe.stages[-1].mesh, on_dp))
        losses: list[Any] = []
        with CommCounter() as cc:
            out = Schedule1F1B(pipe, n_microbatches=2, loss_fn=F.mse_loss).step(
                xs, target=ts, losses=losses, return_outputs=keep)
        grads = [whole(p.grad) for p in pipe.parameters()]
        runs.append((out, [float(whole(v)) for v in losses], grads, cc.counts))
    (kept, l1, g1, c1), (none, l2, g2, c2) = runs
    assert kept is not None and none is None and l1 == l2
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    assert c1["all_gather"] > c2["all_gather"] == 2  # the inputs' and targets' split


def test_grads_accumulate_over_steps() -> None:
    """Seeded with 1/m: a second step adds to .grad, never rescales the first."""
    ref = mlp(2)
    pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu(2, "pp"), split_points=["2"])
    sched = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=mse)
    x, t = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    sched.step(x, target=t)
    sched.step(x, target=t)
    pm.reference(ref, x, t, 2, mse)
    pm.reference(ref, x, t, 2, mse)
    pm.assert_grads(list(pipe.named_parameters()), ref)


def test_errors_name_the_fix() -> None:
    pipe = pipeline(mlp(2), DeviceMesh.cpu(2, "pp"), split_points=["2"])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ShardingError, match="n_microbatches"):
            Schedule1F1B(pipe, n_microbatches=bad, loss_fn=mse)
    sched = Schedule1F1B(pipe, n_microbatches=4, loss_fn=mse)
    with pytest.raises(ShardingError, match="at least 4 rows"):
        sched.step(torch.randn(3, WIDTH), target=torch.randn(3, WIDTH))
    with pytest.raises(ShardingError, match="style='v'"):
        ScheduleZBVZeroBubble(pipe, n_microbatches=2, loss_fn=mse)
    with pytest.raises(ShardingError, match="no 1B1"):
        ScheduleFromTable(pipe, [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1"]], 2, mse)
    with pytest.raises(ShardingError, match="places stage 1 on rank 1"):
        ScheduleFromTable(pipe, [["0F0", "1F0", "1B0", "0B0"], []], 1, mse)
    with pytest.raises(ShardingError, match="cannot go on"):  # 0B0 before 1B0 exists
        ScheduleFromTable(pipe, [["0F0", "0B0"], ["1B0", "1F0"]], 1, mse).step(
            torch.randn(2, WIDTH), target=torch.randn(2, WIDTH))
    with pytest.raises(ShardingError, match="materialize"):
        with torch.device("meta"):
            lazy = pipeline(mlp(2), DeviceMesh.cpu(2, "pp"), split_points=["2"])
        ScheduleGPipe(lazy, n_microbatches=1, loss_fn=mse).step(
            torch.randn(1, WIDTH), target=torch.randn(1, WIDTH))



@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_stages_pass_tuples_dicts_and_tensors_without_gradients(name: str) -> None:
    """Stage values other than one tensor: a tuple with an int tensor (no gradient), a
    dict with a value leaf, a tuple of two tensors that both take gradients."""
    cls, v, style = SCHEDULES[name]
    p = 4 // v
    mods = pm.structured_stages(WIDTH)
    ref = copy.deepcopy(mods)
    pipe = pipeline(mods, DeviceMesh.cpu(p, "pp"), stages_per_rank=v, style=style)
    m = 4
    sched = cls(pipe, n_microbatches=m, loss_fn=mse)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2 * m, WIDTH, generator=g), torch.randn(2 * m, WIDTH, generator=g)
    losses: list[Any] = []
    sched.step(x, target=t, losses=losses)
    pm.check_structured(pipe, ref, x, t, m, mse, losses, name)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return torch.tanh(h), h * 2


class _FirstOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, a: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.lin(a)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_an_input_the_backward_gives_no_gradient(name: str) -> None:
    """Stage 1 ignores one of its two inputs (which records gradients): stage 0 still
    gets the other's gradient (sent after the backward, not from the hooks)."""
    torch.manual_seed(0)
    mods = [_Two(), _FirstOnly()]
    ref = copy.deepcopy(mods)
    pipe = pipeline(mods, DeviceMesh.cpu(2, "pp"))
    m = 2
    x, t = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    losses: list[Any] = []
    SCHEDULES[name][0](pipe, n_microbatches=m, loss_fn=mse).step(x, target=t, losses=losses)
    want = [mse(ref[1](*ref[0](xi)), ti)
            for xi, ti in zip(x.tensor_split(m), t.tensor_split(m), strict=True)]
    (sum(want) / m).backward()  # type: ignore[operator]
    for a, b in zip(losses, want, strict=True):
        assert abs(float(pm.values(a)) - float(b.detach())) <= 1e-5 * abs(float(b.detach()))
    for got_mod, want_mod in zip(mods, ref, strict=True):
        for q, r in zip(got_mod.parameters(), want_mod.parameters(), strict=True):
            assert q.grad is not None and r.grad is not None
            pm.assert_close(q.grad, r.grad, "grad")


class _Logged(torch.autograd.Function):
    """Identity whose backward logs that it ran (the weight path of _LateWeight)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, log: list[str]) -> torch.Tensor:
        ctx.log = log
        return w.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.log.append("weight gradient")
        return g, None


class _LateWeight(nn.Module):
    """y = w' + x @ v, with w' made before x's path: autograd runs x's path first (the
    later node), then the weight's, so the input's gradient is final before that."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH))
        self.v = nn.Parameter(torch.eye(WIDTH))
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _Logged.apply(self.w, self.log)
        return w + x @ self.v


def test_a_full_backward_sends_the_input_gradient_once_it_is_computed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    sent = SimTransport.send

    def send(self: Any, value: Any, src: int, dst: int, tag: str) -> None:
        log.append(f"send {tag}")
        sent(self, value, src, dst, tag)
    monkeypatch.setattr(SimTransport, "send", send)
    torch.manual_seed(0)
    mods = [nn.Linear(WIDTH, WIDTH), _LateWeight(log)]
    ref = [copy.deepcopy(mods[0]), _LateWeight([])]
    ref[1].load_state_dict(mods[1].state_dict())
    pipe = pipeline(mods, DeviceMesh.cpu(2, "pp"))
    x, t = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    ScheduleGPipe(pipe, n_microbatches=2, loss_fn=mse).step(x, target=t)
    # stage 1's backward of each microbatch: its input's gradient went out before the
    # weight's path ran
    backward = [e for e in log if not e.startswith("send F")]
    assert backward == ["send B0", "weight gradient", "send B1", "weight gradient"], log
    (sum(mse(ref[1](ref[0](xi)), ti) for xi, ti in zip(x.tensor_split(2), t.tensor_split(2),
                                                       strict=True)) / 2).backward()
    for got_mod, want_mod in zip(mods, ref, strict=True):
        for q, r in zip(got_mod.parameters(), want_mod.parameters(), strict=True):
            assert q.grad is not None and r.grad is not None
            pm.assert_close(q.grad, r.grad, "grad")
