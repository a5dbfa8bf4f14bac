"""Random fills and ``nn.init`` on shardwise Tensors give single-device torch's values
for the same seed, on every layout, whether or not the tensor holds its global value
(the multi-process runtime never does): drawn per block, the blocks of one seed would
repeat across processes and differ from torch."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import M22 as MESH
from tests.helpers.shardcheck import whole_value

R = Replicated()
LAYOUTS = [(R, R), (Sharded(0), R), (R, Sharded(1)), (Sharded(0), Sharded(1)),
           (Sharded(1), Sharded(0))]

FILLS: dict[str, Callable[[torch.Tensor], Any]] = {
    "normal_": lambda t: t.normal_(0.5, 2.0),
    "uniform_": lambda t: t.uniform_(-1.0, 1.0),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(2.0),
    "random_": lambda t: t.random_(0, 10),
    "cauchy_": lambda t: t.cauchy_(),
    "log_normal_": lambda t: t.log_normal_(),
    "geometric_": lambda t: t.geometric_(0.4),
    "init.normal_": lambda t: nn.init.normal_(t, std=0.02),
    "init.uniform_": lambda t: nn.init.uniform_(t, a=-0.1, b=0.1),
    "init.kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "init.kaiming_normal_": lambda t: nn.init.kaiming_normal_(t),
    "init.xavier_uniform_": lambda t: nn.init.xavier_uniform_(t),
    "init.xavier_normal_": lambda t: nn.init.xavier_normal_(t, gain=2.0),
    "init.trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "init.trunc_normal_narrow": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.1, b=0.2),
    "init.constant_": lambda t: nn.init.constant_(t, 3.0),
}


def _laid_out(x: torch.Tensor, lay: Any, whole: bool) -> sw.Tensor:
    t = sw.tensor(x, sharding=PlacementMapping(MESH, list(lay)))
    if whole:
        return t
    # the same blocks without the global value: the multi-process runtime's case
    out = sw.from_local([s.clone() for s in t.shards], PlacementMapping(MESH, list(lay)),
                        shape=tuple(x.shape))
    assert whole_value(out) is None
    return out


@pytest.mark.parametrize("name", sorted(FILLS))
@pytest.mark.parametrize("whole", [True, False])
def test_fills_match_single_device_torch(name: str, whole: bool) -> None:
    fill = FILLS[name]
    torch.manual_seed(7)
    want = fill(torch.zeros(6, 10))
    for lay in LAYOUTS:
        t = _laid_out(torch.zeros(6, 10), lay, whole)
        layout = t.dist_layout
        torch.manual_seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = fill(t)
        assert out is t and t.dist_layout == layout
        assert torch.equal(t.to_torch(), want), (name, lay)
        # every device holds its own block of the value (replicas equal)
        for dev, block in zip(MESH.devices, t.shards):
            assert torch.equal(block, t.local(dev))
    assert torch.rand(()).item() == pytest.approx(  # the generator moved on as torch's
        (torch.manual_seed(7), fill(torch.zeros(6, 10)), torch.rand(()))[2].item())


def test_a_partial_tensor_refuses_a_fill() -> None:
    p = sw.tensor(torch.ones(4, 4), sharding=PlacementMapping(MESH, [Partial(), R]))
    with pytest.raises(sw.ShardingError, match="Partial"):
        nn.init.normal_(p)
    assert torch.equal(p.to_torch(), torch.ones(4, 4))


def test_a_fill_on_a_leaf_that_requires_grad_is_torchs_error_but_init_is_not() -> None:
    w = nn.Parameter(sw.tensor(torch.zeros(4, 6),
                               sharding=PlacementMapping(MESH, [Sharded(0), Sharded(1)])))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.normal_()
    nn.init.normal_(w)  # nn.init runs without autograd, as in torch
    assert w.requires_grad and w.grad_fn is None and bool((w.to_torch() != 0).any())


def test_reset_parameters_of_a_sharded_model_matches_single_device_torch() -> None:
    """TP x FSDP plans, then the model's own init: the same parameters as torch's."""
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module

    def mlp() -> nn.Sequential:
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    plain, model = mlp(), mlp()
    parallelize_module(model, MESH, {"0": ColwiseParallel(), "2": RowwiseParallel()}, axis="tp")
    fully_shard(model, MESH, axis="dp")
    torch.manual_seed(3)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        assert isinstance(p, sw.Tensor) and p.dist_layout.sharded_axes, k
        assert torch.equal(p.to_torch(), q), k
