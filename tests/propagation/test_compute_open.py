"""Open and closed dims: a closed operand dim is resharded only when unavoidable,
and an output dim is open iff every operand dim of its factor is open."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import DimSpec, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from tests.helpers.computecheck import LINE, MESH, show, values

X, Y = values(8, 8, seed=1), values(8, 8, seed=2)


def closed(v: torch.Tensor, *specs: object) -> sw.Tensor:
    return sw.shard(v, LINE, list(specs))


def opened(v: torch.Tensor, *specs: object) -> sw.Tensor:
    return sw.shard(v, LINE, [DimSpec(s, is_open=True) for s in specs])


def test_where_open_dims_come_from() -> None:
    assert closed(X, "x", None).open_dims == (False, False)
    assert opened(X, "x", None).open_dims == (True, True)
    assert sw.shard(X, LINE, [DimSpec("x", is_open=True), None]).open_dims == (True, False)
    assert sw.tensor(X, sharding=PlacementMapping(LINE, [Sharded(0)])).open_dims == (True, True)
    spec = sw.ShardingSpec(LINE, [DimSpec("x"), DimSpec(None, is_open=True)])
    assert sw.tensor(X, sharding=spec).open_dims == (False, True)
    assert sw.zeros((8, 8), sharding=spec).open_dims == (False, True)
    # resharding with another form reopens; ops give open results by default
    t = closed(X, "x", None)
    assert sw.shard(t, dim_specs=PlacementMapping(LINE, [Sharded(0)])).open_dims == (True, True)
    assert t.detach().open_dims == (False, False)
    assert (opened(X, "x", None) + 1).open_dims == (True, True)


def test_open_operand_moves_for_a_closed_one() -> None:
    # both open: the replicated operand is sliced (0 bytes)
    with CommCounter() as cc:
        out = opened(X, "x", None) + opened(Y, None, None)
    assert show(out) == "[S(x), R]" and cc.total == 0
    # y's dims are closed: x (open) is gathered instead of touching y
    x, y = opened(X, "x", None), closed(Y, None, None)
    with CommCounter() as cc:
        out = x + y
    assert show(out) == "[R, R]" and dict(cc.counts) == {"all_gather": 1}
    assert torch.allclose(out.to_torch(), X + Y)
    assert out.open_dims == (False, False)


def test_closed_operand_keeps_its_sharding() -> None:
    x, y = closed(X, "x", None), opened(Y, None, "x")
    with CommCounter() as cc:
        out = y + x  # without the closed dims the first operand would be kept
    assert show(out) == "[S(x), R]" and dict(cc.counts) == {"all_to_all": 1}
    assert out.open_dims == (False, False)
    assert torch.allclose(out.to_torch(), X + Y)
    with CommCounter() as cc:
        out = opened(Y, None, "x") + opened(X, "x", None)
    assert show(out) == "[R, S(x)]"


def test_unavoidable_change_of_a_closed_dim() -> None:
    x, y = closed(X, "x", None), closed(Y, None, "x")
    with CommCounter() as cc:
        out = x + y
    assert dict(cc.counts) == {"all_to_all": 1}
    assert torch.allclose(out.to_torch(), X + Y)
    assert out.open_dims == (False, False)
    # softmax needs its dim whole even when it is closed
    s = closed(X, None, "x").softmax(1)
    assert show(s) == "[R, R]"


def test_output_open_per_factor() -> None:
    x = sw.shard(X, MESH, [DimSpec("dp", is_open=True), DimSpec(None)])
    w = sw.shard(Y, MESH, [DimSpec(None, is_open=True), DimSpec("tp", is_open=True)])
    out = x @ w  # i: open (x only); k: contracted; j: open (w only)
    assert out.open_dims == (True, True)
    out = x + w  # dim 1: x's closed
    assert out.open_dims == (True, False)
    t = x.T
    assert t.open_dims == (False, True)
    assert x.sum(1).open_dims == (True,)
    assert x[:, None].open_dims == (True, True, False)


def test_constants_do_not_close_anything() -> None:
    x = opened(X, "x", None)
    assert (2.0 * x).open_dims == (True, True)
    assert (closed(X, "x", None) * 2.0).open_dims == (False, False)


def test_placement_mapping_inputs_are_open() -> None:
    x = sw.tensor(X, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]))
    y = sw.tensor(Y, sharding=PlacementMapping(MESH, [Replicated(), Replicated()]))
    with CommCounter() as cc:
        out = x + y
    assert show(out) == "[S(dp), R]" and cc.total == 0 and out.open_dims == (True, True)
