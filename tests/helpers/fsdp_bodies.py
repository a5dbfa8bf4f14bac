"""fully_shard bodies shared by both runtimes: ``n`` devices as a simulated mesh or ``n``
Gloo processes (see ``harness.py``). Each rank trains examples/gpt.py's GPT with
AdamW and compares every loss and the final parameters with single-device torch,
which it computes itself from the same seed."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import MixedPrecisionPolicy, fully_shard, memory_per_device
from shardwise.sharding.layout import Layout

R = Replicated()
STEPS = 10  # AdamW steps per body, as on the simulated mesh



def _every(counter: Any) -> list[tuple[str, int, Any]]:
    """(kind, bytes, step) of every collective, forward and backward phases alike."""
    return [(e.kind, e.nbytes, e.step) for e in counter.events]


def hand_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Megatron TP by hand on mesh axis "tp": wq/wk/wv/w1 rows, wo/w2 columns."""
    def put(mod: nn.Module, name: str, *places: Any) -> None:
        p = getattr(mod, name)
        setattr(mod, name, nn.Parameter(sw.tensor(p.detach(),
                                                  sharding=PlacementMapping(mesh, places))))

    for b in model.layers:
        for w in (b.attn.wq, b.attn.wk, b.attn.wv, b.mlp.w1):
            put(w, "weight", R, Sharded(0))
        put(b.mlp.w1, "bias", R, Sharded(0))
        for w in (b.attn.wo, b.mlp.w2):
            put(w, "weight", R, Sharded(1))


LR = 1e-2


def train(mesh: DeviceMesh, *, tp: bool, reshard: bool = True, steps: int = 10,
          check: Any = None, watch: list[Any] | None = None, rtol: float = 1e-4,
          policy: MixedPrecisionPolicy | None = None, batch_spec: Any = None,
          fused: bool = False) -> tuple[nn.Module, Any, list[Any]]:
    """``steps`` AdamW steps of the GPT under fully_shard (per Block, then the root),
    beside single-device torch; asserts losses and final parameters to ``rtol``.
    ``check(step, model, phase, counter)`` is called after forward, backward and step;
    ``watch`` receives the layout of every Block's ``mlp.w1.weight`` during forward.
    With a bf16 ``policy`` the reference computes with bf16 copies of its fp32
    weights (FSDP2's semantics): losses within one bf16 ulp (2**-7 relative),
    parameters within 5 * LR (an AdamW step moves a parameter by about LR at most).
    ``fused``: both optimizers are AdamW(fused=True) (torchtitan's default)."""
    gpt = example_gpt()
    torch.manual_seed(0)
    c = gpt.Config()
    ref = gpt.GPT(c)
    model = copy.deepcopy(ref)
    if tp:
        hand_tp(model, mesh)
    mp = policy or MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh, reshard_after_forward=reshard, mp_policy=mp)
    low = mp.param_dtype
    if watch is not None:
        for block in model.layers:
            block.mlp.w1.register_forward_hook(
                lambda mod, args, out: watch.append(mod.weight.dist_layout))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=fused)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=fused)
    batch = batch_spec or PlacementMapping(mesh, [Sharded(0)] + [R] * (mesh.ndim - 1))
    counters: list[Any] = []
    for step in range(steps):
        ids, targets = gpt.batch(c, 8, step)
        with CommCounter() as fwd:
            loss = model(sw.tensor(ids, sharding=batch), sw.tensor(targets, sharding=batch))
        if check:
            check(step, model, "forward", fwd)
        with CommCounter() as bwd:
            loss.backward()
        if check:
            check(step, model, "backward", bwd)
        opt.step()
        opt.zero_grad()
        if check:
            check(step, model, "step", None)
        rloss = ref(ids, targets) if low is None else torch.func.functional_call(
            ref, {name: p.to(low) for name, p in ref.named_parameters()}, (ids, targets))
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        counters.append((fwd, bwd))
        lv, rv = float(loss.detach()), float(rloss.detach())
        assert abs(lv - rv) <= (rtol if low is None else 2 ** -7 * 1.001) * abs(rv), (
            step, lv, rv)
    for (name, p), (rname, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == rname
        if low is None:
            torch.testing.assert_close(p.to_torch(), q.detach(), rtol=rtol, atol=rtol)
        else:
            assert p.dtype == q.dtype and (p.to_torch() - q).abs().max() <= 5 * LR
    return model, opt, counters


def _fsdp_axis(p: Any, mesh: DeviceMesh) -> bool:
    return mesh.axis_names.index("dp") in p.dist_layout.sharded_axes


def body_fsdp_gpt(n: int) -> None:
    """FSDP alone over all n devices: parity, sharded between steps, collectives."""
    mesh = DeviceMesh.cpu(n, "dp")

    def check(step: int, model: nn.Module, phase: str, counter: Any) -> None:
        for p in model.parameters():
            assert _fsdp_axis(p, mesh), (phase, p)
            if phase == "backward":
                assert p.grad.dist_layout == p.dist_layout

    model, _, counters = train(mesh, tp=False, check=check, steps=STEPS)
    units = 1 + len(model.layers)
    flat = Layout(mesh, ((), (0,)), (None,))  # the units' flat buffers, dim 1 over dp

    def fsdp(counter: Any, kind: str) -> int:
        return sum(1 for k, _, step in _every(counter)
                   if k == kind and flat in (step.before, step.after))

    for fwd, bwd in counters:
        assert fsdp(fwd, "all_gather") == units, fwd.log
        assert fsdp(bwd, "reduce_scatter") == units, bwd.log  # one flat buffer a unit
        assert fsdp(bwd, "all_gather") == units, bwd.log  # re-gathered for backward
        # both run inside loss.backward(): counted in the backward phase on either
        # runtime (on Gloo the reduce_scatters once counted as forward)
        assert bwd.backward_counts["reduce_scatter"] == units, bwd
        assert "reduce_scatter" not in bwd.counts and "all_gather" not in bwd.counts, bwd
        assert "reduce_scatter" not in fwd.counts and fwd.backward_total == 0, fwd


def body_fsdp_tp_gpt(n: int) -> None:
    """FSDP over "dp" x hand TP over "tp" on a (2, n/2) mesh, AdamW(fused=True) (its
    kernel on each process's blocks): parity and memory."""
    mesh = DeviceMesh.cpu((2, n // 2), ("dp", "tp"))
    model, opt, _ = train(mesh, tp=True, reshard=False, steps=STEPS, fused=True)
    total = sum(p.numel() * p.dtype.itemsize for p in model.parameters()) * 3  # + AdamW m, v
    assert max(memory_per_device(model, opt)) <= 0.6 * total
    sd = model.state_dict()
    assert list(sd) == [name for name, _ in model.named_parameters()]
    assert all(isinstance(v, sw.Tensor) and _fsdp_axis(v, mesh) for v in sd.values())


def body_fsdp_bf16_gpt(n: int) -> None:
    """param_dtype=bf16, reduce_dtype=fp32 over processes (whose gradient shares are
    reduce-scattered in fp32): parity with torch on bf16 copies, fp32 gradients."""
    mesh = DeviceMesh.cpu(n, "dp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def check(step: int, model: nn.Module, phase: str, counter: Any) -> None:
        if phase == "backward":  # re-gathered in bf16, reduced in fp32: twice the bytes
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            scattered = counter.backward_bytes["reduce_scatter"]
            assert "reduce_scatter" not in counter.counts, counter  # all in backward
            assert scattered == 2 * counter.backward_bytes["all_gather"] > 0

    train(mesh, tp=False, steps=3, policy=policy, check=check)


def body_fsdp_batch_over_both_axes(n: int) -> None:
    """FSDP over "dp" only while the batch is split over ("dp", "tp"): the gathered
    parameters' gradients are reduce-scattered over dp and all-reduced over tp."""
    mesh = DeviceMesh.cpu((2, n // 2), ("dp", "tp"))
    batch = sw.NamedMapping(mesh, (("dp", "tp"), None))
    train(mesh, tp=False, steps=3, batch_spec=batch)


BODIES = ["body_fsdp_gpt", "body_fsdp_tp_gpt", "body_fsdp_bf16_gpt",
          "body_fsdp_batch_over_both_axes"]
