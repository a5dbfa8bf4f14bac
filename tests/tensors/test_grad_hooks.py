"""Autograd hooks on a shardwise Tensor equal torch's on the same values:
``register_hook`` (observe and replace), ``retain_grad`` and
``register_post_accumulate_grad_hook``, whether autograd runs on the whole value
(``shardwise.tensor``) or on the local blocks (``from_local``); what cannot work (a
Partial tensor, replacing a gradient split over several blocks) raises, naming the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from tests.helpers.shardcheck import whole_value

MESH = DeviceMesh.cpu((2, 2), ("dp", "tp"))
LAYOUTS = [[Sharded(0), Replicated()], [Replicated(), Sharded(1)], [Sharded(1), Sharded(0)]]


def _value() -> torch.Tensor:
    return torch.arange(24.0).reshape(4, 6) / 7


def _whole(place: list[Any]) -> Any:
    return sw.tensor(_value(), sharding=PlacementMapping(MESH, place)).requires_grad_()


def _blocks(place: list[Any]) -> Any:
    """The same value from its local blocks: autograd runs on each block."""
    ref = sw.tensor(_value(), sharding=PlacementMapping(MESH, place))
    shards = [s.clone() for s in ref.shards]
    return sw.from_local(shards, PlacementMapping(MESH, place), shape=(4, 6),
                         requires_grad=True)


def _loss(x: Any) -> Any:
    return (x * x).sin().sum()


@pytest.mark.parametrize("make", [_whole, _blocks])
@pytest.mark.parametrize("place", LAYOUTS)
def test_a_hook_sees_the_gradient_torch_computes(make: Any, place: list[Any]) -> None:
    x = make(place)
    assert whole_value(x) is None if make is _blocks else whole_value(x) is not None
    ref = _value().requires_grad_()
    seen: list[Any] = []
    want: list[torch.Tensor] = []
    h = x.register_hook(lambda g: seen.append(g))
    ref.register_hook(lambda g: want.append(g))
    for _ in range(2):   # once per backward
        _loss(x).backward()
        _loss(ref).backward()
    assert len(seen) == len(want) == 2
    for g, w in zip(seen, want, strict=True):
        assert isinstance(g, sw.Tensor) and g.placements == x.placements
        assert torch.equal(g.to_torch(), w)
    assert torch.equal(x.grad.to_torch(), ref.grad)
    h.remove()
    _loss(x).backward()
    assert len(seen) == 2   # removed: not called again


@pytest.mark.parametrize("place", LAYOUTS)
def test_a_hook_replaces_the_gradient_as_torch_s_does(place: list[Any]) -> None:
    x = _whole(place)
    ref = _value().requires_grad_()
    y, y_ref = x * 3, ref * 3
    y.register_hook(lambda g: g * 2 + 1)      # on a non-leaf: flows on to x
    y_ref.register_hook(lambda g: g * 2 + 1)
    _loss(y).backward()
    _loss(y_ref).backward()
    assert torch.equal(x.grad.to_torch(), ref.grad)


def test_retain_grad_keeps_a_non_leaf_gradient() -> None:
    for make in (_whole, _blocks):
        x = make([Sharded(0), Replicated()])
        ref = _value().requires_grad_()
        y, y_ref = x.tanh(), ref.tanh()
        assert not y.retains_grad
        y.retain_grad()
        y_ref.retain_grad()
        assert y.retains_grad
        _loss(y).backward()
        _loss(y_ref).backward()
        assert torch.equal(y.grad.to_torch(), y_ref.grad), make.__name__


@pytest.mark.parametrize("make", [_whole, _blocks])
def test_a_post_accumulate_hook_runs_once_the_leaf_holds_its_gradient(make: Any) -> None:
    p = make([Replicated(), Sharded(1)])
    ref = _value().requires_grad_()
    seen: list[torch.Tensor] = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.to_torch().clone()))
    _loss(p).backward()
    _loss(p).backward()
    _loss(ref).backward()
    first = ref.grad.clone()
    _loss(ref).backward()
    assert len(seen) == 2
    assert torch.equal(seen[0], first) and torch.equal(seen[1], ref.grad)
    with pytest.raises(RuntimeError, match="non-leaf"):
        (p * 2).register_post_accumulate_grad_hook(lambda t: None)


def test_what_cannot_work_raises_naming_the_fix() -> None:
    x = _blocks([Sharded(0), Replicated()])   # two distinct blocks in this process
    x.register_hook(lambda g: g * 2)
    with pytest.raises(ShardingError, match="may only observe such a gradient"):
        _loss(x).backward()
    y = _whole([Sharded(0), Replicated()])
    y.register_hook(lambda g: torch.ones(4, 6))   # a plain tensor, not a Tensor
    with pytest.raises(ShardingTypeError, match=r"must be a shardwise\.Tensor of shape"):
        _loss(y).backward()
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        sw.tensor(_value(), sharding=PlacementMapping(MESH, [Replicated(), Replicated()])
                  ).register_hook(print)
    part = sw.from_local([torch.ones(2) for _ in range(4)],
                         PlacementMapping(MESH, [Partial(), Replicated()]), shape=(2,),
                         requires_grad=True)
    with pytest.raises(ShardingError, match="whose layout is Partial"):
        part.register_hook(print)
