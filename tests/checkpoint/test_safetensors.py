"""save_safetensors/load_safetensors on simulated meshes: one consolidated file of global
tensors that any safetensors reader takes, written by offsets, read by slices."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.checkpoint import CheckpointError
from tests.helpers.meshes import M3, M22, M24

R = Replicated()


def on(g: torch.Tensor, mesh: DeviceMesh, *placements: Any) -> sw.Tensor:
    return sw.tensor(g.clone(), sharding=PlacementMapping(mesh, list(placements)))


VALUES = {
    "a": torch.arange(35.).reshape(7, 5),
    "b": torch.arange(24).reshape(4, 6).to(torch.bfloat16),
    "c": torch.arange(3, dtype=torch.int64),
    "e": torch.zeros(0, 5),
    "s": torch.tensor(2.5),
    "m": torch.tensor([True, False, True]),
}


def sharded_state() -> dict[str, Any]:
    return {"a": on(VALUES["a"], M22, Sharded(0), Sharded(1)),
            "layer": {"b": on(VALUES["b"], M24, Sharded(1), Sharded(0))},
            "c": on(VALUES["c"], M24, Sharded(0), Sharded(0)),  # empty blocks
            "e": on(VALUES["e"], M22, Sharded(0), R),
            "s": torch.tensor(2.5),                               # plain, 0-d
            "m": on(VALUES["m"], M3, R)}


def test_the_file_holds_global_tensors_any_reader_takes(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    sw.checkpoint.save_safetensors(sharded_state(), f, metadata={"format": "pt"})
    loaded = safetensors.torch.load_file(f)
    assert sorted(loaded) == ["a", "c", "e", "layer.b", "m", "s"]
    for name, g in VALUES.items():
        got = loaded["layer.b" if name == "b" else name]
        assert got.dtype == g.dtype and torch.equal(got, g), name
    head = f.read_bytes()
    n = struct.unpack("<Q", head[:8])[0]
    meta = json.loads(head[8:8 + n])["__metadata__"]
    assert n % 8 == 0 and meta.pop("format") == "pt"
    assert meta.pop("shardwise.checksum") == "crc32"  # the algorithm of the tensors' sums
    crcs = {k.removeprefix("shardwise.crc32."): int(v, 16) for k, v in meta.items()
            if k.startswith("shardwise.crc32.")}  # a CRC-32 per tensor, and the header's
    assert sorted(meta) == ["shardwise.crc32", *(f"shardwise.crc32.{k}" for k in sorted(crcs))]
    assert crcs == {k: zlib.crc32(v.reshape(-1).view(torch.uint8).numpy().tobytes())
                    for k, v in loaded.items()}
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("mesh, place", [(M3, Sharded(1)), (M24, Sharded(0)), (M22, R)])
def test_load_fills_sharded_targets_in_place(tmp_path: Path, mesh: DeviceMesh,
                                             place: Any) -> None:
    f = tmp_path / "w.safetensors"
    safetensors.torch.save_file({k: v for k, v in VALUES.items() if k != "b"}, f)
    pl = [place] + [R] * (mesh.ndim - 1)
    targets = {"a": sw.zeros((7, 5), sharding=PlacementMapping(mesh, pl)),
               "c": sw.zeros(3, dtype=torch.int64, sharding=PlacementMapping(
                   mesh, [Sharded(0) if isinstance(place, Sharded) else R, *pl[1:]])),
               "e": sw.zeros((0, 5), sharding=PlacementMapping(mesh, pl)),
               "s": torch.tensor(0.0)}
    before = [s.data_ptr() for s in targets["a"].shards]
    assert sw.checkpoint.load_safetensors(f, targets) == []
    assert [s.data_ptr() for s in targets["a"].shards] == before
    for name in ("a", "c", "e"):
        assert torch.equal(targets[name].to_torch(), VALUES[name]), name
    assert float(targets["s"]) == 2.5


def test_load_reads_only_each_blocks_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """Each block is copied from its own slice of the memory-mapped file: no buffer
    of the whole tensor, nothing copied twice."""
    from shardwise.checkpoint import safetensors_io

    f = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": VALUES["a"]}, f)
    read: list[tuple[int, ...]] = []
    cut = safetensors_io._slice

    def spy(source: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
        assert tuple(source.shape) == (7, 5)  # the file's tensor, viewed in place
        out = cut(source, offsets, sizes)
        read.append(tuple(out.shape))
        return out

    monkeypatch.setattr(safetensors_io, "_slice", spy)
    t = sw.zeros((7, 5), sharding=PlacementMapping(M24, [Sharded(0), Sharded(1)]))
    sw.checkpoint.load_safetensors(f, {"a": t})
    assert sorted(read) == sorted([(4, 2), (4, 1), (4, 1), (4, 1), (3, 2), (3, 1), (3, 1),
                                   (3, 1)])
    assert torch.equal(t.to_torch(), VALUES["a"])


def test_a_misaligned_tensor_loads_through_safetensors(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor whose bytes do not start at a multiple of its element size (legal in
    the format) is read through safetensors' slices instead of a view."""
    from shardwise.checkpoint import safetensors_io

    through: list[str] = []
    load_one = safetensors_io._load_one

    def spy(f: Any, name: str, *rest: Any) -> None:
        through.append(name)
        load_one(f, name, *rest)

    monkeypatch.setattr(safetensors_io, "_load_one", spy)
    a, b = torch.arange(3, dtype=torch.float16), torch.arange(10.).reshape(2, 5)
    head = {"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
            "b": {"dtype": "F32", "shape": [2, 5], "data_offsets": [6, 46]}}
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    f = tmp_path / "odd.safetensors"
    f.write_bytes(struct.pack("<Q", len(text)) + text + a.numpy().tobytes()
                  + b.numpy().tobytes())
    t = {"a": torch.zeros(3, dtype=torch.float16),
         "b": sw.zeros((2, 5), sharding=PlacementMapping(M3, [Sharded(1)]))}
    assert sw.checkpoint.load_safetensors(f, t) == []
    assert torch.equal(t["a"], a) and torch.equal(t["b"].to_torch(), b)
    assert through == ["b"]


def test_errors_name_the_key(tmp_path: Path) -> None:
    f = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": VALUES["a"]}, f)
    with pytest.raises(CheckpointError, match=r"Key 'a'.*\(7, 5\) F32.*\(7, 4\)"):
        sw.checkpoint.load_safetensors(f, {"a": sw.zeros((7, 4))})
    with pytest.raises(CheckpointError, match=r"Key 'a'.*float64.*cast=True"):
        sw.checkpoint.load_safetensors(f, {"a": sw.zeros((7, 5), dtype=torch.float64)})
    with pytest.raises(CheckpointError, match=r"Key 'zz' is not in"):
        sw.checkpoint.load_safetensors(f, {"zz": torch.zeros(1)})
    assert sw.checkpoint.load_safetensors(f, {"zz": torch.zeros(1)}, strict=False) == ["zz"]
    t = sw.zeros((7, 5), dtype=torch.float64, sharding=PlacementMapping(M3, [Sharded(0)]))
    sw.checkpoint.load_safetensors(f, {"a": t}, cast=True)
    assert torch.equal(t.to_torch(), VALUES["a"].double())
    with pytest.raises(CheckpointError, match=r"Key 'n' holds a int"):
        sw.checkpoint.save_safetensors({"n": 3}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match=r"Key 'p'.*Partial"):
        sw.checkpoint.save_safetensors({"p": on(VALUES["a"], M22, sw.Partial(), R)},
                                       tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="No safetensors file"):
        sw.checkpoint.load_safetensors(tmp_path / "none.safetensors", {})


def test_a_model_round_trips_through_hf_style_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 4))
    f = tmp_path / "model.safetensors"
    safetensors.torch.save_file(plain.state_dict(), f)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 4))
    for mod, dim in ((model[0], 0), (model[2], 1)):
        mod.weight = torch.nn.Parameter(sw.zeros(tuple(mod.weight.shape), sharding=(
            PlacementMapping(M22, [R, Sharded(dim)]))))
    sw.checkpoint.load_safetensors(f, model.state_dict(keep_vars=True))
    x = torch.randn(3, 6)
    assert torch.allclose(model(x).to_torch(), plain(x), atol=1e-6)
    sw.checkpoint.save_safetensors(model.state_dict(), tmp_path / "again.safetensors")
    again = safetensors.torch.load_file(tmp_path / "again.safetensors")
    assert all(torch.equal(again[k], v) for k, v in plain.state_dict().items())
