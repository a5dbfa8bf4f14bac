"""shard_map's interface: spec forms, inputs, outputs, and how it is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

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
    ShardingSpec,
    lax,
)
from shardwise.debug import CommCounter
from tests.helpers.meshes import M22 as MESH

X = torch.arange(24.0).reshape(4, 6)


def blocks_seen(in_spec: object, x: object = X) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}

    def fn(a: torch.Tensor) -> torch.Tensor:
        seen[lax.axis_index(("dp", "tp"))] = a
        return lax.psum(a.sum(), ("dp", "tp"))

    sw.shard_map(fn, MESH, in_specs=(in_spec,), out_specs=())(x)
    return [seen[k] for k in range(4)]


@pytest.mark.parametrize("spec", [
    ("dp", "tp"), ["dp", "tp"],
    PlacementMapping(MESH, [Sharded(0), Sharded(1)]),
    NamedMapping(MESH, ("dp", "tp")),
    ShardingSpec(MESH, ["dp", "tp"]),
])
def test_equivalent_spec_forms(spec: object) -> None:
    got = blocks_seen(spec)
    assert [b.tolist() for b in got] == [X[:2, :3].tolist(), X[:2, 3:].tolist(),
                                         X[2:, :3].tolist(), X[2:, 3:].tolist()]


@pytest.mark.parametrize("spec", [None, (), (None, None)])
def test_replicated_spec_forms(spec: object) -> None:
    got = blocks_seen(spec)
    assert all(torch.equal(b, X) for b in got)
    assert len({id(b) for b in got}) == 1  # one shared buffer, as for replicated shards


def test_dim_over_two_axes_and_short_specs() -> None:
    got = blocks_seen((("tp", "dp"),))  # dim 0 over tp (major) then dp; dim 1 not sharded
    assert [b[:, 0].tolist() for b in got] == [[0.0], [12.0], [6.0], [18.0]]


def test_inputs_of_every_kind() -> None:
    t = sw.tensor(X, sharding=PlacementMapping(MESH, [Sharded(1), Replicated()]))
    single = sw.tensor(X)  # on one device: moved onto the mesh
    for x in (t, single, X, X.numpy(), X.tolist()):
        got = blocks_seen(("dp", None), x)
        assert torch.allclose(got[3].double(), X[2:].double())


def test_outputs_single_tuple_list_and_numbers() -> None:
    one = sw.shard_map(lambda a: a, MESH, (("dp",),), ("dp",))(X)
    assert isinstance(one, sw.Tensor)
    pair = sw.shard_map(lambda a: (a, 2 * a), MESH, (("dp",),), (("dp",), ("dp", None)))(X)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert torch.equal(pair[1].to_torch(), 2 * X)
    lst = sw.shard_map(lambda a: [a], MESH, (("dp",),), [("dp",)])(X)
    assert isinstance(lst, list)
    size = sw.shard_map(lambda a: lax.axis_size("tp"), MESH, (None,), ())(X)
    assert size.shape == () and size.item() == 2


def test_one_sharding_spec_applies_to_every_output_and_argument() -> None:
    spec = NamedMapping(MESH, ("dp",))
    a, b = sw.shard_map(lambda u, v: (u + v, u - v), MESH, in_specs=spec, out_specs=spec)(X, X)
    assert torch.equal(a.to_torch(), 2 * X) and torch.equal(b.to_torch(), 0 * X)
    r1, _ = sw.shard_map(lambda u: (u.sum(), u.max()), MESH, (("dp",),), None)(X)
    assert r1.placements == (Replicated(), Replicated())


def test_partial_outputs() -> None:
    p1 = sw.shard_map(lambda a: a.sum(1), MESH, ((None, "tp"),),
                      PlacementMapping(MESH, [Replicated(), Partial()]))(X)
    assert p1.placements == (Replicated(), Partial())
    assert torch.equal(p1.to_torch(), X.sum(1))
    p2 = sw.shard_map(lambda a: a.amax(1), MESH, ((None, "tp"),),
                      NamedMapping(MESH, (), unreduced={"tp"}, reduce_op=ReduceOp.MAX))(X)
    assert torch.equal(p2.to_torch(), X.amax(1))


def test_partial_inputs_give_the_partial_terms() -> None:
    p = sw.tensor(X, sharding=PlacementMapping(MESH, [Partial(), Replicated()]))
    got = sw.shard_map(lambda a: a, MESH, (PlacementMapping(MESH, [Partial(), Replicated()]),),
                       PlacementMapping(MESH, [Partial(), Replicated()]))(p)
    assert torch.equal(got.to_torch(), X)
    total = sw.shard_map(lambda a: lax.psum(a, "dp"), MESH,
                         (PlacementMapping(MESH, [Partial(), Replicated()]),), None)(p)
    assert torch.equal(total.to_torch(), X)


def test_replicated_output_is_coordinate_zero_block() -> None:
    out = sw.shard_map(lambda a: a * (1 + lax.axis_index("tp")), MESH, (("dp",),), ("dp",))(X)
    assert torch.equal(out.to_torch(), X)  # tp coordinate 0 multiplies by 1
    assert out.shards[0] is out.shards[1] and out.shards[2] is out.shards[3]


def test_decorator_and_current_mesh() -> None:
    @sw.shard_map(mesh=MESH, in_specs=(("dp",),), out_specs=None)
    def total(a: torch.Tensor) -> torch.Tensor:
        return lax.psum(a.sum(0), "dp")

    assert torch.equal(total(X).to_torch(), X.sum(0))
    assert total.__name__ == "total"
    with MESH:
        again = sw.shard_map(lambda a: lax.psum(a.sum(0), "dp"), in_specs=(("dp",),),
                             out_specs=None)
    assert torch.equal(again(X).to_torch(), X.sum(0))


def test_single_device_mesh() -> None:
    mesh = DeviceMesh.cpu(1, "x")
    out = sw.shard_map(lambda a: lax.all_gather(lax.psum(a, "x"), "x", tiled=True), mesh,
                       (("x",),), ("x",))(X)
    assert torch.equal(out.to_torch(), X)


def test_comm_counter_counts_lax_collectives() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        a = lax.all_gather(a, "dp", tiled=True)
        return lax.psum(lax.ppermute(a, "tp", [(0, 1), (1, 0)]), ("dp", "tp"))

    with CommCounter() as cc:
        sw.shard_map(fn, MESH, (("dp",),), None)(X)
    assert dict(cc.counts) == {"all_gather": 1, "ppermute": 1, "all_reduce": 1}


def test_worker_threads_are_reused() -> None:
    fn = sw.shard_map(lambda a: lax.psum(a, "tp"), MESH, (("dp",),), ("dp",))
    fn(X)
    before = threading.active_count()
    for _ in range(20):
        fn(X)
    assert threading.active_count() == before


def test_concurrent_callers() -> None:
    fn = sw.shard_map(lambda a: lax.psum(a, ("dp", "tp")), MESH, (None,), None)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(
        bool(torch.equal(fn(X).to_torch(), 4 * X)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 4


@pytest.mark.parametrize("first", ["import shardwise.spmd.shard_map", "from shardwise import lax",
                                   "from shardwise.spmd.shard_map import shard_map as _f",
                                   "import shardwise.spmd"])
def test_importing_the_module_keeps_the_function_callable(first: str) -> None:
    code = textwrap.dedent(f"""
        {first}
        import torch
        import shardwise
        from shardwise import lax, DeviceMesh
        mesh = DeviceMesh.cpu(2, "x")
        out = shardwise.shard_map(lambda a: lax.psum(a, "x"), mesh, (("x",),), None)(
            torch.ones(4))
        assert out.to_torch().tolist() == [2.0, 2.0], out
        assert shardwise.lax is lax and callable(shardwise.shard_map)
        """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
