"""The program position (runtime/position.py) on the simulated runtime: what the styles'
hooks, FSDP units and the dispatch set, and that each restores what it found."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated
from shardwise.parallel import ColwiseParallel, fully_shard, parallelize_module
from shardwise.parallel.fsdp_unit import UNIT
from shardwise.runtime import position
from shardwise.runtime.position import HERE
from shardwise.runtime.process import diagnose
from tests.helpers.position_faults import Net, plan


def test_sites_are_interned_and_their_codes_differ() -> None:
    a = position.site("layers.0.mlp.fc1", "ColwiseParallel linear")
    assert a is position.site("layers.0.mlp.fc1", "ColwiseParallel linear")
    others = [position.site("layers.0.mlp.fc1", "RowwiseParallel linear"),
              position.site("layers.0.mlp.fc2", "ColwiseParallel linear"),
              position.backward_of(a), position.ROOT]
    assert len({a.code, *(o.code for o in others)}) == 5


def test_the_code_joins_site_and_op() -> None:
    base = position.code()
    with position.issuing("output"):
        out = position.code()
        with position.at(position.site("fc1", "ColwiseParallel linear")):
            both = position.code()
            assert position.text() == "fc1 (ColwiseParallel linear) in output"
    assert len({base, out, both}) == 3
    assert position.code() == base and position.current() == (position.ROOT, None)


def test_a_dispatched_op_is_the_op_and_is_restored() -> None:
    mesh = DeviceMesh.cpu(2, "tp")
    x = sw.tensor(torch.ones(4), sharding=PlacementMapping(mesh, [Replicated()]))
    seen = []
    y = x + 1
    seen.append(HERE.op)
    assert torch.equal(y.to_torch(), torch.full((4,), 2.0))
    assert seen == [None]


def test_a_styled_module_runs_at_its_path_and_style() -> None:
    torch.manual_seed(0)
    model = Net(8)
    parallelize_module(model, DeviceMesh.cpu(2, "tp"), plan(False))
    inside: list[str] = []
    model.layers[1].mlp.fc2.register_forward_pre_hook(  # after the style's own
        lambda m, a: inside.append(position.text()))
    model(torch.randn(3, 8))
    assert inside == ["layers.1.mlp.fc2 (RowwiseParallel linear)"]
    assert position.current() == (position.ROOT, None) and not HERE.stack


def test_a_forward_that_raises_leaves_the_position_as_it_found_it() -> None:
    lin = parallelize_module(nn.Linear(4, 6), DeviceMesh.cpu(2, "tp"), ColwiseParallel())
    with pytest.raises(sw.ShardingError, match="do not fit the rule"):
        lin(torch.ones(3, 5))  # wrong width: an error inside the forward
    assert position.current() == (position.ROOT, None) and not HERE.stack


def test_fsdp_units_are_named_from_the_root() -> None:
    mesh = DeviceMesh.cpu(2, "dp")
    model = Net(4)
    for layer in model.layers:
        fully_shard(layer, mesh)
    fully_shard(model, mesh)
    names = [getattr(m, UNIT).site for m in (model.layers[0], model.layers[1], model)]
    assert [str(s) for s in names] == ["layers.0 (fully_shard)", "layers.1 (fully_shard)",
                                       "the top level (fully_shard)"]
    inside: list[str] = []
    model.layers[1].mlp.register_forward_hook(lambda m, a, o: inside.append(position.text()))
    x = sw.tensor(torch.ones(2, 4), sharding=PlacementMapping(mesh, [sw.Sharded(0)]))
    model(x).sum().backward()
    assert inside == ["layers.1 (fully_shard)"]
    assert position.current() == (position.ROOT, None) and not HERE.stack


class _Ch:
    ranks = (0, 1, 2)


def test_the_mismatch_names_each_ranks_position(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose.dist, "get_rank", lambda: 1)
    mine = {"collective": "all_reduce", diagnose.POSITION: "fc1 (RowwiseParallel linear)"}
    theirs = {"collective": "all_reduce", diagnose.POSITION: "fc2 (RowwiseParallel linear)"}
    views = {0: {"seq": "3", **theirs}, 1: {"seq": "3", **mine}, 2: {"seq": "3", **theirs}}
    text = diagnose._mismatch_text(_Ch(), "tp", "all_reduce",
                                   ["collective", diagnose.POSITION], views)
    assert ("They disagree on the program position: rank 1 issued all_reduce at fc1 "
            "(RowwiseParallel linear), where ranks 0, 2 issued all_reduce at fc2 "
            "(RowwiseParallel linear).") in text, text
