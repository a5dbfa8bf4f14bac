"""Checkpoint integrity and honest loading (issue 24): any damage to any file of a
checkpoint is a CheckpointError that says "corrupt" and names the file and bytes (and
the key for data), never a wrong value; an interrupted save's leftovers are loaded
only with a warning that names both checkpoints and their steps."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.checkpoint import CheckpointError, CheckpointWarning
from tests.helpers.meshes import M3, M22

R = Replicated()
G = torch.arange(35.).reshape(7, 5)


def state(step: int) -> dict[str, Any]:
    return {"w": sw.tensor(G + step, sharding=PlacementMapping(M22, [Sharded(0), Sharded(1)])),
            "b": sw.tensor(torch.arange(6, dtype=torch.int64) + step,
                           sharding=PlacementMapping(M22, [R, Sharded(0)])),
            "plain": torch.full((3,), float(step)), "step": step}


def target() -> dict[str, Any]:
    return {"w": sw.zeros((7, 5), sharding=PlacementMapping(M3, [Sharded(1)])),
            "b": sw.zeros(6, dtype=torch.int64, sharding=PlacementMapping(M3, [Sharded(0)])),
            "plain": torch.zeros(3), "step": -1}


def check(t: dict[str, Any], step: int) -> None:
    assert torch.equal(t["w"].to_torch(), G + step)
    assert torch.equal(t["b"].to_torch(), torch.arange(6, dtype=torch.int64) + step)
    assert torch.equal(t["plain"], torch.full((3,), float(step))) and t["step"] == step


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "ckpt"
    sw.checkpoint.save(state(3), path)
    return path


def _load_copy(saved: Path, damage: Any) -> dict[str, Any]:
    """Load a damaged copy of ``saved``; returns the target when no error was raised."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt"
        shutil.copytree(saved, path)
        damage(path)
        t = target()
        sw.checkpoint.load(t, path)
        return t


def _flip(file: Path, offset: int, mask: bytes) -> None:
    raw = bytearray(file.read_bytes())
    for i, m in enumerate(mask):
        if offset + i < len(raw):
            raw[offset + i] ^= m
    file.write_bytes(bytes(raw))


def test_a_checksummed_checkpoint_is_an_ordinary_dcp_checkpoint(saved: Path) -> None:
    t = {"w": torch.zeros(7, 5), "b": torch.zeros(6, dtype=torch.int64),
         "plain": torch.zeros(3), "step": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's single-process notice
        dcp.load(t, checkpoint_id=saved, no_dist=True)
    assert torch.equal(t["w"], G + 3) and t["step"] == 3
    md = pickle.loads((saved / ".metadata").read_bytes())  # the trailer is ignored
    assert all(isinstance(getattr(i, "shardwise_crc32", None), int)
               for i in md.storage_data.values())
    assert md.shardwise_checksum == "crc32"
    check(_load_copy(saved, lambda p: None), 3)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), mask=st.binary(min_size=8, max_size=8),
       kind=st.sampled_from([".distcp", ".metadata"]))
def test_any_flip_in_any_file_is_corrupt_never_a_wrong_value(
        saved: Path, where: float, mask: bytes, kind: str) -> None:
    if not any(mask):
        mask = b"\x01" + mask[1:]
    files = sorted(f.name for f in saved.iterdir() if f.name.endswith(kind))
    name = files[int(where * 997) % len(files)]
    offset = int(where * (saved / name).stat().st_size)
    with pytest.raises(CheckpointError, match="corrupt") as err:
        _load_copy(saved, lambda p: _flip(p / name, offset, mask))
    message = str(err.value)
    assert name in message and "bytes" in message, message
    if kind == ".distcp":
        assert "Key '" in message, message


@pytest.mark.parametrize("kind", [".distcp", ".metadata"])
@pytest.mark.parametrize("how", ["zero-filled", "truncated", "emptied"])
def test_zero_filled_and_truncated_files_are_corrupt(saved: Path, kind: str, how: str
                                                     ) -> None:
    def damage(path: Path) -> None:
        for f in path.iterdir():
            if f.name.endswith(kind):
                size = f.stat().st_size
                f.write_bytes({"zero-filled": bytes(size), "truncated": f.read_bytes()[
                    :size // 2], "emptied": b""}[how])

    with pytest.raises(CheckpointError, match="corrupt") as err:
        _load_copy(saved, damage)
    assert "weights_only" not in str(err.value)


def test_a_plain_dcp_checkpoint_zero_filled_is_corrupt(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(64), "step": 1}, checkpoint_id=tmp_path / "c", no_dist=True)
    f = next((tmp_path / "c").glob("*.distcp"))
    f.write_bytes(bytes(f.stat().st_size))  # no checksums there to compare
    with pytest.raises(CheckpointError, match=r"Key '(w|step)'.* bytes \d+\.\.\d+ is corrupt "
                       r"\(they are all zero bytes\)") as err:
        sw.checkpoint.load({"w": torch.zeros(64), "step": 0}, tmp_path / "c")
    assert "weights_only" not in str(err.value)


# --- an interrupted save ---------------------------------------------------------------------
def _states(tmp_path: Path, published: bool, old: bool, partial: str) -> Path:
    """``run`` as a save of step 2 over step 1 left it: ``partial`` is "complete",
    "incomplete" (data, no metadata) or "none"."""
    path = tmp_path / "run"
    if old:
        sw.checkpoint.save(state(1), tmp_path / "one")
        os.replace(tmp_path / "one", tmp_path / ("run" if published else "run.old"))
    if partial != "none":
        sw.checkpoint.save(state(2), tmp_path / "two")
        os.replace(tmp_path / "two", tmp_path / "run.partial")
        if partial == "incomplete":
            (tmp_path / "run.partial" / ".metadata").unlink()
    return path


def test_between_the_renames_the_complete_unpublished_save_loads_with_a_warning(
        tmp_path: Path) -> None:
    path = _states(tmp_path, published=False, old=True, partial="complete")
    t = target()
    with pytest.warns(CheckpointWarning) as record:
        sw.checkpoint.load(t, path)
    check(t, 2)
    message = str(record[0].message)
    assert (f"No checkpoint is published at {path}" in message
            and f"{path}.partial (step 2) holds a complete save" in message
            and f"{path}.old (step 1)" in message and "Move run.partial to run" in message
            ), message
    with pytest.raises(CheckpointError, match=r"run.partial \(step 2\).*run.old \(step 1\)"
                       r".*fallback='warn'"):
        sw.checkpoint.load(target(), path, fallback="error")


def test_with_no_unpublished_save_the_older_checkpoint_loads_with_a_warning(
        tmp_path: Path) -> None:
    path = _states(tmp_path, published=False, old=True, partial="incomplete")
    t = target()
    with pytest.warns(CheckpointWarning, match=r"run.old \(step 1\), aside and did not "
                      r"finish \(.*run.partial is incomplete\): loading .*run.old"):
        sw.checkpoint.load(t, path)
    check(t, 1)
    with pytest.raises(CheckpointError, match=r"No checkpoint is published.*run.old"):
        sw.checkpoint.load(target(), path, fallback="error")


def test_the_published_checkpoint_wins_without_a_warning(tmp_path: Path) -> None:
    path = _states(tmp_path, published=True, old=True, partial="complete")  # before rename 1
    t = target()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        sw.checkpoint.load(t, path, fallback="error")
    check(t, 1)


def test_an_incomplete_save_alone_is_no_checkpoint(tmp_path: Path) -> None:
    path = _states(tmp_path, published=False, old=False, partial="incomplete")
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        sw.checkpoint.load(target(), path)
    with pytest.raises(CheckpointError, match=r"fallback='later' is not one of"):
        sw.checkpoint.load(target(), path, fallback="later")  # type: ignore[arg-type]


def test_load_train_state_passes_fallback(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters())
    sw.checkpoint.save_train_state(tmp_path / "run", model, opt, step=4)
    os.replace(tmp_path / "run", tmp_path / "run.old")
    with pytest.raises(CheckpointError, match=r"run.old \(step 4\)"):
        sw.checkpoint.load_train_state(tmp_path / "run", model, opt, fallback="error")
    with pytest.warns(CheckpointWarning, match=r"run.old \(step 4\)"):
        assert sw.checkpoint.load_train_state(tmp_path / "run", model, opt) == 4


# --- safetensors ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_st(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("integrity_st") / "model.safetensors"
    s = state(3)
    del s["step"]
    sw.checkpoint.save_safetensors(s, path, metadata={"format": "pt"})
    return path


def _load_st(saved_st: Path, damage: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / saved_st.name
        shutil.copy(saved_st, path)
        damage(path)
        t = target()
        sw.checkpoint.load_safetensors(path, t)
        return t


def test_a_checksummed_safetensors_file_loads(saved_st: Path) -> None:
    t = _load_st(saved_st, lambda p: None)
    t["step"] = 3
    check(t, 3)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), mask=st.binary(min_size=8, max_size=8))
def test_any_flip_in_a_safetensors_file_is_corrupt_never_a_wrong_value(
        saved_st: Path, where: float, mask: bytes) -> None:
    if not any(mask):
        mask = b"\x01" + mask[1:]
    offset = int(where * saved_st.stat().st_size)
    with pytest.raises(CheckpointError, match="corrupt") as err:
        _load_st(saved_st, lambda p: _flip(p, offset, mask))
    message = str(err.value)
    assert saved_st.name in message, message
    assert "bytes" in message or "safetensors cannot read" in message, message


@pytest.mark.parametrize("how", ["zero-filled", "truncated", "emptied"])
@pytest.mark.parametrize("ours", [True, False])
def test_zero_filled_and_truncated_safetensors_files_are_corrupt(
        saved_st: Path, tmp_path: Path, how: str, ours: bool) -> None:
    import safetensors.torch

    src = saved_st
    if not ours:  # written by safetensors itself: no checksums
        src = tmp_path / "plain.safetensors"
        safetensors.torch.save_file({"w": G, "plain": torch.ones(3)}, src)

    def damage(p: Path) -> None:
        size = p.stat().st_size
        p.write_bytes({"zero-filled": bytes(size), "truncated": p.read_bytes()[:size - 8],
                       "emptied": b""}[how])

    with pytest.raises(CheckpointError, match="corrupt"):
        _load_st(src, damage)


def _without_zlib_ng(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where zlib-ng is not installed: zlib's CRC-32, pieces on threads."""
    from shardwise.checkpoint import integrity

    monkeypatch.setattr(integrity, "_crc32", zlib.crc32)
    monkeypatch.setattr(integrity, "FAST", False)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32_combine_is_zlibs(a: bytes, b: bytes) -> None:
    from shardwise.checkpoint import integrity

    assert integrity.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_of_a_large_buffer_in_pieces_is_zlibs(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.checkpoint import integrity

    _without_zlib_ng(monkeypatch)
    monkeypatch.setattr(integrity, "_PIECE", 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    data = bytes(range(256)) * 41 + b"tail"
    assert integrity.crc32(data) == zlib.crc32(data)
    assert integrity.crc32(memoryview(data)[5:]) == zlib.crc32(data[5:])


def test_check_chunk_in_pieces_from_a_memory_map(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.checkpoint import integrity

    _without_zlib_ng(monkeypatch)
    monkeypatch.setattr(integrity, "_PIECE", 1000)
    monkeypatch.setattr(integrity, "_SMALL", 100)  # mapped, not read
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    f = tmp_path / "data"
    data = bytes(range(256)) * 41
    f.write_bytes(data)
    integrity.check_chunk(f, 7, 9000, zlib.crc32(data[7:9000]))
    with pytest.raises(integrity.Corrupt, match="CRC-32"):
        integrity.check_chunk(f, 7, 9000, zlib.crc32(data[7:9000]) ^ 1)
    with pytest.raises(integrity.Corrupt, match="truncated"):
        integrity.check_chunk(f, 7, 90000, 0)


def test_verify_false_skips_the_data_checksums(saved: Path, saved_st: Path) -> None:
    def damage(p: Path) -> None:  # 8 bytes of w's values (row 1, [5., 6.] + 3)
        f = p / "__0_0.distcp" if p.is_dir() else p
        _flip(f, f.read_bytes().index((G[1, :2] + 3).numpy().tobytes()), b"\x01" * 8)

    with tempfile.TemporaryDirectory() as d:
        path, st_path = Path(d) / "ckpt", Path(d) / saved_st.name
        shutil.copytree(saved, path)
        shutil.copy(saved_st, st_path)
        damage(path)
        damage(st_path)
        sw.checkpoint.load(target(), path, verify=False)  # unchecked: no error
        t = target()
        assert sw.checkpoint.load_safetensors(st_path, t, strict=False, verify=False) == []
        with pytest.raises(CheckpointError, match="corrupt"):
            sw.checkpoint.load(target(), path)
        with pytest.raises(CheckpointError, match="corrupt"):
            sw.checkpoint.load_safetensors(st_path, target(), strict=False)


# --- the checksums' algorithm ------------------------------------------------------------------
def test_zlib_ng_when_installed_computes_zlibs_crc32() -> None:
    from shardwise.checkpoint import integrity

    try:
        import zlib_ng  # noqa: F401
    except ImportError:
        assert not integrity.FAST
    else:
        assert integrity.FAST  # the dependency is used where it is installed
    data = bytes(range(256)) * 4099
    for part in (b"", data[:1], data[3:70000], data):
        assert integrity.crc32(part) == zlib.crc32(part)
        assert integrity.crc32(memoryview(part), 12345) == zlib.crc32(part, 12345)


def test_with_and_without_zlib_ng_the_checkpoints_are_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sw.checkpoint.save(state(5), tmp_path / "a")
    sw.checkpoint.save_safetensors({"w": state(5)["w"]}, tmp_path / "a.safetensors")
    _without_zlib_ng(monkeypatch)
    sw.checkpoint.save(state(5), tmp_path / "b")
    sw.checkpoint.save_safetensors({"w": state(5)["w"]}, tmp_path / "b.safetensors")
    for f in (tmp_path / "a").glob("*.distcp"):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name

    def crcs(path: Path) -> dict[Any, int]:  # the metadata also holds the path
        md = pickle.loads((path / ".metadata").read_bytes())
        return {k: i.shardwise_crc32 for k, i in md.storage_data.items()}

    assert crcs(tmp_path / "a") == crcs(tmp_path / "b")
    assert (tmp_path / "a.safetensors").read_bytes() == (
        tmp_path / "b.safetensors").read_bytes()
    t = target()
    sw.checkpoint.load(t, tmp_path / "a")  # checked by zlib's CRC-32
    check(t, 5)
    with pytest.raises(CheckpointError, match="corrupt"):
        _load_copy(tmp_path / "a", lambda p: _flip(next(p.glob("*.distcp")), 200, b"\x04"))


def _rewrite_metadata(path: Path, change: Any) -> None:
    """``change`` the unpickled metadata of the checkpoint at ``path`` and write it back
    with a valid trailer (as a writer would have)."""
    from shardwise.checkpoint import integrity

    data, crc = integrity.split_trailer((path / ".metadata").read_bytes())
    assert crc is not None
    md = pickle.loads(data)
    change(md)
    data = pickle.dumps(md)
    (path / ".metadata").write_bytes(data + b"shardwise.crc32=%08x" % zlib.crc32(data))


def test_metadata_without_the_algorithm_holds_crc32s(saved: Path) -> None:
    def older(path: Path) -> None:  # as written before the algorithm was recorded
        _rewrite_metadata(path, lambda md: delattr(md, "shardwise_checksum"))

    check(_load_copy(saved, older), 3)
    with pytest.raises(CheckpointError, match=r"Key '.*': its data in .*bytes "
                       r"\d+\.\.\d+ is corrupt \(their CRC-32 is"):
        _load_copy(saved, lambda p: (older(p), _flip(p / "__0_0.distcp", 600, b"\x10")))


def test_an_unknown_algorithm_is_a_clear_error(saved: Path) -> None:
    def newer(path: Path) -> None:
        _rewrite_metadata(path, lambda md: setattr(md, "shardwise_checksum", "xxh3"))

    with pytest.raises(CheckpointError, match=r"records its chunk checksums as 'xxh3' .*"
                       r"cannot check \(it knows 'crc32'\).*verify=False") as err:
        _load_copy(saved, newer)
    assert "corrupt" not in str(err.value)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt"
        shutil.copytree(saved, path)
        newer(path)
        t = target()
        sw.checkpoint.load(t, path, verify=False)  # sizes and the metadata still checked
        check(t, 3)


def _rewrite_header(path: Path, change: Any) -> None:
    """``change`` the ``__metadata__`` of the safetensors file at ``path`` and rewrite
    its header with valid checksums (as a writer would have)."""
    import json
    import struct

    from shardwise.checkpoint import safetensors_io as sio

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    change(head["__metadata__"])
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    full = struct.pack("<Q", len(text)) + text
    digits = [sio._digits_at(text, k) for k in head["__metadata__"] if k.startswith(sio._CRC)]
    at = sio._digits_at(text, sio._CRC)
    full = full[:at] + b"%08x" % sio._header_crc(full, digits) + full[at + 8:]
    path.write_bytes(full + raw[8 + n:])


def test_a_safetensors_file_without_the_algorithm_holds_crc32s(saved_st: Path) -> None:
    def older(p: Path) -> None:
        _rewrite_header(p, lambda meta: meta.pop("shardwise.checksum"))

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / saved_st.name
        shutil.copy(saved_st, path)
        older(path)
        assert b"shardwise.checksum" not in path.read_bytes()
    t = _load_st(saved_st, older)
    t["step"] = 3
    check(t, 3)
    with pytest.raises(CheckpointError, match=r"Key '.*': its data in .*bytes \d+\.\.\d+ "
                       r"is corrupt \(their CRC-32 is"):
        _load_st(saved_st, lambda p: (older(p), _flip(p, p.stat().st_size - 8, b"\x01")))


def test_an_unknown_safetensors_algorithm_is_a_clear_error(saved_st: Path) -> None:
    def newer(p: Path) -> None:
        _rewrite_header(p, lambda meta: meta.update({"shardwise.checksum": "xxh3"}))

    with pytest.raises(CheckpointError, match=r"records its tensors' checksums as 'xxh3' .*"
                       r"cannot check \(it knows 'crc32'\).*verify=False") as err:
        _load_st(saved_st, newer)
    assert "corrupt" not in str(err.value)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / saved_st.name
        shutil.copy(saved_st, path)
        newer(path)
        t = target()
        sw.checkpoint.load_safetensors(path, t, strict=False, verify=False)
        t["step"] = 3
        check(t, 3)


def test_the_algorithm_key_is_reserved_in_safetensors_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'shardwise\.checksum'.*Rename the key"):
        sw.checkpoint.save_safetensors({"w": torch.ones(2)}, tmp_path / "f.safetensors",
                                       metadata={"shardwise.checksum": "mine"})


def test_the_benchmarks_switch_writes_no_checksums(tmp_path: Path) -> None:
    from shardwise.checkpoint import integrity, safetensors_io, store

    store._save(state(4), tmp_path / "c", checksums=False)
    data, crc = integrity.split_trailer((tmp_path / "c" / ".metadata").read_bytes())
    md = pickle.loads(data)
    assert crc is None and not hasattr(md, "shardwise_checksum")
    assert not any(hasattr(i, "shardwise_crc32") for i in md.storage_data.values())
    t = target()
    sw.checkpoint.load(t, tmp_path / "c")
    check(t, 4)
    s = state(4)
    del s["step"]
    safetensors_io._save_safetensors(s, tmp_path / "f.safetensors", None, checksums=False)
    assert b"shardwise" not in (tmp_path / "f.safetensors").read_bytes()[:4096]
    assert safetensors_io._checks(tmp_path / "f.safetensors") == {}
    t = target()
    sw.checkpoint.load_safetensors(tmp_path / "f.safetensors", t, strict=False)
    t["step"] = 4
    check(t, 4)


def _chunks(saved: Path) -> list[tuple[str, str, int, int]]:
    """``(key, file, first byte, end)`` of every chunk of the DCP checkpoint ``saved``."""
    md = pickle.loads((saved / ".metadata").read_bytes())
    return sorted((i.fqn, info.relative_path, info.offset, info.offset + info.length)
                  for i, info in md.storage_data.items())


def _st_chunks(saved_st: Path) -> list[tuple[str, str, int, int]]:
    from shardwise.checkpoint import safetensors_io

    return sorted((name, saved_st.name, b, e)
                  for name, (b, e, _, _) in safetensors_io._checks(saved_st).items())


def _same_layout() -> dict[str, Any]:
    s = state(0)
    return {k: sw.zeros_like(v) if isinstance(v, sw.Tensor) else
            (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in s.items()}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("into", ["same layout", "resharded", "one key"])
def test_a_flip_in_each_chunk_names_its_key_file_and_bytes(
        saved: Path, saved_st: Path, where: str, into: str) -> None:
    """The chunks are checked on a thread while they load: a flipped byte at either
    end or inside any chunk still raises naming its key, file and byte range, whatever
    the target's layout; a load that does not read the chunk is not affected."""
    def targets() -> dict[str, Any]:
        t = {"same layout": _same_layout, "resharded": target,
             "one key": lambda: {"w": target()["w"]}}[into]()
        return t

    for fmt, chunks in (("dcp", _chunks(saved)), ("st", _st_chunks(saved_st))):
        for key, file, begin, end in chunks:
            at = {"first": begin, "middle": (begin + end) // 2, "last": end - 1}[where]
            t = targets()
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / (saved.name if fmt == "dcp" else saved_st.name)
                if fmt == "dcp":
                    shutil.copytree(saved, path)
                    _flip(path / file, at, b"\x10")
                else:
                    shutil.copy(saved_st, path)
                    _flip(path, at, b"\x10")
                load = (sw.checkpoint.load if fmt == "dcp" else
                        lambda t, p: sw.checkpoint.load_safetensors(p, t, strict=False))
                if key not in t:  # not read: loads, and the values read are right
                    load(t, path)
                    assert torch.equal(t["w"].to_torch(), G + 3)
                    continue
                with pytest.raises(CheckpointError) as err:
                    load(t, path)
            message = str(err.value)
            assert (f"Key {key!r}" in message and file in message and "corrupt" in message
                    and f"bytes {begin}..{end}" in message), (fmt, key, where, message)


def test_dcp_chunks_are_summed_as_they_are_read_once_per_load(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk a load reads is checked once, a resharded load included (DCP reads a
    chunk once per target block it overlaps), from the bytes torch.load read: the
    check itself reads only what torch.load skipped (headers, the zip directory)."""
    from shardwise.checkpoint import integrity

    monkeypatch.setattr(integrity, "_FUSE", 16)  # the test's records are small
    left: list[tuple[int, int]] = []
    view_check = integrity.SummingView.check

    def spy(self: integrity.SummingView) -> None:
        left.append((self.begin, self.end - self.begin - self.upto))
        view_check(self)

    monkeypatch.setattr(integrity.SummingView, "check", spy)
    monkeypatch.setattr(integrity, "check_chunk", None)  # no second pass over a chunk
    t = target()
    sw.checkpoint.load(t, saved)
    check(t, 3)
    read = [c for c in _chunks(saved) if c[0] in t]
    assert sorted(b for b, _ in left) == sorted(b for _, _, b, _ in read), left
    assert all(n < 1024 for _, n in left), left  # the record's bytes were summed as read


def test_safetensors_tensors_are_summed_once_as_they_are_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte of the file's tensors is summed once, in pieces each copied right
    after it is summed (read from memory once), and a flip anywhere is corrupt."""
    from shardwise.checkpoint import integrity, safetensors_io

    big = torch.arange(3 * 2**20, dtype=torch.float32).reshape(1536, 2048)  # 12 MiB
    small = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    path = tmp_path / "big.safetensors"
    sw.checkpoint.save_safetensors({"big": big, "small": small}, path)
    summed: list[int] = []
    crc32 = integrity.crc32

    def spy(data: Any, value: int = 0) -> int:
        summed.append(len(data))
        return crc32(data, value)

    monkeypatch.setattr(integrity, "crc32", spy)
    mesh = sw.DeviceMesh.cpu(4, "x")
    t = {"big": sw.zeros((1536, 2048), sharding=PlacementMapping(mesh, [Sharded(1)])),
         "small": torch.zeros(5, 6)}
    assert sw.checkpoint.load_safetensors(path, t) == []
    assert torch.equal(t["big"].to_torch(), big) and torch.equal(t["small"], small)
    header, *data = summed  # the header's own CRC-32 first, then the tensors'
    assert header < 1024 and sum(data) == big.nbytes + small.nbytes, summed
    assert max(data) <= safetensors_io._CHUNK < big.nbytes, summed  # pieces, not tensors
    raw = bytearray(path.read_bytes())
    start = len(raw) - big.nbytes - small.nbytes  # the data follows the header
    for at in (start + 10, start + big.nbytes - 10, start + big.nbytes + 5):
        damaged = tmp_path / f"flip{at}.safetensors"
        flipped = bytearray(raw)
        flipped[at] ^= 0x10
        damaged.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=r"Key '(big|small)': its data in .* bytes "
                                                  r"\d+\.\.\d+ is corrupt \(their CRC-32"):
            sw.checkpoint.load_safetensors(damaged, t)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reads=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 400)), max_size=8),
       flip=st.one_of(st.none(), st.integers(0, 599)))
def test_a_summing_view_reads_like_the_file_and_checks_what_it_did_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        reads: list[tuple[int, int]], flip: int | None) -> None:
    """Whatever a reader seeks and reads (in any order, past the end too), the view
    returns the chunk's bytes, and ``check`` passes exactly when they are intact."""
    from shardwise.checkpoint import integrity

    monkeypatch.setattr(integrity, "_FUSE", 64)
    monkeypatch.setattr(integrity, "_STEP", 50)  # fused reads in several pieces
    data = bytes(range(256)) * 4
    f = tmp_path / "chunk"
    f.write_bytes(data)
    begin, end = 100, 700
    expected = zlib.crc32(data[begin:end])
    if flip is not None:
        _flip(f, begin + flip, b"\x04")
    disk = f.read_bytes()
    fd = os.open(f, os.O_RDONLY)
    try:
        view = integrity.SummingView(fd, f, begin, end, expected)
        for at, n in reads:
            view.seek(at)
            buf = bytearray(n)
            got = view.readinto(buf)
            assert bytes(buf[:got]) == disk[begin:end][at:at + n]
        assert view.seek(0) == 0 and view.read() == disk[begin:end]
        if flip is None:
            view.check()
        else:
            with pytest.raises(integrity.Corrupt, match=f"bytes {begin}..{end}: their CRC-32"):
                view.check()
    finally:
        os.close(fd)


def test_a_summing_view_of_a_truncated_file_is_corrupt(tmp_path: Path) -> None:
    from shardwise.checkpoint import integrity

    f = tmp_path / "chunk"
    f.write_bytes(b"x" * 50)
    fd = os.open(f, os.O_RDONLY)
    try:
        view = integrity.SummingView(fd, f, 10, 90, 0)
        assert len(view.read()) == 40
        with pytest.raises(integrity.Corrupt, match="truncated"):
            view.check()
    finally:
        os.close(fd)
