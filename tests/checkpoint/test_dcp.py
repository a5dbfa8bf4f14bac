"""torch.distributed.checkpoint on shardwise Tensors in one process (simulated meshes):
blocks saved as chunks with global offsets, replicas once, loaded in place into any
mesh and layout."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import M3 as M1
from tests.helpers.meshes import M22, M24

R = Replicated()


def value(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
          ) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + seed).to(dtype)


def on(g: torch.Tensor, mesh: DeviceMesh, *placements: Any) -> sw.Tensor:
    return sw.tensor(g.clone(), sharding=PlacementMapping(mesh, list(placements)))


def zeros(shape: tuple[int, ...], mesh: DeviceMesh, *placements: Any,
          dtype: torch.dtype = torch.float32) -> sw.Tensor:
    return sw.zeros(shape, dtype=dtype, sharding=PlacementMapping(mesh, list(placements)))


def save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():  # "no process group: saving in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path)


def load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path)


SOURCES = [  # (shape, mesh, placements)
    ((7, 5), M22, (Sharded(0), Sharded(1))),
    ((7, 5), M22, (Sharded(1), R)),
    ((7, 5), M24, (Sharded(1), Sharded(0))),
    ((7, 5), M1, (Sharded(0),)),
    ((3,), M24, (Sharded(0), Sharded(0))),     # 3 rows over 8 devices: empty blocks
    ((0, 5), M22, (Sharded(0), R)),            # size 0
    ((4, 6), M1, (R,)),
]
TARGETS = [
    (M1, (Sharded(1),)), (M22, (Sharded(1), Sharded(0))), (M24, (R, Sharded(1))),
    (M24, (Sharded(0), R)), (M1, (R,)),
]


@pytest.mark.parametrize("source", range(len(SOURCES)))
def test_save_then_load_into_every_layout(tmp_path: Path, source: int) -> None:
    shape, mesh, placements = SOURCES[source]
    g = value(shape)
    save({"w": on(g, mesh, *placements)}, tmp_path)
    for tmesh, tplace in TARGETS:
        target = zeros(shape, tmesh, *[p if not isinstance(p, Sharded) or p.axis < len(shape)
                                       else R for p in tplace])
        before = [s.data_ptr() for s in target.shards]
        state = {"w": target}
        load(state, tmp_path)
        assert state["w"] is target
        assert [s.data_ptr() for s in target.shards] == before  # filled in place
        assert torch.equal(target.to_torch(), g), (tmesh, tplace)


def test_chunks_are_the_blocks_with_global_offsets_and_replicas_once(tmp_path: Path) -> None:
    save({"a": on(value((7, 5)), M22, Sharded(0), Sharded(1)),
          "b": on(value((7, 5)), M24, R, Sharded(1)),
          "c": on(value((3,)), M24, Sharded(0), Sharded(0))}, tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata

    def chunks(key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md[key].chunks)  # type: ignore[union-attr]

    assert chunks("a") == [((0, 0), (4, 3)), ((0, 3), (4, 2)), ((4, 0), (3, 3)),
                           ((4, 3), (3, 2))]
    # 8 devices, 4 distinct blocks along tp (5 columns: 2,1,1,1): each written once
    assert chunks("b") == [((0, 0), (7, 2)), ((0, 2), (7, 1)), ((0, 3), (7, 1)),
                           ((0, 4), (7, 1))]
    assert chunks("c") == [((0,), (1,)), ((1,), (1,)), ((2,), (1,))]  # empty blocks skipped


def test_nested_state_with_plain_values_and_dtypes(tmp_path: Path) -> None:
    bf = value((4, 6), torch.bfloat16)
    ints = torch.arange(10)
    save({"model": {"w": on(bf, M22, Sharded(1), Sharded(0)), "n": on(ints, M1, Sharded(0))},
          "plain": torch.ones(3), "step": 5, "names": ["a", "b"]}, tmp_path)
    state: dict[str, Any] = {
        "model": {"w": zeros((4, 6), M24, Sharded(0), R, dtype=torch.bfloat16),
                  "n": zeros((10,), M22, R, Sharded(0), dtype=torch.int64)},
        "plain": torch.zeros(3), "step": 0, "names": []}
    load(state, tmp_path)
    assert torch.equal(state["model"]["w"].to_torch(), bf)
    assert torch.equal(state["model"]["n"].to_torch(), ints)
    assert torch.equal(state["plain"], torch.ones(3))
    assert state["step"] == 5 and state["names"] == ["a", "b"]


def test_load_writes_the_blocks_a_whole_value_shares(tmp_path: Path) -> None:
    """A Tensor made from a whole value keeps it for elementwise ops: a load must
    reach that value too (its blocks are views of it)."""
    g = value((6, 4))
    save({"w": on(g, M22, Sharded(0), R)}, tmp_path)
    target = sw.tensor(torch.zeros(6, 4), sharding=PlacementMapping(M22, [R, Sharded(1)]))
    load({"w": target}, tmp_path)
    assert torch.equal((target + 1).to_torch(), g + 1)
    assert torch.equal(target.to_torch(), g)


def test_replicas_with_separate_buffers_are_each_filled(tmp_path: Path) -> None:
    g = value((4,))
    save({"w": on(g, M1, Sharded(0))}, tmp_path)
    mesh = DeviceMesh.cpu(2, "x")
    target = sw.from_local([torch.zeros(4), torch.zeros(4)], PlacementMapping(mesh, [R]))
    load({"w": target}, tmp_path)
    assert all(torch.equal(s, g) for s in target.shards)


def test_parameters_that_require_grad_load_in_place(tmp_path: Path) -> None:
    w = torch.nn.Parameter(on(value((4, 4)), M22, R, Sharded(0)))
    save({"w": w}, tmp_path)
    target = torch.nn.Parameter(zeros((4, 4), M1, Sharded(1)))
    load({"w": target}, tmp_path)
    assert target.requires_grad and target.is_leaf
    assert torch.equal(target.to_torch().detach(), value((4, 4)))


def test_partial_is_refused_both_ways(tmp_path: Path) -> None:
    p = on(value((4,)), M22, Partial(), R)
    with pytest.raises(BaseException, match="Partial axes hold addends"):
        save({"p": p}, tmp_path / "a")
    save({"p": on(value((4,)), M1, R)}, tmp_path / "b")
    with pytest.raises(BaseException, match="Partial axes hold addends"):
        load({"p": zeros((4,), M22, Partial(), R)}, tmp_path / "b")


def test_async_save_stages_a_copy(tmp_path: Path) -> None:
    g = value((7, 5))
    x = on(g, M22, Sharded(0), Sharded(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        future = dcp.async_save({"x": x}, checkpoint_id=tmp_path)
        x.add_(100.0)  # after staging: the checkpoint keeps the staged values
        future.result()
    target = zeros((7, 5), M1, Sharded(1))
    load({"x": target}, tmp_path)
    assert torch.equal(target.to_torch(), g)
    assert torch.equal(x.to_torch(), g + 100)


def test_a_tensor_is_never_pickled() -> None:
    import pickle

    with pytest.raises(sw.ShardingError, match=r"cannot be pickled.*shardwise\.checkpoint"):
        pickle.dumps(on(value((2,)), M1, R))
