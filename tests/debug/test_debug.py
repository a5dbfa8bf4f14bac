"""visualize draws every device once per block; CommCounter counts by kind."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter, visualize


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.mark.parametrize("shape,names", [((4,), ("x",)), ((2, 2), ("dp", "tp")),
                                         ((2, 2, 2), ("a", "b", "c"))])
def test_every_device_appears_once(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = DeviceMesh.cpu(shape, names)
    placements = [Sharded(0)] + [Replicated()] * (len(shape) - 1)
    for tshape in [(8,), (8, 6)]:
        t = sw.zeros(tshape, sharding=PlacementMapping(mesh, placements))
        text = visualize(t, console=_quiet(), color=False)
        ids = [int(i) for cell in re.findall(r"CPU ([\d, ]+)", text)
               for i in cell.replace(" ", "").split(",") if i]
        assert sorted(ids) == list(range(mesh.num_devices)), text


def test_2d_grid_shows_block_ranges() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    t = sw.zeros((4, 6), sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    text = visualize(t, console=_quiet(), color=False)
    for block in ("[0:2, 0:3]", "[0:2, 3:6]", "[2:4, 0:3]", "[2:4, 3:6]"):
        assert block in text, text
    assert "S(dp), S(tp)" in text


def test_partial_and_uneven_are_labelled() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    t = sw.zeros((5,), sharding=PlacementMapping(mesh, [Partial(), Sharded(0)]))
    text = visualize(t, console=_quiet(), color=False)
    assert "partial dp:sum" in text
    assert "[0:3]" in text and "[3:5]" in text


def test_rank3_lists_blocks() -> None:
    mesh = DeviceMesh.cpu((2,), ("x",))
    t = sw.zeros((2, 3, 4), sharding=PlacementMapping(mesh, [Sharded(2)]))
    text = visualize(t, console=_quiet(), color=False)
    assert "[0:2, 0:3, 0:2]" in text and "[0:2, 0:3, 2:4]" in text


def test_comm_counter_counts_by_kind_and_bytes() -> None:
    mesh = DeviceMesh.cpu((4,), ("x",))
    t = sw.tensor(torch.ones(8, 8), sharding=PlacementMapping(mesh, [Sharded(0)]))
    with CommCounter() as cc:
        sw.all_gather(t)
        sw.all_to_all(t, 1, 0)
        sw.shard(sw.all_gather(t), dim_specs=PlacementMapping(mesh, [Sharded(1)]))
    assert dict(cc.counts) == {"all_gather": 2, "all_to_all": 1}
    assert cc.bytes["all_gather"] == 2 * (8 * 8 * 4 * 3 // 4)
    assert cc.total == 3
    # planner step kinds (a str Enum) are counted under their plain names
    assert all(type(k) is str for k in cc.counts) and "StepKind" not in repr(cc)
    assert repr(cc).startswith("CommCounter(all_gather: 2")
    with CommCounter() as empty:
        pass
    assert empty.total == 0 and "no collectives" in repr(empty)
