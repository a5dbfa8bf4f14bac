"""fully_shard on the simulated mesh: GPT training parity with single-device torch
(alone and over hand TP, reshard after forward or not, mixed precision), layouts
between and during steps, memory per device, collectives per step, freeing,
uneven and empty shards, state_dict, and bad inputs. The Gloo runs are in
tests/parallel/test_fsdp_gloo.py and share ``tests.helpers.fsdp_bodies``'s helpers."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import MixedPrecisionPolicy, fully_shard, memory_per_device
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout

# the GPT helpers are shared with the Gloo bodies (one way to shard, both runtimes)
from tests.helpers import fsdp_bodies as fb
from tests.helpers.shardcheck import whole_value

R = Replicated()
GPT = example_gpt()


def _every(counter: Any) -> list[tuple[str, int, Any]]:
    """(kind, bytes, step) of every collective, forward and backward phases alike."""
    return [(e.kind, e.nbytes, e.step) for e in counter.events]


@pytest.fixture(autouse=True, scope="module")

def _one_thread() -> Any:
    """Tiny tensors: torch's intra-op threads only add waiting (10-40x slower on a
    loaded 2-core machine), so these tests run on one and restore the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dp(mesh: DeviceMesh) -> int:
    return mesh.axis_names.index("dp")


@pytest.mark.parametrize(("shape", "tp", "reshard"), [
    ((4,), False, True), ((2, 4), False, True), ((2, 2), True, True), ((2, 2), True, False),
    ((2, 4), True, True),
])
def test_gpt_matches_single_device_torch(shape: tuple[int, ...], tp: bool,
                                         reshard: bool) -> None:
    """10 AdamW steps: losses and parameters equal torch's to 1e-4; parameters are
    sharded over dp after forward, backward and step, gathered during forward."""
    mesh = DeviceMesh.cpu(shape, ("dp", "tp")[:len(shape)])
    seen: list[Any] = []

    def check(step: int, model: nn.Module, phase: str, counter: Any) -> None:
        if step == 0 and phase == "forward":
            assert seen and all(_dp(mesh) not in lay.sharded_axes for lay in seen)
        for p in model.parameters():
            assert _dp(mesh) in p.dist_layout.sharded_axes, (phase, p)
            if phase == "backward":
                assert p.grad.dist_layout == p.dist_layout
            if phase == "step":
                assert p.grad is None

    model, opt, _ = fb.train(mesh, tp=tp, reshard=reshard, check=check, watch=seen)
    for p in model.parameters():
        for state in opt.state[p].values():
            if state.ndim:
                assert state.dist_layout == p.dist_layout  # optimizer state is sharded
    if tp:
        wq = model.layers[0].attn.wq.weight
        assert wq.dist_layout.spec_entries() == (("tp", "dp"), None)


def test_tp_fsdp_memory_per_device_is_at_most_60_percent() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model, opt, _ = fb.train(mesh, tp=True, steps=1)
    total = sum(p.numel() * 4 for p in model.parameters()) * 3  # parameters, AdamW m and v
    mem = memory_per_device(model, opt)
    assert len(mem) == 4 and max(mem) <= 0.6 * total, (mem, total)
    assert max(mem) < 0.35 * total  # TP quarters most weights; FSDP halves the rest


def test_memory_per_device_counts_each_devices_blocks() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    lin = nn.Linear(5, 3)  # weight (3, 5): rows 2 + 1 over dp; bias (3,): 2 + 1
    fully_shard(lin, mesh)
    assert memory_per_device(lin) == [4 * (10 + 2)] * 2 + [4 * (5 + 1)] * 2
    opt = torch.optim.AdamW(lin.parameters())
    lin(sw.tensor(torch.ones(2, 5), sharding=PlacementMapping(mesh, [R, R]))).sum().backward()
    opt.step()
    # + exp_avg and exp_avg_sq in the parameters' layouts, + two 0-d step counters
    assert memory_per_device(lin, opt) == [4 * 3 * 12 + 8] * 2 + [4 * 3 * 6 + 8] * 2
    with pytest.raises(ShardingError, match="one mesh"):
        memory_per_device(nn.Linear(2, 2))


@pytest.mark.parametrize("reshard", [True, False])
def test_collectives_per_step(reshard: bool) -> None:
    """One all_gather per unit in forward (all its parameters in one flat buffer, as
    FSDP2), one reduce_scatter per unit in backward, plus one all_gather per unit
    in backward when resharded after forward."""
    mesh = DeviceMesh.cpu(4, "dp")
    model, _, counters = fb.train(mesh, tp=False, reshard=reshard, steps=2)
    units = 1 + len(model.layers)
    flat = Layout(mesh, ((), (0,)), (None,))  # the flat buffers: (1, 4 * L), dim 1 on dp
    elements = sum(p.numel() for p in model.parameters())

    def fsdp(counter: CommCounter, kind: str) -> list[int]:
        return [b for k, b, step in _every(counter)
                if k == kind and flat in (step.before, step.after)]

    for fwd, bwd in counters:
        assert len(fsdp(fwd, "all_gather")) == units, fwd.log
        assert "reduce_scatter" not in fwd.counts
        assert len(fsdp(bwd, "reduce_scatter")) == units, bwd.log
        assert len(fsdp(bwd, "all_gather")) == (units if reshard else 0), bwd.log
        # each device receives the other 3 devices' shards (padded to one length)
        moved = sum(fsdp(fwd, "all_gather"))
        assert elements * 4 * 3 / 4 <= moved <= elements * 4 * 3 / 4 * 1.01


@pytest.mark.parametrize("reshard", [True, False])
def test_gathered_parameters_are_freed_after_forward(reshard: bool) -> None:
    """Gathered copies (here cast to bf16: on a simulated mesh an uncast gathered
    parameter is the sharded parameter's own storage, see the next test) live
    during forward, then until backward only without resharding."""
    torch.manual_seed(0)
    c = GPT.Config()
    model = GPT.GPT(c)
    mesh = DeviceMesh.cpu(4, "dp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh, reshard_after_forward=reshard, mp_policy=policy)
    refs: list[Any] = []
    wholes: list[Any] = []

    def grab(module: nn.Module, args: Any, out: Any) -> None:
        refs.extend(weakref.ref(s) for s in module.weight.shards)
        wholes.append(weakref.ref(whole_value(module.weight)))

    for block in model.layers:
        block.mlp.w1.register_forward_hook(grab)
    model.head.register_forward_hook(grab)
    ids, targets = GPT.batch(c, 8, 0)
    batch = PlacementMapping(mesh, [Sharded(0)])
    loss = model(sw.tensor(ids, sharding=batch), sw.tensor(targets, sharding=batch))
    gc.collect()
    alive = sum(r() is not None for r in wholes)
    assert len(wholes) == 3 and alive == (0 if reshard else 3)
    if reshard:  # nothing cut from the gathered values is kept either
        assert refs and not any(r() is not None for r in refs)
    loss.backward()
    del loss
    gc.collect()
    assert all(r() is None for r in refs + wholes)
    for p in model.parameters():
        assert p.grad is not None and p.grad.dist_layout == p.dist_layout


def test_gathered_parameters_on_a_simulated_mesh_are_the_sharded_storage() -> None:
    """On a mesh this process holds wholly, a sharded parameter holds its global value
    (its blocks are views of it), so the unit's gather is a view of it, not a copy:
    no gathered memory, and the same values as single-device torch bit for bit."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    mesh = DeviceMesh.cpu(4, "dp")
    fully_shard(model, mesh)
    sharded = model[0].weight
    seen: list[Any] = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(m.weight))
    x = torch.randn(4, 6)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
    with CommCounter() as cc:
        loss = model(xs).pow(2).sum()
    assert seen[0] is not sharded and seen[0].dist_layout != sharded.dist_layout
    assert seen[0].untyped_storage().data_ptr() == sharded.untyped_storage().data_ptr()
    assert cc.counts["all_gather"] == 1  # counted as the one flat all_gather it stands for
    rloss = ref(x).pow(2).sum()
    loss.backward()
    rloss.backward()
    assert torch.equal(loss.to_torch(), rloss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dist_layout == p.dist_layout
        assert torch.equal(p.grad.to_torch(), q.grad)


def test_mixed_precision_bf16_matches_a_bf16_torch_reference() -> None:
    """param_dtype=bf16 against single-device torch computing with bf16 copies of fp32
    master weights (what FSDP2's policy computes). Tolerances: each loss within one
    bf16 ulp of the reference's (bf16 keeps 8 bits: 2**-7 relative spacing), parameters
    within 5 * lr after 10 AdamW steps (an AdamW step moves a parameter by about lr at
    most, so rounding-level gradient differences can drift by that much a step)."""
    bf, lr = torch.bfloat16, 1e-2
    torch.manual_seed(0)
    c = GPT.Config()
    ref = GPT.GPT(c)
    model = copy.deepcopy(ref)
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    fb.hand_tp(model, mesh)
    policy = MixedPrecisionPolicy(param_dtype=bf, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh, mp_policy=policy)
    fully_shard(model, mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    batch = PlacementMapping(mesh, [Sharded(0), R])
    for step in range(10):
        ids, targets = GPT.batch(c, 8, step)
        with CommCounter() as fwd:
            loss = model(sw.tensor(ids, sharding=batch), sw.tensor(targets, sharding=batch))
        with CommCounter() as bwd:
            loss.backward()
        assert loss.dtype == bf
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in model.parameters())
        opt.step()
        opt.zero_grad()
        rloss = torch.func.functional_call(
            ref, {n: p.to(bf) for n, p in ref.named_parameters()}, (ids, targets))
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        lv, rv = float(loss.detach()), float(rloss.detach())
        assert abs(lv - rv) <= 2 ** -7 * abs(rv) * 1.001, (step, lv, rv)
        if step == 0:  # gathered in bf16 (2 bytes an element), reduced in fp32 (4)
            gathered = sum(b for k, b, s in _every(fwd)
                           if k == "all_gather" and s.axes == (_dp(mesh),))
            scattered = sum(b for k, b, s in _every(bwd) if k == "reduce_scatter")
            params = sum(p.numel() for p in model.parameters())
            assert gathered < params and scattered > params
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.to_torch() - q).abs().max() <= 5 * lr


def _assert_sgd_like_torch(model: nn.Module, ref: nn.Module, mesh: DeviceMesh,
                           steps: int) -> None:
    """``steps`` SGD steps of ``model`` (batch Sharded(0) over the mesh's first axis)
    and of ``ref`` on one device leave equal parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 5)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)] + [R] * (mesh.ndim - 1)))
    for _ in range(steps):
        for m, o, inp in ((model, opt, xs), (ref, ropt, x)):
            o.zero_grad()
            m(inp).pow(2).sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("shape", "tp"), [((2,), False), ((4,), False), ((2, 2), True)])
def test_uneven_and_empty_shards(shape: tuple[int, ...], tp: bool) -> None:
    """A (3, 5) weight over 2 or 4 devices (rows 2+1, or 1+1+1+0), alone and over a
    tp-rowwise layout: 5 SGD steps equal torch's."""
    mesh = DeviceMesh.cpu(shape, ("dp", "tp")[:len(shape)])
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    model = copy.deepcopy(ref)
    if tp:
        model[0].weight = nn.Parameter(sw.tensor(
            model[0].weight.detach(), sharding=PlacementMapping(mesh, [R, Sharded(0)])))
    fully_shard(model, mesh)
    rows = [s.shape[0] for s in model[0].weight.shards]
    assert rows == {(2,): [2, 1], (4,): [1, 1, 1, 0], (2, 2): [1, 1, 1, 0]}[shape]
    _assert_sgd_like_torch(model, ref, mesh, steps=5)


def test_parameters_that_one_flat_all_gather_cannot_take() -> None:
    """On a (2, 4) mesh a (6,) bias split over tp (2+2+1+1) cannot be split further
    over dp (8 pieces give 1+1+1+1+1+1+0+0): it is gathered alone by the planner; the
    (6, 5) weight is sharded over dp along dim 1 instead. Values equal torch's."""
    mesh = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    torch.manual_seed(0)
    ref = nn.Linear(5, 6)
    model = copy.deepcopy(ref)
    for name in ("weight", "bias"):
        setattr(model, name, nn.Parameter(sw.tensor(getattr(model, name).detach(),
                sharding=PlacementMapping(mesh, [R, Sharded(0)]))))
    fully_shard(model, mesh)
    assert model.weight.dist_layout.spec_entries() == ("tp", "dp")
    assert model.bias.dist_layout.spec_entries() == (("tp", "dp"),)
    _assert_sgd_like_torch(model, ref, mesh, steps=3)


def test_state_dict_keeps_names_and_sharded_values() -> None:
    mesh = DeviceMesh.cpu(2, "dp")
    model = GPT.GPT(GPT.Config())
    names = list(model.state_dict())
    for block in model.layers:
        fully_shard(block, mesh)
    fully_shard(model, mesh)
    sd = model.state_dict()
    assert list(sd) == names
    assert all(isinstance(v, sw.Tensor) and v.dist_layout.sharded_axes == (0,)
               for v in sd.values())
    plain = GPT.GPT(GPT.Config()).state_dict()  # whole torch values load into shards
    model.load_state_dict(plain)
    for name, value in model.state_dict().items():
        assert torch.equal(value.to_torch(), plain[name])
        assert value.dist_layout == sd[name].dist_layout


def test_shared_parameter_is_sharded_once() -> None:
    mesh = DeviceMesh.cpu(2, "dp")
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model, mesh)
    assert model[1].weight is model[0].weight and len(list(model.parameters())) == 1


def test_ignored_params_stay_as_they_are() -> None:
    """FSDP2's ignored_params: a parameter already sharded over the FSDP axis (dp2ep's
    experts) is left to its layout, its gradient as autograd gives it."""
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    model[1].weight = nn.Parameter(sw.tensor(model[1].weight.detach(), sharding=PlacementMapping(
        mesh, [Sharded(0), Replicated()])))
    kept = model[1].weight
    fully_shard(model, mesh, ignored_params={kept})
    assert model[1].weight is kept and model[0].weight.placements == (Sharded(0), Replicated())
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    with pytest.raises(ShardingTypeError, match=r"ignored_params=...\) is a set of parameters"):
        fully_shard(nn.Linear(2, 2), mesh, ignored_params=[kept])  # type: ignore[arg-type]
    assert kept.grad.dist_layout == kept.dist_layout
    torch.testing.assert_close(kept.grad.to_torch(), ref[1].weight.grad)
    torch.testing.assert_close(model[0].weight.grad.to_torch(), ref[0].weight.grad)


def test_bad_inputs_name_value_rule_and_fix() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    with pytest.raises(ShardingError, match=r"axis='data'.*no axis 'data'.*Use axis='dp'"):
        fully_shard(nn.Linear(2, 2), mesh, axis="data")
    with pytest.raises(ShardingTypeError, match=r"needs an nn.Module. Got Tensor"):
        fully_shard(torch.ones(2), mesh)  # type: ignore[arg-type]
    with pytest.raises(ShardingTypeError, match="needs a DeviceMesh"):
        fully_shard(nn.Linear(2, 2), "dp")  # type: ignore[arg-type]
    with pytest.raises(ShardingTypeError, match="needs a bool"):
        fully_shard(nn.Linear(2, 2), mesh, reshard_after_forward=1)  # type: ignore[arg-type]
    with pytest.raises(ShardingTypeError, match="needs a MixedPrecisionPolicy"):
        fully_shard(nn.Linear(2, 2), mesh, mp_policy=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ShardingTypeError, match=r"floating torch.dtype.*Got torch.int32"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    lin = fully_shard(nn.Linear(2, 2), mesh)
    with pytest.raises(ShardingError, match=r"already called.*once per module"):
        fully_shard(lin, mesh)
    other = nn.Linear(2, 2)
    other.weight = nn.Parameter(sw.tensor(other.weight.detach(),
                                          sharding=PlacementMapping(DeviceMesh.cpu(2, "tp"),
                                                                    [Sharded(0)])))
    with pytest.raises(ShardingError, match=r"'weight' lives on DeviceMesh\(tp=2\)"):
        fully_shard(other, mesh)
    on_dp = nn.Linear(2, 2)
    on_dp.weight = nn.Parameter(sw.tensor(on_dp.weight.detach(),
                                          sharding=PlacementMapping(mesh, [Sharded(1), R])))
    with pytest.raises(ShardingError, match=r"already sharded over 'dp'.*must be free"):
        fully_shard(on_dp, mesh)
    partial = nn.Module()
    partial.w = nn.Parameter(sw.tensor(torch.ones(2), sharding=PlacementMapping(
        mesh, [R, Partial()])))
    with pytest.raises(ShardingError, match=r"'w' is Partial.*all_reduce"):
        fully_shard(partial, mesh)
    scalar = nn.Module()
    scalar.t = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ShardingError, match=r"'t' is 0-d.*shape \(1,\)"):
        fully_shard(scalar, mesh)


@pytest.mark.parametrize("name", ["body_fsdp_gpt", "body_fsdp_bf16_gpt",
                                  "body_fsdp_batch_over_both_axes"])
def test_gloo_bodies_on_the_simulated_mesh(name: str) -> None:
    """The bodies that test_fsdp_gloo.py runs on 4 processes, on 4 simulated devices."""
    getattr(fb, name)(4)


def test_training_patterns_match_torch() -> None:
    """A root with no parameters of its own, two forwards before one backward,
    backward twice with retain_graph, a frozen parameter, and a no_grad forward."""
    mesh = DeviceMesh.cpu(2, "dp")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref[2].bias.requires_grad_(False)
    model = copy.deepcopy(ref)
    fully_shard(model[0], mesh)
    fully_shard(model[2], mesh)
    fully_shard(model, mesh)
    x = torch.randn(6, 4)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
    for m, inp in ((model, xs), (ref, x)):
        loss = m(inp).sum() + m(inp).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert model[2].bias.grad is None and not model[2].bias.requires_grad
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.to_torch(), q.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(xs).to_torch(), ref(x), rtol=1e-5, atol=1e-6)
    assert all(0 in p.dist_layout.sharded_axes for p in model.parameters())


def test_a_replaced_parameter_is_taken_again_or_refused() -> None:
    """to_empty/.to() may register new Parameter objects: the unit takes them when they
    keep the sharded layout, and names the parameter when they do not."""
    mesh = DeviceMesh.cpu(2, "dp")
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    model = fully_shard(copy.deepcopy(ref), mesh)
    x = torch.randn(2, 4)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
    model.weight = nn.Parameter(model.weight.detach() * 2)  # same layout: taken
    torch.testing.assert_close(model(xs).to_torch(),
                               nn.functional.linear(x, 2 * ref.weight, ref.bias))
    assert model.weight.dist_layout.sharded_axes == (0,)
    model.weight = nn.Parameter(torch.zeros(3, 4))  # a plain tensor: refused, named
    with pytest.raises(ShardingError, match=r"Linear\.weight was replaced"):
        model(xs)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_accumulation_and_activation_checkpointing_match_torch(checkpointed: bool) -> None:
    """Two micro-batches per step, blocks under torch.utils.checkpoint (non-reentrant),
    zero_grad(set_to_none=False): TP x FSDP steps equal single-device torch's."""
    import torch.utils.checkpoint as ckpt

    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.l2(torch.relu(self.l1(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = ckpt.checkpoint(b, x, use_reentrant=False) if checkpointed else b(x)
            return x

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    ref = Net()
    model = parallelize_module(copy.deepcopy(ref), mesh, {"blocks.*.l1": ColwiseParallel(),
                                                          "blocks.*.l2": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh, axis="dp")
    fully_shard(model, mesh, axis="dp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(8, 8, generator=g)
            xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
            model(xs).square().mean().backward()
            ref(x).square().mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=False)
        ropt.zero_grad(set_to_none=False)
        assert all(float(p.grad.to_torch().abs().max()) == 0.0 for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().to_torch(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=name)


def test_a_parameter_swapped_for_blocks_takes_the_block_gather() -> None:
    """``p.data = `` a Tensor built from blocks (no whole value) between steps: the unit
    gathers through the flat buffer again, with the same values."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    model = copy.deepcopy(ref)
    mesh = DeviceMesh.cpu(2, "dp")
    fully_shard(model, mesh)
    w = model[0].weight
    assert whole_value(w) is not None
    with torch.no_grad():
        w.data = w.detach().map_blocks(lambda s: s.clone())  # blocks, no whole
    assert whole_value(w) is None
    _assert_sgd_like_torch(model, ref, mesh, steps=2)
