"""Tensor and sequence parallel GPT (examples/gpt.py) through shardwise.parallel, on
simulated 2x2 and 2x4 meshes: training parity with single-device torch, Megatron's
collectives, and the plan's errors."""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded, ShardingError
from shardwise.debug import CommCounter
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from tests.helpers import gpt_plans
from tests.helpers.shardcheck import whole_value
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one torch thread)

MESHES = [(2, 2), (2, 4)]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("plan", [gpt_plans.megatron_plan, gpt_plans.sequence_plan],
                         ids=["megatron", "sp"])
def test_gpt_training_matches_torch(shape: tuple[int, int], plan: object) -> None:
    mesh = gpt_plans.mesh_of(*shape)
    run = gpt_plans.train(mesh, plan())  # type: ignore[operator]
    gpt_plans.assert_parity(run)
    model = run["model"]
    tp = mesh.axis_index("tp")
    # each device holds 1/tp of every planned weight and of its AdamW state
    for name in ("layers.0.attn.wq.weight", "layers.1.mlp.w2.weight", "tok.weight",
                 "head.weight"):
        p = model.get_parameter(name)
        assert tp in p.dist_layout.sharded_axes, name
        assert p.dist_layout.replicated_axes() == (mesh.axis_index("dp"),), name
        for state in run["opt"].state[p].values():
            if state.ndim:
                assert state.dist_layout == p.dist_layout, name


def _block_input(mesh: DeviceMesh, seq_sharded: bool) -> sw.Tensor:
    c = example_gpt().Config()
    x = torch.randn(8, c.seq, c.dim)
    tp = Sharded(1) if seq_sharded else Replicated()
    return sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), tp]))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_megatron_block_forward_is_two_all_reduces(shape: tuple[int, int]) -> None:
    mesh = gpt_plans.mesh_of(*shape)
    run = gpt_plans.train(mesh, gpt_plans.megatron_plan(), steps=1)
    c = run["ref"].config
    x = _block_input(mesh, seq_sharded=False)
    with CommCounter() as cc:
        y = run["model"].layers[0](x)
    activation = 8 // shape[0] * c.seq * c.dim * 4  # bytes of this device's activations
    assert dict(cc.counts) == {"all_reduce": 2}
    tp = shape[1]  # a ring all_reduce moves 2 (tp - 1) / tp of the activations per device
    assert cc.bytes["all_reduce"] == 2 * activation * 2 * (tp - 1) // tp
    assert y.placements == (Sharded(0), Replicated())
    torch.testing.assert_close(y.detach().to_torch(), run["ref"].layers[0](x.to_torch()),
                               rtol=1e-5, atol=1e-5)
    # the whole forward: the embedding's all_reduce, two per block, and the loss's
    # per-row numbers (max; sum-exp with target logit; the mean over dp): no gathers
    counts = run["comm"].counts
    assert set(counts) == {"all_reduce"}
    big = [b for kind, b, _ in run["comm"].log if b >= activation]
    assert len(big) == 1 + 2 * c.layers
    assert counts["all_reduce"] <= 1 + 2 * c.layers + 3


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sequence_parallel_block_is_gather_scatter_pairs(shape: tuple[int, int]) -> None:
    mesh = gpt_plans.mesh_of(*shape)
    run = gpt_plans.train(mesh, gpt_plans.sequence_plan(), steps=1)
    c = run["ref"].config
    x = _block_input(mesh, seq_sharded=True)
    with CommCounter() as cc:
        y = run["model"].layers[0](x)
    assert dict(cc.counts) == {"all_gather": 2, "reduce_scatter": 2}
    assert cc.bytes["all_gather"] == cc.bytes["reduce_scatter"]
    assert y.placements == (Sharded(0), Sharded(1))
    torch.testing.assert_close(y.detach().to_torch(), run["ref"].layers[0](x.to_torch()),
                               rtol=1e-5, atol=1e-5)
    counts = run["comm"].counts  # + the embedding's reduce_scatter, the head's all_gather
    assert counts["all_gather"] == counts["reduce_scatter"] == 2 * c.layers + 1
    assert counts["all_reduce"] <= 3  # the loss's per-row numbers only
    norm = run["model"].layers[0].ln1.weight
    assert norm.placements == (Replicated(), Replicated())


def test_unplanned_parameters_are_untouched() -> None:
    gpt = example_gpt()
    model = gpt.GPT(gpt.Config())
    before = {n: p for n, p in model.named_parameters()}
    parallelize_module(model, gpt_plans.mesh_of(2, 2), gpt_plans.megatron_plan())
    for name in ("pos.weight", "layers.0.ln1.weight", "layers.1.ln2.bias", "norm.weight"):
        p = model.get_parameter(name)
        assert p is before[name] and not isinstance(p, sw.Tensor), name
    assert isinstance(model.get_parameter("layers.0.attn.wq.weight"), sw.Tensor)


def test_reachable_from_the_root_package() -> None:
    import shardwise.parallel as parallel

    assert sw.parallel is parallel and sw.parallel.parallelize_module is parallelize_module


def test_one_dimensional_mesh_needs_no_axis() -> None:
    mesh = DeviceMesh.cpu(2, "model")
    lin = parallelize_module(torch.nn.Linear(4, 6), mesh, ColwiseParallel())
    assert lin.weight.placements == (Sharded(0),)
    with pytest.raises(ShardingError, match="'tp' is not in"):
        parallelize_module(torch.nn.Linear(4, 6), DeviceMesh.cpu((2, 2), ("dp", "model")),
                           ColwiseParallel())


def test_errors_name_the_value_and_the_fix() -> None:
    gpt = example_gpt()
    mesh = gpt_plans.mesh_of(2, 2)
    model = gpt.GPT(gpt.Config())
    with pytest.raises(ShardingError, match=r"'layers\.\*\.attn\.wz' matches no submodule"
                       r"(.|\n)*layers\.0\.attn\.wq(.|\n)*fix the name"):
        parallelize_module(model, mesh, {"layers.*.attn.wz": ColwiseParallel()})
    with pytest.raises(ShardingError, match=r"'layers\.0\.ln1' is a LayerNorm.*"
                       r"SequenceParallel"):
        parallelize_module(model, mesh, {"layers.0.ln1": ColwiseParallel()})
    with pytest.raises(ShardingError, match=r"RowwiseParallel .*'norm' is a LayerNorm"):
        parallelize_module(model, mesh, {"norm": RowwiseParallel()})
    with pytest.raises(ShardingError, match=r"'mp' is not in DeviceMesh\(dp=2, tp=2\) "
                       r"\(axes \['dp', 'tp'\]\).*axis="):
        parallelize_module(model, mesh, {"head": ColwiseParallel()}, axis="mp")
    with pytest.raises(ShardingError, match=r"use_local_output=True.*global shape.*drop"):
        ColwiseParallel(use_local_output=True)
    with pytest.raises(TypeError, match=r"not a parallel style"):
        parallelize_module(model, mesh, {"head": "colwise"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"placement for the plan's mesh axis.*Got 1"):
        RowwiseParallel(output_layouts=1)  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"one entry per positional input"):
        PrepareModuleInput(input_layouts=(Sharded(1), None), desired_input_layouts=Replicated())
    with pytest.raises(ShardingError, match=r"Cannot shard parameter 'weight' with shape "
                       r"\[1, 4\] across 2 devices"):
        parallelize_module(torch.nn.Linear(4, 1), mesh, ColwiseParallel())
    # a failed plan changes nothing: every pattern is checked before any is applied
    fresh = gpt.GPT(gpt.Config())
    with pytest.raises(ShardingError, match="nope"):
        parallelize_module(fresh, mesh, {"head": ColwiseParallel(), "nope": ColwiseParallel()})
    assert not isinstance(fresh.head.weight, sw.Tensor)


def test_input_on_another_mesh_is_refused() -> None:
    lin = parallelize_module(torch.nn.Linear(4, 6), gpt_plans.mesh_of(2, 2), ColwiseParallel())
    x = sw.tensor(torch.ones(3, 4), sharding=PlacementMapping(DeviceMesh.cpu(2, "tp"),
                                                              [Replicated()]))
    with pytest.raises(ShardingError, match=r"input 0 lives on DeviceMesh\(tp=2\).*to_device"):
        lin(x)


def test_embeddings_rowwise_and_colwise_match_torch() -> None:
    mesh = gpt_plans.mesh_of(2, 2)
    torch.manual_seed(1)
    for style, table, result in ((RowwiseParallel(), Sharded(0), Replicated()),
                                 (ColwiseParallel(), Sharded(1), Sharded(2))):
        ref = torch.nn.Embedding(11, 6, padding_idx=3)  # 11 rows: uneven over tp=2
        emb = parallelize_module(torch.nn.Embedding(11, 6, padding_idx=3), mesh, style)
        with torch.no_grad():
            emb.weight.copy_(ref.weight)
        assert emb.weight.placements == (Replicated(), table)
        ids = torch.tensor([[0, 3, 10, 5], [7, 3, 1, 10]])
        xs = sw.tensor(ids, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
        with CommCounter() as cc:
            out = emb(xs)
        assert "all_gather" not in cc.counts  # the table is never gathered
        assert out.placements == (Sharded(0), result)
        torch.testing.assert_close(out.detach().to_torch(), ref(ids))
        (out * torch.arange(6.0)).sum().backward()
        (ref(ids) * torch.arange(6.0)).sum().backward()
        torch.testing.assert_close(emb.weight.grad.to_torch(), ref.weight.grad)
        assert float(ref.weight.grad[3].abs().sum()) == 0.0  # padding row: no gradient


def test_prepare_module_input_kwargs_and_output() -> None:
    from shardwise.parallel import PrepareModuleOutput

    class Two(torch.nn.Module):
        def forward(self, a: torch.Tensor, *, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return a, b

    mesh = gpt_plans.mesh_of(2, 2)
    m = parallelize_module(Two(), mesh, PrepareModuleInput(
        input_layouts=Replicated(), desired_input_layouts=Sharded(0),
        input_kwarg_layouts={"b": Replicated()}, desired_input_kwarg_layouts={"b": Sharded(1)}))
    a, b = m(torch.ones(4, 4), b=torch.ones(4, 4))
    assert a.placements == (Replicated(), Sharded(0))
    assert b.placements == (Replicated(), Sharded(1))
    m2 = parallelize_module(Two(), mesh, PrepareModuleOutput(
        output_layouts=(Replicated(), Replicated()), desired_output_layouts=(Sharded(1), None)))
    a, b = m2(torch.ones(4, 4), b=torch.ones(4, 4))
    assert a.placements == (Replicated(), Sharded(1)) and not isinstance(b, sw.Tensor)
    sp = parallelize_module(torch.nn.Dropout(0.0), mesh, SequenceParallel(sequence_dim=0))
    assert sp(torch.ones(4, 4)).placements == (Replicated(), Sharded(0))


def test_tied_weights_stay_one_parameter() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.tok(ids))

    mesh = DeviceMesh.cpu(2, "tp")
    torch.manual_seed(0)
    ref = Tied()
    model = parallelize_module(Tied(), mesh, {"tok": RowwiseParallel(),
                                              "head": ColwiseParallel(output_layouts=Replicated())})
    with torch.no_grad():
        model.tok.weight.copy_(ref.tok.weight)
    assert model.head.weight is model.tok.weight
    assert len(list(model.parameters())) == 1
    ids = torch.tensor([[1, 15, 3]])
    torch.testing.assert_close(model(ids).detach().to_torch(), ref(ids))
    with pytest.raises(ShardingError, match=r"shared with 'Embedding.weight'.*one layout"):
        parallelize_module(Tied(), mesh, {"tok": ColwiseParallel(), "head": ColwiseParallel()})


@pytest.mark.parametrize("make", [lambda: torch.nn.RMSNorm(8), lambda: torch.nn.LayerNorm(8),
                                  lambda: torch.nn.Dropout(0.25)],
                         ids=["rmsnorm", "layernorm", "dropout"])
def test_sequence_parallel_per_position_modules(make: object) -> None:
    mesh = gpt_plans.mesh_of(2, 2)
    torch.manual_seed(0)
    ref = make()  # type: ignore[operator]
    module = parallelize_module(make(), mesh, SequenceParallel())  # type: ignore[operator]
    module.load_state_dict(ref.state_dict())
    x = torch.randn(4, 6, 8)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
    torch.manual_seed(1)
    with CommCounter() as cc:
        y = module(xs)  # moving Replicated -> Sharded(1) is a local slice
    torch.manual_seed(1)
    want = ref(x)
    assert cc.total == 0
    assert y.placements == (Sharded(0), Sharded(1))
    torch.testing.assert_close(y.detach().to_torch(), want)
    for p in module.parameters():
        assert p.placements == (Replicated(), Replicated())


def test_styles_keep_whole_values_and_count_what_they_stand_for() -> None:
    """On a simulated mesh a planned Megatron MLP runs on whole values end to end (the
    styles' layout changes are metadata there), counts the one all_reduce of the row-
    parallel output as if it ran, and gives torch's values and gradients bit for bit."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model = parallelize_module(copy.deepcopy(ref), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()}, axis="tp")
    x = torch.randn(4, 6)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Replicated()]))
    with CommCounter() as cc:
        y = model(xs)
    assert whole_value(y) is not None and y.placements == (Sharded(0), Replicated())
    assert dict(cc.counts) == {"all_reduce": 1}
    want = ref(x)
    assert torch.equal(y.to_torch(), want.detach())
    y.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad.to_torch(), q.grad)
