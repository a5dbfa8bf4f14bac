"""Context parallel (shardwise.parallel.context_parallel) on the simulated mesh: ring and
all-to-all attention equal to torch's (forward and backward) at cp = 2 and 4, the
region's order, the collectives beside their closed forms, routing, bad input, and the
GPT of examples/gpt.py trained on dp x cp x tp. The same bodies run on 4 Gloo
processes in test_context_gloo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Sharded, ShardingError
from shardwise.debug import CommCounter
from shardwise.parallel import ContextParallel, context_parallel, parallelize_module
from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import SequenceOrder
from tests.helpers import cp_bodies
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one torch thread)


@pytest.mark.parametrize("n", [2, 4])
def test_attention_matches_torch(n: int) -> None:
    cp_bodies.attention_matches_torch(n)


@pytest.mark.parametrize("n", [2, 4])
def test_counts_match_formulas(n: int) -> None:
    cp_bodies.counts_match_formulas(n)


@pytest.mark.parametrize("n", [2, 4])
def test_value_in_region_order(n: int) -> None:
    cp_bodies.value_in_region_order(n)


def test_order_is_part_of_the_layout() -> None:
    mesh = DeviceMesh.cpu(2, "cp")
    cp = context_parallel(mesh)
    x = torch.randn(2, 7, 4)
    held, plain = cp.shard(x, 1), context_parallel(mesh, load_balance=False).shard(x, 1)
    assert held.dist_layout != plain.dist_layout and held.placements == plain.placements
    assert held.dist_layout.orders == (SequenceOrder(1, 7, 2),)
    assert str(held.dist_layout).endswith("order 1:ht7/2") and not plain.dist_layout.orders
    assert held.dist_layout.with_orders(()) == plain.dist_layout
    assert hash(held.dist_layout.with_orders(())) == hash(plain.dist_layout)
    assert torch.equal(held.to_torch(), x) and torch.equal(plain.to_torch(), x)
    # the held blocks differ (head-tail vs natural), the values do not
    assert not torch.equal(held.shards[1], plain.shards[1])
    assert torch.equal((held * 2).to_torch(), (plain * 2).to_torch())
    with CommCounter() as cc:   # back to natural order: one gather of the sequence
        natural = held.relayout(plain.dist_layout)
    assert dict(cc.counts) == {"all_gather": 1} and torch.equal(natural.shards[1],
                                                               plain.shards[1])
    gathered = sw.all_gather(held, 1)    # a gathered dim is held in natural order
    assert not gathered.dist_layout.orders and torch.equal(gathered.shards[0], x)
    # the SPMD collectives on blocks see the natural order's blocks, or keep the order
    grid = DeviceMesh.cpu((2, 2), ("cp", "tp"))
    x8 = torch.randn(2, 8, 4)
    on_grid = context_parallel(grid).shard(x8, 1)
    part = on_grid.relayout(on_grid.dist_layout.with_partial((None, sw.ReduceOp.SUM)))
    summed = sw.all_reduce(part, reduce_axes="tp")
    assert summed.dist_layout.orders and torch.allclose(summed.to_torch(), x8)
    nat = sw.tensor(x8, sharding=PlacementMapping(grid, [Sharded(1), sw.Replicated()]))
    for op in (lambda v: sw.all_reduce(v, reduce_axes="cp"),
               lambda v: sw.ppermute(v, [(0, 1), (1, 0)], "cp")):
        assert torch.equal(op(on_grid).to_torch(), op(nat).to_torch())
    with pytest.raises(ShardingError, match="SequenceOrders on distinct dims"):
        Layout(mesh, ((), (0,)), (None,), (SequenceOrder(1, 7, 2), SequenceOrder(1, 7, 2)))
    with pytest.raises(ShardingError, match=r"SequenceOrder\.parts"):
        SequenceOrder(0, 4, 0)
    for length, parts, inner in [(7, 2, 1), (13, 4, 3), (1, 4, 1), (16, 4, 2)]:
        o = SequenceOrder(0, length, parts, inner)
        for size in (length * inner, 3 * length * inner):
            assert sorted(o.positions(size)) == list(range(size))


def test_gpt_on_dp_cp_tp_matches_torch() -> None:
    cp_bodies.gpt_trains_like_torch(8)


def test_gpt_alltoall_on_dp_cp_tp_matches_torch() -> None:
    cp_bodies.gpt_trains_alltoall(8)


def test_head_tail_order() -> None:
    from shardwise.parallel.context_attention import sequence_order

    assert sequence_order(16, 4, True) == (0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11,
                                           6, 7, 8, 9)
    for length in range(0, 23):
        for n in (1, 2, 3, 4):
            order = sequence_order(length, n, True)
            assert sorted(order) == list(range(length))


def test_only_the_region_routes() -> None:
    mesh = DeviceMesh.cpu(2, "cp")
    cp = context_parallel(mesh)
    q = cp.shard(torch.randn(1, 2, 8, 4), 2)
    with CommCounter() as outside:
        F.scaled_dot_product_attention(q, q, q)     # the ordinary rule: k, v gathered
    assert "all_gather" in outside.counts and "ppermute" not in outside.counts
    with cp, CommCounter() as inside:
        F.scaled_dot_product_attention(q, q, q)
        plain = sw.tensor(torch.randn(1, 2, 8, 4), sharding=PlacementMapping(mesh, [Sharded(0)]))
        F.scaled_dot_product_attention(plain, plain, plain)  # not sequence-sharded
    assert dict(inside.counts) == {"ppermute": 1}


def test_plan_style_marks_only_its_module() -> None:
    mesh = DeviceMesh.cpu(2, "cp")
    cp = context_parallel(mesh)

    class Attend(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    model = nn.ModuleDict({"a": Attend(), "b": Attend()})
    parallelize_module(model, mesh, {"a": cp}, axis="cp")
    x = cp.shard(torch.randn(1, 2, 8, 4), 2)
    with CommCounter() as marked:
        model["a"](x)
    with CommCounter() as unmarked:
        model["b"](x)
    assert dict(marked.counts) == {"ppermute": 1}
    assert "ppermute" not in unmarked.counts
    with pytest.raises(ShardingError, match="axis='cp'"):
        parallelize_module(nn.ModuleDict({"a": Attend()}),
                           DeviceMesh.cpu((2, 2), ("dp", "sp")), {"a": ContextParallel()},
                           axis="sp")


def _qkv(heads: int = 4, length: int = 8) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, heads, length, 4) for _ in range(3))


def test_bad_input_names_the_fix() -> None:
    mesh = DeviceMesh.cpu(4, "cp")
    ulysses = context_parallel(mesh, method="alltoall")
    q, k, v = (ulysses.shard(t, 2) for t in _qkv(heads=6))
    with ulysses, pytest.raises(ShardingError, match=r"divide by its size 4.*method='ring'"):
        F.scaled_dot_product_attention(q, k, v)
    cp = context_parallel(mesh)
    q, k, v = (cp.shard(t, 2) for t in _qkv())
    with cp:
        with pytest.raises(ShardingError, match=r"attn_mask of shape \[8, 5\].*cp.shard"):
            F.scaled_dot_product_attention(q, k, v, torch.ones(8, 5, dtype=torch.bool))
        with pytest.raises(ShardingError, match=r"dropout_p=0\.0"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        with pytest.raises(ShardingError, match="is_causal"):
            F.scaled_dot_product_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool),
                                           is_causal=True)
        k2 = cp.shard(torch.randn(1, 3, 8, 4), 2)
        with pytest.raises(ShardingError, match="enable_gqa=True"):
            F.scaled_dot_product_attention(q, k2, k2)
    with pytest.raises(ShardingError, match=r"'ring'.*'alltoall'"):
        context_parallel(mesh, method="ulysses")
    with pytest.raises(ShardingError, match="axis='sp'"):
        context_parallel(mesh, axis="sp")
    data = PlacementMapping(DeviceMesh.cpu((2, 2), ("dp", "cp")), (Sharded(1), Sharded(1)))
    with pytest.raises(ShardingError, match="over 'cp' alone"):
        context_parallel(DeviceMesh.cpu((2, 2), ("dp", "cp"))).shard(torch.zeros(2, 8), 1,
                                                                      data)
