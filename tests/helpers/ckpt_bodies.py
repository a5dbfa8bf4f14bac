"""Checkpoint bodies run on Gloo ranks (``tests/helpers/harness.py``): 4 ranks
save, 2 ranks load what they saved. Files go to ``$SHARDWISE_CKPT_TEST_DIR``, a
directory every rank of both launches shares."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.sharding.shapes import local_bounds

R = Replicated()
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((7, 5), torch.float32), "b": ((7, 5), torch.float32), "c": ((3,), torch.float32),
    "z": ((0, 5), torch.float32), "i": ((6,), torch.int64), "bf": ((4, 6), torch.bfloat16),
    "nested.x": ((5,), torch.float32),
}


def _dir() -> Path:
    return Path(os.environ["SHARDWISE_CKPT_TEST_DIR"])


def value(name: str, seed: float = 0.0) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + len(name) + seed
    return base.to(dtype)


def _on(name: str, mesh: DeviceMesh, *placements: Any, seed: float = 0.0) -> sw.Tensor:
    return sw.tensor(value(name, seed), sharding=PlacementMapping(mesh, list(placements)))


def _zeros(name: str, mesh: DeviceMesh, *placements: Any) -> sw.Tensor:
    shape, dtype = SHAPES[name]
    return sw.zeros(shape, dtype=dtype, sharding=PlacementMapping(mesh, list(placements)))


def _state4(seed: float = 0.0) -> dict[str, Any]:
    m = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    return {"a": _on("a", m, Sharded(0), Sharded(1), seed=seed),   # uneven both dims
            "b": _on("b", m, R, Sharded(0), seed=seed),            # replicas over dp
            "c": _on("c", m, Sharded(0), Sharded(0), seed=seed),   # an empty block
            "z": _on("z", m, Sharded(0), R, seed=seed),            # size 0
            "i": _on("i", m, R, R, seed=seed),
            "bf": _on("bf", m, Sharded(1), Sharded(0), seed=seed),
            "nested": {"x": _on("nested.x", m, Sharded(0), R, seed=seed)},
            "plain": torch.full((3,), 1.0 + seed), "step": 7}


def _targets(mesh: DeviceMesh, layouts: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: _zeros(k, mesh, *v) for k, v in layouts.items()
                           if "." not in k}
    out["nested"] = {"x": _zeros("nested.x", mesh, *layouts["nested.x"])}
    out["plain"], out["step"] = torch.zeros(3), 0
    return out


def _check(state: dict[str, Any], seed: float = 0.0) -> None:
    for name in SHAPES:
        t = state["nested"]["x"] if name == "nested.x" else state[name]
        assert torch.equal(t.to_torch(), value(name, seed)), name
    assert torch.equal(state["plain"], torch.full((3,), 1.0 + seed))
    assert state["step"] == 7


def _other4() -> dict[str, Any]:
    m = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    return _targets(m, {"a": (Sharded(1), Sharded(0)), "b": (Sharded(0), R),
                        "c": (R, R), "z": (R, Sharded(1)), "i": (Sharded(0), R),
                        "bf": (R, Sharded(0)), "nested.x": (R, Sharded(0))})


def _two() -> dict[str, Any]:
    m = DeviceMesh.cpu(2, "x")
    return _targets(m, {"a": (Sharded(1),), "b": (Sharded(0),), "c": (R,),
                        "z": (Sharded(1),), "i": (Sharded(0),), "bf": (Sharded(0),),
                        "nested.x": (R,)})


# --- 4 ranks ------------------------------------------------------------------------------
def body_dcp_save_each_rank_writes_its_own_blocks(world: int) -> None:
    """dcp.save: every chunk written once, by a process that holds it; dcp.load
    reshards across processes; dcp.async_save stages a copy."""
    path = _dir() / "dcp"
    state = _state4()
    dcp.save(state, checkpoint_id=path)
    md = dcp.FileSystemReader(path).read_metadata()
    mesh = state["a"].mesh
    for key in ("a", "b", "c", "bf"):
        t = state[key]
        owners: dict[tuple[int, ...], set[int]] = {}
        for k in range(mesh.num_devices):
            bounds = local_bounds(tuple(t.shape), t.dist_layout, mesh.coord_of(k))
            if all(b > a for a, b in bounds):
                owners.setdefault(tuple(a for a, _ in bounds), set()).add(k)
        chunks = md.state_dict_metadata[key].chunks  # type: ignore[union-attr]
        assert sorted(tuple(c.offsets) for c in chunks) == sorted(owners), key  # once each
        for index, info in md.storage_data.items():
            if index.fqn == key:
                writer = int(info.relative_path.split("_")[2])  # "__{rank}_{n}.distcp"
                assert writer in owners[tuple(index.offset)], (key, index, writer)
    target = _other4()
    dcp.load(target, checkpoint_id=path)  # reshard on load across processes
    _check(target)
    staged = _state4(seed=2.0)
    future = dcp.async_save(staged, checkpoint_id=_dir() / "async")
    for t in (staged["a"], staged["b"]):
        t.add_(100.0)  # after staging: the checkpoint keeps the staged values
    future.result()


def body_store_and_safetensors_save(world: int) -> None:
    sw.checkpoint.save(_state4(), _dir() / "store")
    flat = {k: v for k, v in _state4().items() if k not in ("step", "nested")}
    sw.checkpoint.save_safetensors(flat, _dir() / "model.safetensors")
    target = _other4()
    sw.checkpoint.load(target, _dir() / "store")
    _check(target)
    sw.checkpoint.load_safetensors(_dir() / "model.safetensors", target, strict=False)
    _check(target)
    if dist.get_rank() == 0:
        import safetensors.torch

        whole = safetensors.torch.load_file(_dir() / "model.safetensors")
        for k in flat:
            expect = flat[k] if k == "plain" else value(k)
            assert torch.equal(whole[k], expect), k


def body_a_failed_save_keeps_the_last_good_checkpoint(world: int) -> None:
    path = _dir() / "failing"
    sw.checkpoint.save(_state4(), path)
    original = dcp.FileSystemWriter.write_data

    def failing(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("disk full (injected on process 1)")

    if dist.get_rank() == 1:
        dcp.FileSystemWriter.write_data = failing  # type: ignore[method-assign]
    try:
        sw.checkpoint.save(_state4(seed=1.0), path)
    except sw.checkpoint.CheckpointError as err:
        assert "process 1: OSError: disk full" in str(err), str(err)
    else:
        raise AssertionError("the save did not fail")
    finally:
        dcp.FileSystemWriter.write_data = original  # type: ignore[method-assign]
    target = _other4()
    sw.checkpoint.load(target, path)
    _check(target)  # seed 0: the last good one


def body_dtensor_round_trips(world: int) -> None:
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    m = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    cases = [((8, 6), [Sharded(0), Sharded(1)], True), ((6, 4), [R, Sharded(0)], True),
             ((10, 3), [Sharded(0), Sharded(0)], False),   # split conventions differ
             ((7, 5), [Sharded(1), Sharded(0)], True), ((3, 2), [Sharded(0), R], True)]
    for shape, placements, agree in cases:
        g = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        x = sw.tensor(g, sharding=PlacementMapping(m, placements))
        dt = x.to_dtensor()
        assert torch.equal(dt.full_tensor(), g), shape
        block = next(iter(x.addressable_shards.values()))
        if agree and block.numel():
            assert dt.to_local().data_ptr() == block.data_ptr(), shape  # zero copy
        back = sw.from_dtensor(dt)
        assert back.dist_layout == x.dist_layout and torch.equal(back.to_torch(), g), shape
        if agree and block.numel():
            assert next(iter(back.addressable_shards.values())).data_ptr() == block.data_ptr()
    tmesh = sw.checkpoint.to_dtensor(x).device_mesh
    g = torch.arange(20.).reshape(10, 2)
    dt = distribute_tensor(g, tmesh, [Shard(0), Shard(0)])  # torch.chunk: 3,2,3,2
    t = sw.from_dtensor(dt)
    assert t.placements == (Sharded(0), Sharded(0)) and torch.equal(t.to_torch(), g)
    # Partial both ways: the value is the reduction of the addends
    from torch.distributed.tensor import DTensor

    addend = g * (dist.get_rank() // 2 + 1)  # dp coordinate + 1, equal along tp
    ps = sw.from_dtensor(DTensor.from_local(addend, tmesh, [TPartial("sum"), Replicate()],
                                            run_check=False))
    assert ps.dist_layout.is_partial and torch.equal(ps.to_torch(), 3 * g)
    assert torch.equal(ps.to_dtensor().full_tensor(), 3 * g)
    local = torch.full((2,), float(dist.get_rank()))
    q = DTensor.from_local(local, tmesh, [TPartial("max"), TPartial("max")], run_check=False)
    qs = sw.from_dtensor(q)
    assert torch.equal(qs.to_torch(), torch.full((2,), 3.0))
    assert torch.equal(qs.to_dtensor().full_tensor(), torch.full((2,), 3.0))


def body_gpt_trains_then_saves(world: int) -> None:
    from tests.helpers import gpt_runs

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    model, opt, config = gpt_runs.build(mesh)
    gpt_runs.run(mesh, range(1), model, opt, config)
    sw.checkpoint.save_train_state(_dir() / "gpt", model, opt, step=1)
    losses = gpt_runs.run(mesh, range(1, 3), model, opt, config)
    if dist.get_rank() == 0:
        (_dir() / "gpt_losses.json").write_text(json.dumps(losses))


BODIES_4 = [name for name in list(globals()) if name.startswith("body_")]


# --- 2 ranks: load what 4 saved -----------------------------------------------------------
def two_load_dcp(world: int) -> None:
    target = _two()
    dcp.load(target, checkpoint_id=_dir() / "dcp")
    _check(target)
    target = _two()
    dcp.load(target, checkpoint_id=_dir() / "async")
    _check(target, seed=2.0)


def two_load_store_and_safetensors(world: int) -> None:
    target = _two()
    sw.checkpoint.load(target, _dir() / "store")
    _check(target)
    fresh = _two()
    fresh["step"] = 7
    sw.checkpoint.load_safetensors(_dir() / "model.safetensors", fresh, strict=False)
    fresh["nested"]["x"] = target["nested"]["x"]
    _check(fresh)


def two_gpt_resumes(world: int) -> None:
    from tests.helpers import gpt_runs

    mesh = DeviceMesh.cpu((2, 1), ("dp", "tp"))
    model, opt, config = gpt_runs.build(mesh, seed=5)
    assert sw.checkpoint.load_train_state(_dir() / "gpt", model, opt) == 1
    losses = gpt_runs.run(mesh, range(1, 3), model, opt, config)
    assert losses == json.loads((_dir() / "gpt_losses.json").read_text())


def two_a_corrupt_shard_is_reported_on_every_rank(world: int) -> None:
    """8 bytes flipped in the file rank 1 wrote: every rank's load raises, naming the
    key, the file, the byte range and "corrupt" (DCP gathers the reading rank's error);
    the same for a safetensors file. No rank keeps a wrong value."""
    m = DeviceMesh.cpu(2, "x")
    state = {k: _on(k, m, Sharded(0)) for k in ("a", "b", "i")}
    path, st_path = _dir() / "corrupt", _dir() / "corrupt.safetensors"
    sw.checkpoint.save(state, path)
    sw.checkpoint.save_safetensors(state, st_path)
    if dist.get_rank() == 0:
        for f in (path / "__1_0.distcp", st_path):
            raw = bytearray(f.read_bytes())
            at = len(raw) - 40  # in the last record's data (the safetensors tensor "i")
            raw[at:at + 8] = bytes(b ^ 0x5A for b in raw[at:at + 8])
            f.write_bytes(bytes(raw))
    dist.barrier()
    for load, where in ((lambda t: sw.checkpoint.load(t, path), "__1_0.distcp"),
                        (lambda t: sw.checkpoint.load_safetensors(st_path, t),
                         "corrupt.safetensors")):
        target = {k: _zeros(k, m, R) for k in ("a", "b", "i")}
        try:
            load(target)
        except sw.checkpoint.CheckpointError as err:
            message = str(err)
            assert "corrupt" in message and where in message and "bytes" in message, message
            assert "Key '" in message, message
        else:
            raise AssertionError(f"rank {dist.get_rank()} loaded a corrupt {where}")


BODIES_2 = [name for name in list(globals()) if name.startswith("two_")]


def body_peer_of_a_failed_load(n: int) -> None:
    """Rank 1's load fails on a key (its target has another shape) before DCP's
    exchange; rank 0's exchange then fails (Gloo's own text): its error names its rank
    and quotes rank 1's, key included (issue 24)."""
    from shardwise.checkpoint import CheckpointError

    mesh = DeviceMesh.cpu((n,), ("x",))
    path = _dir() / "peer_of_a_failed_load"
    w = sw.tensor(torch.arange(8.0), sharding=PlacementMapping(mesh, [Sharded(0)]))
    sw.checkpoint.save({"w": w}, path)
    shape = (9,) if dist.get_rank() == 1 else (8,)
    try:
        sw.checkpoint.load({"w": sw.zeros(shape, sharding=PlacementMapping(mesh, [R]))}, path)
    except CheckpointError as err:
        text = str(err)
    else:
        raise AssertionError("the load succeeded although rank 1's target differs")
    if dist.get_rank() == 1:
        assert "Key 'w'" in text, text
        return  # it leaves: rank 0 waits in DCP's exchange for it
    assert "rank 0's exchange with the other processes failed" in text, text
    assert "the first failure of this run: rank 1: Key 'w'" in text, text
