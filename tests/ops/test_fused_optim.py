"""torch.optim's fused kernels (``fused=True``, torchtitan's default) on shardwise
parameters: the same values as the fused optimizer on the single-device tensors, on
whole values and on blocks, uneven shards included; what cannot run is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.sharding.errors import ShardingError
from tests.helpers.meshes import M22

R = Replicated()
# (value shape, placements): uneven rows (5 over 2), both axes, replicated, a 0-size dim
SHAPES = [((5, 6), (Sharded(0), Sharded(1))), ((6,), (R, R)), ((7, 4), (Sharded(1), R)),
          ((0, 4), (Sharded(0), R))]

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, fused=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True, fused=True),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=0.1, maximize=True, fused=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                               fused=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


def _values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape, _ in SHAPES]


def _params(values: list[torch.Tensor], blocks: bool) -> list[torch.nn.Parameter]:
    out = []
    for v, (_, places) in zip(values, SHAPES):
        t = sw.tensor(v.clone(), sharding=PlacementMapping(M22, list(places)))
        if blocks:  # a copy per block: the runtime holds blocks, not one whole value
            t = t.map_blocks(torch.clone)
        out.append(torch.nn.Parameter(t))
    return out


def _train(params: list[Any], make: Callable[[Any], torch.optim.Optimizer]) -> Any:
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    weights = [torch.rand(p.shape, generator=g) for p in params]
    for _ in range(3):
        opt.zero_grad()
        loss = sum(((p * w).square() * 0.5 + p).sum() for p, w in zip(params, weights))
        loss.backward()
        opt.step()
    return opt


def _plain(x: Any) -> torch.Tensor:
    return x.to_torch() if isinstance(x, sw.Tensor) else x


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizer_equals_torch_fused(name: str, blocks: bool) -> None:
    values = _values()
    ours = _params(values, blocks)
    if blocks:
        assert type(ours[0].held).__name__ == "Blocks"
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    opt, ref = _train(ours, OPTIMIZERS[name]), _train(theirs, OPTIMIZERS[name])
    for p, q in zip(ours, theirs):
        assert isinstance(p, sw.Tensor) and p.dist_layout == p.grad.dist_layout
        # the kernel is elementwise: equal on the whole value; on blocks its vector
        # tails fall elsewhere, so allow an ulp
        check = torch.testing.assert_close if blocks else _equal
        check(p.to_torch(), q.detach())
        for key, state in ref.state[q].items():
            check(_plain(opt.state[p][key]), state)


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), (a - b).abs().max()


def test_fused_optimizer_takes_plain_parameters_beside_shardwise_ones() -> None:
    values = _values()
    ours: list[Any] = _params(values[:2], blocks=False)
    ours += [torch.nn.Parameter(v.clone()) for v in values[2:]]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    _train(ours, OPTIMIZERS["adam"])
    _train(theirs, OPTIMIZERS["adam"])
    for p, q in zip(ours, theirs):
        _equal(_plain(p.detach()), q.detach())


def test_fused_optimizer_refuses_a_partial_parameter_naming_the_fix() -> None:
    x = torch.randn(4, 4)
    p = torch.nn.Parameter(sw.tensor(x, sharding=PlacementMapping(M22, [Partial(), R])))
    before = p.to_torch().clone()
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.sum().backward()
    with pytest.raises(ShardingError, match=r"parameter 0 is Partial.*Reduce it first"):
        opt.step()
    assert torch.equal(p.to_torch(), before)  # refused before anything was written


def test_fused_optimizer_refuses_a_state_laid_out_otherwise() -> None:
    p = torch.nn.Parameter(sw.tensor(torch.randn(4, 4),
                                     sharding=PlacementMapping(M22, [Sharded(0), R])))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    p.sum().backward()
    opt.step()
    state = opt.state[p]
    state["exp_avg"] = state["exp_avg"].redistribute(placements=[R, R])
    with pytest.raises(ShardingError, match=r"not laid out alike.*fused=False"):
        opt.step()
