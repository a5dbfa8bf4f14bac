"""Values of every lax collective inside shard_map against a pure-torch reference,
on 1-D (4) and 2-D (2x2, 2x4) simulated meshes, by single axis and by tuples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, lax

MESHES = [((4,), ("x",)), ((2, 2), ("dp", "tp")), ((2, 4), ("dp", "tp"))]
Ref = Callable[[list[torch.Tensor], int], torch.Tensor]


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def axis_choices(names: tuple[str, ...]) -> list[Any]:
    return [*names, *([names, names[::-1]] if len(names) > 1 else [])]


def size_of(mesh: DeviceMesh, axes: Any) -> int:
    out = 1
    for a in (axes,) if isinstance(axes, str) else axes:
        out *= mesh.axis_size(a)
    return out


def members(mesh: DeviceMesh, axes: Any, k: int) -> list[int]:
    """The devices differing from k only along ``axes``, row-major over ``axes``."""
    idx = [mesh.axis_names.index(a) for a in ((axes,) if isinstance(axes, str) else axes)]
    me = mesh.coord_of(k)
    same = [j for j in range(mesh.num_devices)
            if all(c == me[a] for a, c in enumerate(mesh.coord_of(j)) if a not in idx)]
    return sorted(same, key=lambda j: tuple(mesh.coord_of(j)[a] for a in idx))


def per_device(mesh: DeviceMesh, x: torch.Tensor, body: Callable[[torch.Tensor], Any]
               ) -> list[Any]:
    """body(block) on each device; x split over all mesh axes on dim 0 (device k: piece k)."""
    seen: dict[int, Any] = {}
    names = mesh.axis_names

    def fn(a: torch.Tensor) -> torch.Tensor:
        seen[lax.axis_index(names)] = body(a)
        return a

    sw.shard_map(fn, mesh, in_specs=((names,),), out_specs=(names,))(x)
    return [seen[k] for k in range(mesh.num_devices)]


def cases(g: int) -> list[tuple[str, Callable[[torch.Tensor, Any], torch.Tensor], Ref]]:
    ring = [(i, (i + 1) % g) for i in range(g)]
    out: list[tuple[str, Callable[[torch.Tensor, Any], torch.Tensor], Ref]] = [
        ("psum", lambda a, ax: lax.psum(a, ax), lambda v, p: torch.stack(v).sum(0)),
        ("pmean", lambda a, ax: lax.pmean(a, ax), lambda v, p: torch.stack(v).mean(0)),
        ("pmax", lambda a, ax: lax.pmax(a, ax), lambda v, p: torch.stack(v).amax(0)),
        ("pmin", lambda a, ax: lax.pmin(a, ax), lambda v, p: torch.stack(v).amin(0)),
        ("psum_scatter tiled 0 (uneven)", lambda a, ax: lax.psum_scatter(a, ax),
         lambda v, p: sum(v).tensor_split(len(v), 0)[p]),
        ("psum_scatter tiled 1", lambda a, ax: lax.psum_scatter(a, ax, scatter_dimension=1),
         lambda v, p: sum(v).tensor_split(len(v), 1)[p]),
        ("psum_scatter", lambda a, ax: lax.psum_scatter(a.repeat(1, 2)[:, :g], ax,
                                                        scatter_dimension=1, tiled=False),
         lambda v, p: sum(v).repeat(1, 2)[:, p]),
        ("ppermute ring", lambda a, ax: lax.ppermute(a, ax, ring), lambda v, p: v[p - 1]),
        ("ppermute pair", lambda a, ax: lax.ppermute(a, ax, [(g - 1, 0)]),
         lambda v, p: v[-1] if p == 0 else torch.zeros_like(v[p])),
        ("axis_index/size", lambda a, ax: a * lax.axis_index(ax) + lax.axis_size(ax),
         lambda v, p: v[p] * p + len(v)),
    ]
    for d in (0, 1, -1):
        out.append((f"all_gather tiled {d}", lambda a, ax, d=d: lax.all_gather(
            a, ax, axis=d, tiled=True), lambda v, p, d=d: torch.cat(v, d)))
        out.append((f"all_gather {d}", lambda a, ax, d=d: lax.all_gather(a, ax, axis=d),
                    lambda v, p, d=d: torch.stack(v, d)))
    for s, c in ((1, 0), (0, 1), (0, 0), (1, 1)):
        out.append((f"all_to_all tiled {s}->{c}", lambda a, ax, s=s, c=c: lax.all_to_all(
            a, ax, s, c), lambda v, p, s=s, c=c: torch.cat(
                [b.tensor_split(len(v), s)[p] for b in v], c)))
        out.append((f"all_to_all {s}->{c}", lambda a, ax, s=s, c=c: lax.all_to_all(
            a.repeat(3, 3).narrow(s, 0, g), ax, s, c, tiled=False),
            lambda v, p, s=s, c=c: torch.stack(
                [b.repeat(3, 3).narrow(s, 0, g).select(s, p) for b in v], c)))
    return out


@pytest.mark.parametrize("shape, names", MESHES, ids=lambda v: str(v))
def test_collectives_match_reference(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = DeviceMesh.cpu(shape, names)
    x = data(3 * mesh.num_devices, 5)
    blocks = list(x.tensor_split(mesh.num_devices))
    for axes in axis_choices(names):
        for what, body, ref in cases(size_of(mesh, axes)):
            got = per_device(mesh, x, lambda a, body=body, axes=axes: body(a, axes))
            for k, g in enumerate(got):
                group = members(mesh, axes, k)
                want = ref([blocks[m] for m in group], group.index(k))
                assert g.shape == want.shape, (what, axes, k, g.shape, want.shape)
                assert torch.allclose(g, want), (what, axes, k)


def test_tuple_axis_order_sets_piece_order() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = torch.arange(4.0)[:, None]
    got = per_device(mesh, x, lambda a: lax.all_gather(a, ("tp", "dp"), tiled=True))
    assert got[0].flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    idx = per_device(mesh, x, lambda a: torch.tensor(lax.axis_index(("tp", "dp"))))
    assert [int(i) for i in idx] == [0, 2, 1, 3]


def test_reductions_of_constants_and_sequences() -> None:
    mesh = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    got = per_device(mesh, torch.zeros(8, 1), lambda a: (
        lax.psum(1, "tp"), lax.psum(2, ("dp", "tp")), lax.pmax(3.0, "dp"),
        lax.psum((a + 1, a + 2), "tp")))
    for sizes in got:
        assert sizes[:3] == (4, 16, 3.0)
        assert isinstance(sizes[3], tuple)
        assert torch.equal(sizes[3][0], torch.full((1, 1), 4.0))
        assert torch.equal(sizes[3][1], torch.full((1, 1), 8.0))


def test_integer_psum_keeps_dtype() -> None:
    mesh = DeviceMesh.cpu(4, "x")
    got = per_device(mesh, torch.arange(4, dtype=torch.int32)[:, None],
                     lambda a: lax.psum(a, "x"))
    assert all(g.dtype == torch.int32 and g.item() == 6 for g in got)


def test_uneven_blocks_five_rows_over_four() -> None:
    mesh = DeviceMesh.cpu(4, "x")
    x = data(5, 3)
    shapes: dict[int, tuple[int, ...]] = {}

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shapes[lax.axis_index("x")] = tuple(a.shape)
        full = lax.all_gather(a, "x", tiled=True)
        moved = lax.ppermute(a, "x", [(i, (i + 1) % 4) for i in range(4)])
        return a + 1, full, lax.all_to_all(a, "x", 1, 0), moved.sum(0)

    y, full, cols, moved = sw.shard_map(
        fn, mesh, in_specs=(("x",),), out_specs=(("x",), None, (None, "x"), ("x",)))(x)
    assert shapes == {0: (2, 3), 1: (1, 3), 2: (1, 3), 3: (1, 3)}
    assert y.shape == (5, 3) and [s.shape[0] for s in y.shards] == [2, 1, 1, 1]
    assert torch.allclose(y.to_torch(), x + 1)
    assert torch.allclose(full.to_torch(), x)
    assert cols.shape == (5, 3) and [s.shape[1] for s in cols.shards] == [1, 1, 1, 0]
    assert torch.allclose(cols.to_torch(), x)
    blocks = x.tensor_split(4)
    want = torch.cat([blocks[(k - 1) % 4].sum(0) for k in range(4)])
    assert torch.allclose(moved.to_torch(), want)


@pytest.mark.parametrize("shape, names", MESHES, ids=lambda v: str(v))
def test_data_parallel_matmul_with_psum(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = DeviceMesh.cpu(shape, names)
    x, w = data(10, 6), data(6, 3, seed=1)

    def step(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = a @ w
        return y, lax.psum(a.T @ y, names)

    y, gram = sw.shard_map(step, mesh, in_specs=((names, None), None),
                           out_specs=((names, None), None))(x, w)
    assert torch.allclose(y.to_torch(), x @ w)
    assert torch.allclose(gram.to_torch(), x.T @ (x @ w))
    assert gram.placements == (sw.Replicated(),) * mesh.ndim


def test_tensor_parallel_mlp_on_two_axes() -> None:
    """Megatron-style: columns then rows of the weights over tp, batch over dp."""
    mesh = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    x, w1, w2 = data(6, 5), data(5, 8, seed=1), data(8, 5, seed=2)

    def mlp(a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return lax.psum(torch.relu(a @ w1) @ w2, "tp")

    y = sw.shard_map(mlp, mesh, in_specs=(("dp", None), (None, "tp"), ("tp", None)),
                     out_specs=("dp", None))(x, w1, w2)
    assert torch.allclose(y.to_torch(), torch.relu(x @ w1) @ w2)
