"""Ordinary PyTorch training on shardwise Tensors: nn.Module, torch.optim, clipping,
state dicts, dtype moves and torch.compile, checked against single-device torch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded, ShardingError
from tests.helpers.torch_bodies import megatron

R = Replicated()


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], mesh: Any = None,
          clip: float | None = None, sched: Any = None) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for x, y in data:
        if mesh is not None:
            x = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), R]))
            y = sw.tensor(y, sharding=PlacementMapping(mesh, [Sharded(0), R]))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) if mesh is None else ((model(x) - y) ** 2).mean()
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss))
    return losses, norms


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                   weight_decay=0.01, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=1e-2, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_single_device_torch(name: str, foreach: bool) -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    ref = mlp()
    model = megatron(copy.deepcopy(ref), mesh)
    data = batches(5)
    opt = OPTIMIZERS[name](model.parameters(), foreach)
    ropt = OPTIMIZERS[name](ref.parameters(), foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, 2, gamma=0.5)
    got, gnorm = train(model, opt, data, mesh, clip=0.5, sched=sched)
    want, wnorm = train(ref, ropt, data, clip=0.5, sched=rsched)
    assert got == pytest.approx(want, rel=1e-5)
    assert gnorm == pytest.approx(wnorm, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert isinstance(p, sw.Tensor) and isinstance(p, nn.Parameter)
        torch.testing.assert_close(p.to_torch(), q.detach(), rtol=1e-5, atol=1e-6)
        for state in opt.state[p].values():
            if isinstance(state, sw.Tensor) and state.ndim:
                assert state.dist_layout == p.dist_layout  # optimizer state is sharded too


def test_megatron_mlp_adamw_clip_on_2x4() -> None:
    mesh = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    ref = mlp(1)
    model = megatron(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    got, _ = train(model, opt, batches(5), mesh, clip=0.3)
    want, _ = train(ref, ropt, batches(5), clip=0.3)
    assert got == pytest.approx(want, rel=1e-5)


def test_clip_grad_norm_returns_the_global_norm_and_scales() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    ref = mlp(2)
    model = megatron(copy.deepcopy(ref), mesh)
    x, y = batches(1)[0]
    F.mse_loss(ref(x), y).backward()
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), R]))
    ((model(xs) - y) ** 2).mean().backward()
    for norm_type in (2.0, float("inf"), 1.0):
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
        got = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    rtotal = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert float(total) == pytest.approx(float(rtotal), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, rtol=1e-5, atol=1e-7)
        assert p.grad.dist_layout == p.dist_layout


def test_state_dict_round_trip_and_load_into_sharded_targets() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model = megatron(mlp(3), mesh)
    sd = model.state_dict()
    assert all(isinstance(v, sw.Tensor) for v in sd.values())
    other = megatron(mlp(4), mesh)
    layouts = {k: v.dist_layout for k, v in other.state_dict().items()}
    other.load_state_dict(sd)
    for k, v in other.state_dict().items():
        assert v.dist_layout == layouts[k]  # filled in place, layout kept
        assert torch.equal(v.to_torch(), sd[k].to_torch())
    # a plain (global) state dict loads into sharded parameters too
    plain = mlp(5)
    other.load_state_dict(plain.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(v.to_torch(), plain.state_dict()[k])


def test_module_to_dtype_zero_grad_and_freezing() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model = megatron(mlp(6), mesh)
    layouts = [p.dist_layout for p in model.parameters()]
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 and isinstance(p, nn.Parameter)
               for p in model.parameters())
    assert [p.dist_layout for p in model.parameters()] == layouts
    x = sw.tensor(torch.randn(4, 16, dtype=torch.float64),
                  sharding=PlacementMapping(mesh, [Sharded(0), R]))
    model(x).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64
               for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    model[0].weight.requires_grad_(False)
    model(x).sum().backward()
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    copied = copy.deepcopy(model)
    for p, q in zip(copied.parameters(), model.parameters()):
        assert p is not q and torch.equal(p.to_torch(), q.to_torch())
        assert p.dist_layout == q.dist_layout and p.requires_grad == q.requires_grad


def test_torch_compile_gives_correct_values() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = torch.randn(4, 6)
    w = torch.randn(6, 3)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), R]))
    ws = sw.tensor(w, sharding=PlacementMapping(mesh, [R, Sharded(1)]))

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(a @ b).sum(-1) * 2

    compiled = torch.compile(f, backend="eager")
    torch.testing.assert_close(compiled(xs, ws).to_torch(), f(x, w))
    torch.testing.assert_close(compiled(xs, ws).to_torch(), f(x, w))  # cached


def test_nn_parameter_and_module_attribute_errors_are_torchs() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    t = sw.tensor(torch.randn(4, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    p = nn.Parameter(t)
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf
    assert p.dist_layout == t.dist_layout and not t.requires_grad
    lin = nn.Linear(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the message names the type without a gather
        with pytest.raises(TypeError, match=r"torch\.FloatTensor"):
            lin.weight = t  # a non-Parameter tensor cannot replace a parameter (torch's rule)


def test_type_names_and_casts_like_torch_without_gathering() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = torch.randn(5, 3)
    t = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: no gather
        assert t.type() == x.type() == "torch.FloatTensor"
        assert torch.typename(t) == torch.typename(x)
        for target in (torch.float64, "torch.DoubleTensor", torch.int32):
            out = t.type(target)
            assert out.dist_layout == t.dist_layout
            assert torch.equal(out.to_torch(), x.type(target))
    with pytest.raises(ShardingError, match=r"shardwise\.to_device"):
        t.type("torch.cuda.FloatTensor")  # a device move is not a cast
    with pytest.raises(ShardingError, match="names no tensor type"):
        t.type("torch.NoSuchTensor")


def test_module_to_dtype_asks_no_fallback() -> None:
    model = megatron(mlp(6), DeviceMesh.cpu((2, 2), ("dp", "tp")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
