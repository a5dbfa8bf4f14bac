"""shardwise.checkpoint.save/load: atomic publish, a failed save keeps the last good
checkpoint, mismatches and damage raise naming the key, nothing unsafe is unpickled."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.checkpoint import CheckpointError
from tests.helpers.meshes import M3, M22

R = Replicated()


def state(seed: float) -> dict[str, Any]:
    g = torch.arange(35.).reshape(7, 5) + seed
    return {"w": sw.tensor(g, sharding=PlacementMapping(M22, [Sharded(0), Sharded(1)])),
            "opt": {"step": int(seed), "m": torch.full((3,), seed)}}


def target() -> dict[str, Any]:
    return {"w": sw.zeros((7, 5), sharding=PlacementMapping(M3, [Sharded(1)])),
            "opt": {"step": -1, "m": torch.zeros(3)}}


def test_save_publishes_only_the_finished_directory(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sw.checkpoint.save(state(1.0), path)
    sw.checkpoint.save(state(2.0), path)  # replaces the first
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    t = target()
    sw.checkpoint.load(t, path)
    assert torch.equal(t["w"].to_torch(), torch.arange(35.).reshape(7, 5) + 2)
    assert t["opt"]["step"] == 2 and torch.equal(t["opt"]["m"], torch.full((3,), 2.0))


def test_a_failure_mid_save_keeps_the_last_good_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    sw.checkpoint.save(state(1.0), path)
    calls = []

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        calls.append(plan)
        (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")  # a torn write
        raise OSError("No space left on device (injected)")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing_write)
    with pytest.raises(CheckpointError, match=r"No space left.*last complete checkpoint"):
        sw.checkpoint.save(state(2.0), path)
    assert calls
    monkeypatch.undo()
    t = target()
    sw.checkpoint.load(t, path)
    assert torch.equal(t["w"].to_torch(), torch.arange(35.).reshape(7, 5) + 1)
    sw.checkpoint.save(state(3.0), path)  # the next save clears the unfinished one
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_crash_between_the_renames_loads_the_previous_checkpoint_with_a_warning(
        tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sw.checkpoint.save(state(1.0), path)
    os.replace(path, tmp_path / "ckpt.old")  # the new one not yet in place
    t = target()
    with pytest.warns(sw.checkpoint.CheckpointWarning, match=r"No checkpoint is published"):
        sw.checkpoint.load(t, path)
    assert t["opt"]["step"] == 1


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(w=sw.zeros((7, 4))), r"Key 'w'.*shape \(7, 5\) float32.*\(7, 4\)"),
    (lambda t: t.update(w=sw.zeros((7, 5), dtype=torch.float64)), r"Key 'w'.*float64"),
    (lambda t: t["opt"].update(extra=torch.zeros(1)), r"Key 'opt.extra' is missing"),
    (lambda t: t["opt"].update(step=torch.zeros(1)), r"Key 'opt.step'.*a non-tensor value"),
    (lambda t: t.update(w=sw.zeros((7, 5), sharding=PlacementMapping(
        M22, [sw.Partial(), R]))), r"Key 'w'.*Partial"),
])
def test_mismatches_name_the_key(tmp_path: Path, change: Any, message: str) -> None:
    sw.checkpoint.save(state(1.0), tmp_path / "c")
    t = target()
    change(t)
    with pytest.raises(CheckpointError, match=message):
        sw.checkpoint.load(t, tmp_path / "c")


def test_strict_false_keeps_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    sw.checkpoint.save(state(1.0), tmp_path / "c")
    t = target()
    t["new"] = torch.ones(2)
    sw.checkpoint.load(t, tmp_path / "c", strict=False)
    assert torch.equal(t["new"], torch.ones(2)) and t["opt"]["step"] == 1


def test_truncated_and_missing_files_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c"
    sw.checkpoint.save(state(1.0), path)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError,
                       match=r"Key '(w|opt\.\w+)'.*truncated \(100 bytes\).*corrupt"):
        sw.checkpoint.load(target(), path)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"Key '(w|opt\.\w+)'.*is missing"):
        sw.checkpoint.load(target(), path)
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        sw.checkpoint.load(target(), tmp_path / "nowhere")
    (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        sw.checkpoint.load(target(), path)


def test_damaged_data_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c"
    sw.checkpoint.save({"w": sw.tensor(torch.ones(64, 64))}, path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[:64] = bytes(64)  # the first record's header: same size, unreadable
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"Key 'w': its data in .*__0_0.distcp bytes "
                       r"0\.\.\d+ is corrupt \(their CRC-32 is"):
        sw.checkpoint.load({"w": sw.zeros((64, 64))}, path)


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c"
    sw.checkpoint.save(state(1.0), path)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match=r"posix.system.*refusing to unpickle"):
        sw.checkpoint.load(target(), path)


def test_non_tensor_values_load_with_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "c"
    dcp.save({"obj": {"fine": [1, 2.5, "x"]}, "evil": _Evil()}, checkpoint_id=path,
             no_dist=True)
    t: dict[str, Any] = {"obj": {"fine": None}, "evil": None}
    with pytest.raises(CheckpointError, match=r"weights_only=True accepts.*corrupt"):
        sw.checkpoint.load(t, path)
    t = {"obj": {"fine": None}}
    sw.checkpoint.load(t, path)
    assert t["obj"]["fine"] == [1, 2.5, "x"]
