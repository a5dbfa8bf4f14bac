"""Plans of ``shard`` / ``shardwise.plan``: collective counts, direct steps, printing, caching."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import (
    DeviceMesh,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
)
from tests.helpers.meshes import M4, M22
from tests.helpers.shardcheck import global_of, ints


def kinds(plan: sw.Plan) -> list[str]:
    return [s.kind for s in plan.steps]


def on(mesh: DeviceMesh, *placements) -> PlacementMapping:
    return PlacementMapping(mesh, list(placements))


SHAPES = [(8, 8), (5, 7), (2, 3), (0, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sharded_to_sharded_is_one_all_to_all(shape: tuple) -> None:
    x = sw.tensor(ints(shape), sharding=on(M4, Sharded(0)))
    p = sw.plan(x, on(M4, Sharded(1)))
    assert kinds(p) == ["all_to_all"]
    assert [s.kind for s in p.collectives] == ["all_to_all"]
    step = p.steps[0]
    assert (step.dim, step.dim2, step.axis_names) == (0, 1, ("x",))
    assert torch.equal(global_of(sw.shard(x, M4, on(M4, Sharded(1)))), ints(shape))


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_partial_to_sharded_is_one_reduce_scatter(shape: tuple, op: ReduceOp) -> None:
    x = sw.tensor(ints(shape), sharding=on(M4, Partial(op)))
    p = sw.plan(x, on(M4, Sharded(0)))
    assert kinds(p) == ["reduce_scatter"]
    assert p.steps[0].reduce_op is op and p.steps[0].dim == 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_replicated_to_sharded_is_a_local_slice(shape: tuple) -> None:
    x = sw.tensor(ints(shape), sharding=on(M22, Replicated(), Replicated()))
    p = sw.plan(x, on(M22, Sharded(0), Sharded(1)))
    assert p.collectives == ()
    assert set(kinds(p)) == {"slice"}
    assert p.bytes_per_device == 0
    y = sw.shard(x, M22, on(M22, Sharded(0), Sharded(1)))
    buf = x.shards[0].untyped_storage().data_ptr()
    assert all(s.untyped_storage().data_ptr() == buf for s in y.shards)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sharded_to_replicated_is_one_all_gather(shape: tuple) -> None:
    x = sw.tensor(ints(shape), sharding=NamedMapping(M22, (("dp", "tp"), None)))
    p = sw.plan(x, on(M22, Replicated(), Replicated()))
    assert kinds(p) == ["all_gather"]
    assert p.steps[0].axis_names == ("dp", "tp")  # one collective over the product group


@pytest.mark.parametrize("op", list(ReduceOp))
def test_partial_to_replicated_is_one_all_reduce(op: ReduceOp) -> None:
    x = sw.tensor(ints((4, 4)), sharding=on(M22, Partial(op), Partial(op)))
    p = sw.plan(x, on(M22, Replicated(), Replicated()))
    assert kinds(p) == ["all_reduce"]
    assert p.steps[0].reduce_op is op and p.steps[0].axis_names == ("dp", "tp")


def test_no_gather_then_slice_when_a_direct_step_exists() -> None:
    x = sw.tensor(ints((8, 8)), sharding=on(M22, Sharded(0), Sharded(1)))
    cases = [
        # dp leaves dim 0 and goes minor-most on dim 1: one all_to_all
        (NamedMapping(M22, (None, ("tp", "dp"))), ["all_to_all"]),
        (on(M22, Sharded(0), Sharded(0)), ["all_to_all"]),  # tp joins dim 0 after dp
        (on(M22, Sharded(0), Replicated()), ["all_gather"]),
        (on(M22, Replicated(), Replicated()), ["all_gather", "all_gather"]),
        (on(M22, Sharded(0), Sharded(1)), []),
    ]
    for target, want in cases:
        p = sw.plan(x, target)
        assert kinds(p) == want, (target, str(p))
        seen_gather = False
        for s in p.steps:
            seen_gather |= s.kind == "all_gather"
            assert not (seen_gather and s.kind == "slice"), str(p)


def test_all_to_all_runs_before_slices_and_slices_before_reductions() -> None:
    """Planner order: all_to_all first, then slices (shrinking data), then the
    Partial resolution on the smaller data."""
    layout = sw.sharding.Layout(M22, ((1,), ()), (ReduceOp.SUM, None))
    x = sw.tensor(ints((8, 8)), sharding=layout)
    target = sw.sharding.Layout(M22, ((), (1, 0)), (None, None))
    p = sw.plan(x, target)
    assert kinds(p) == ["all_to_all", "reduce_scatter"]
    y = sw.shard(x, M22, target)
    assert torch.equal(global_of(y), ints((8, 8)))


def test_uneven_pieces_that_do_not_nest_gather_whole_then_slice() -> None:
    """6 rows: 2-way [3, 3] does not nest in 4-way [2, 2, 1, 1]."""
    x = sw.tensor(ints((6, 2)), sharding=on(M22, Sharded(0), Replicated()))
    target = on(M22, Sharded(0), Sharded(0))
    p = sw.plan(x, target)
    assert kinds(p) == ["all_gather", "slice"]
    assert torch.equal(global_of(sw.shard(x, M22, target)), ints((6, 2)))
    # 8 rows nest: a slice alone
    y = sw.tensor(ints((8, 2)), sharding=on(M22, Sharded(0), Replicated()))
    assert kinds(sw.plan(y, target)) == ["slice"]


def test_bytes_per_device() -> None:
    x = sw.tensor(torch.zeros(8, 8), sharding=on(M4, Sharded(0)))
    a2a = sw.plan(x, on(M4, Sharded(1)))
    assert a2a.bytes_per_device == 2 * 8 * 4 * 3 // 4  # block bytes * (n-1)/n
    gather = sw.plan(x, on(M4, Replicated()))
    assert gather.bytes_per_device == 8 * 8 * 4 * 3 // 4
    p = sw.tensor(torch.zeros(8, 8), sharding=on(M4, Partial()))
    assert sw.plan(p, on(M4, Replicated())).bytes_per_device == 2 * 8 * 8 * 4 * 3 // 4
    assert sw.plan(p, on(M4, Sharded(0))).bytes_per_device == 8 * 8 * 4 * 3 // 4
    assert sw.plan(x, on(M4, Sharded(0))).bytes_per_device == 0


def test_plan_printing_shows_ops_axes_and_bytes() -> None:
    x = sw.tensor(torch.zeros(8, 8), sharding=on(M4, Sharded(0)))
    text = str(sw.plan(x, on(M4, Sharded(1))))
    assert "all_to_all" in text and "('x',)" in text and "dim 0->1" in text
    assert "48 B/device" in text and "total 48 B/device" in text
    big = sw.tensor(torch.zeros(256, 256), sharding=on(M22, Partial(ReduceOp.MAX), Sharded(1)))
    text = str(sw.plan(big, on(M22, Replicated(), Replicated())))
    assert "all_reduce" in text and "op=max" in text and "all_gather" in text
    assert "KiB/device" in text
    same = str(sw.plan(x, on(M4, Sharded(0))))
    assert "no steps" in same
    assert len(sw.plan(x, on(M4, Sharded(0)))) == 0


def test_plans_are_cached() -> None:
    x = sw.tensor(ints((8, 8)), sharding=on(M22, Sharded(0), Sharded(1)))
    y = sw.tensor(ints((8, 8), 1), sharding=on(M22, Sharded(0), Sharded(1)))
    target = on(M22, Sharded(1), Replicated())
    p = sw.plan(x, target)
    assert sw.plan(x, target) is p
    assert sw.plan(y, NamedMapping(M22, ("tp", "dp"))) is not p
    assert sw.plan(y, target) is p  # same layouts, shape and dtype size
    assert sw.plan(y, NamedMapping(M22, (None, "dp"))) is p
    z = sw.tensor(ints((8, 8)).double(), sharding=on(M22, Sharded(0), Sharded(1)))
    assert sw.plan(z, target) is not p


def test_plan_does_not_run_anything() -> None:
    x = sw.tensor(ints((4, 4)), sharding=on(M22, Partial(), Sharded(1)))
    before = [s.clone() for s in x.shards]
    p = sw.plan(x, on(M22, Replicated(), Replicated()))
    assert p.steps and all(torch.equal(a, b) for a, b in zip(x.shards, before, strict=True))
    assert p.src == x.dist_layout
