"""Gradients through shard_map equal single-device autograd of the equivalent global
function (simulated runtime: one autograd graph across the device threads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded, lax

Fn = Callable[..., Any]


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def check(mesh: DeviceMesh, fn: Fn, in_specs: Any, out_specs: Any, ref: Fn,
          *xs: torch.Tensor) -> None:
    leaves = [x.clone().requires_grad_() for x in xs]
    out = sw.shard_map(fn, mesh, in_specs, out_specs)(*leaves)
    refs = [x.clone().requires_grad_() for x in xs]
    want = ref(*refs)
    coef = data(*want.shape, seed=7)
    assert torch.allclose(out.to_torch(), want)
    (out.to_torch() * coef).sum().backward()
    (want * coef).sum().backward()
    for leaf, r in zip(leaves, refs):
        assert leaf.grad is not None
        assert torch.allclose(leaf.grad, r.grad), (leaf.grad, r.grad)


N = 4
M1 = DeviceMesh.cpu(N, "x")
RING = [(i, (i + 1) % N) for i in range(N)]
SCALE = torch.arange(1, N + 1, dtype=torch.float64).repeat_interleave(2)[:, None]
W = data(3, 2, seed=2)

CASES: dict[str, tuple[Fn, Any, Any, Fn, tuple[torch.Tensor, ...]]] = {
    "psum data parallel (uneven)": (
        lambda a, w: lax.psum((a @ w).sum(0), "x"), (("x",), None), None,
        lambda a, w: (a @ w).sum(0), (data(5, 3), W)),
    "psum tensor parallel": (
        lambda a, b: lax.psum(a @ b, "x"), ((None, "x"), ("x",)), None,
        lambda a, b: a @ b, (data(4, 12), data(12, 2, seed=3))),
    "pmean": (
        lambda a, w: lax.pmean(a @ w, "x"), (("x",), None), None,
        lambda a, w: (a.reshape(N, 2, 3) @ w).mean(0), (data(8, 3), W)),
    "all_gather tiled, replicated out": (
        lambda a, w: (lax.all_gather(a, "x", tiled=True) ** 2) @ w, (("x",), None), None,
        lambda a, w: (a ** 2) @ w, (data(5, 3), W)),
    "all_gather tiled, sharded out": (
        lambda a, w: (lax.all_gather(a, "x", tiled=True) @ w).narrow(
            0, 2 * lax.axis_index("x"), 2) * (lax.axis_index("x") + 1), (("x",), None),
        ("x",), lambda a, w: (a @ w) * SCALE, (data(8, 3), W)),
    "all_gather stacked": (
        lambda a: lax.all_gather(a, "x", axis=1).sum(1) * (lax.axis_index("x") + 1),
        (("x",),), ("x",), lambda a: a.reshape(N, 2, 3).sum(0).repeat(N, 1) * SCALE,
        (data(8, 3),)),
    "psum_scatter tiled": (
        lambda a, b: lax.psum_scatter(a @ b, "x", scatter_dimension=1), ((None, "x"), ("x",)),
        (None, "x"), lambda a, b: a @ b, (data(4, 12), data(12, 5, seed=3))),
    "psum_scatter untiled": (
        lambda a: lax.psum_scatter(a, "x", tiled=False), (("x",),), ("x",),
        lambda a: a.reshape(N, N, 3).sum(0).reshape(-1), (data(N * N, 3),)),
    "ppermute ring": (
        lambda a: lax.ppermute(a, "x", RING) * (lax.axis_index("x") + 1), (("x",),), ("x",),
        lambda a: torch.roll(a, 2, 0) * SCALE, (data(8, 3),)),
    "ppermute partial": (
        lambda a: lax.ppermute(a ** 2, "x", [(0, 3), (3, 1)]), (("x",),), ("x",),
        lambda a: torch.cat([torch.zeros(2, 3, dtype=a.dtype), a[6:8] ** 2,
                             torch.zeros(2, 3, dtype=a.dtype), a[0:2] ** 2]), (data(8, 3),)),
    "all_to_all tiled (uneven)": (
        lambda a: lax.all_to_all(a, "x", 1, 0) ** 2, (("x",),), (None, "x"),
        lambda a: a ** 2, (data(5, 7),)),
    "all_to_all untiled": (
        lambda a: lax.all_to_all(a.reshape(N, 3), "x", 0, 0, tiled=False).sin(),
        (("x",),), ("x",),
        lambda a: a.reshape(N, N, 3).transpose(0, 1).reshape(N * N, 3).sin(),
        (data(N * N, 3),)),
    "pmax": (
        lambda a: lax.pmax(a, "x") * 3, (("x",),), None,
        lambda a: a.reshape(N, 2, 3).amax(0) * 3, (data(8, 3),)),
    "pmin": (
        lambda a: lax.pmin(a, "x") ** 2, (("x",),), None,
        lambda a: a.reshape(N, 2, 3).amin(0) ** 2, (data(8, 3),)),
    "replicated input used by every device": (
        lambda v: lax.psum(v * (lax.axis_index("x") + 1), "x"), (None,), None,
        lambda v: v * (N * (N + 1) / 2), (data(3, 2),)),
    "replicated output from coordinate 0": (
        lambda v: v * 2, (None,), None, lambda v: v * 2, (data(3, 2),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_matches_torch(name: str) -> None:
    fn, ins, outs, ref, xs = CASES[name]
    check(M1, fn, ins, outs, ref, *xs)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_gradients_on_two_axes(shape: tuple[int, int]) -> None:
    mesh = DeviceMesh.cpu(shape, ("dp", "tp"))
    tp, n = shape[1], shape[0] * shape[1]
    check(mesh, lambda a, b: lax.psum(a @ b, "tp"), (("dp", "tp"), ("tp",)), ("dp",),
          lambda a, b: a @ b, data(4, 3 * tp), data(3 * tp, 3, seed=3))
    check(mesh, lambda a: lax.all_gather(a, ("tp", "dp"), tiled=True) * 2,
          ((("dp", "tp"),),), None,
          lambda a: a.reshape(2, tp, 2, 3).transpose(0, 1).reshape(2 * n, 3) * 2,
          data(2 * n, 3))
    check(mesh, lambda a: lax.psum_scatter(a, ("dp", "tp"), scatter_dimension=1),
          ((("dp", "tp"),),), (None, ("dp", "tp")),
          lambda a: a.reshape(n, 2, 7).sum(0), data(2 * n, 7))
    check(mesh, lambda a: lax.all_to_all(a, ("dp", "tp"), 1, 0), ((("dp", "tp"),),),
          (None, ("dp", "tp")), lambda a: a.clone(), data(2 * n, 9))
    ring = [(i, (i + 1) % n) for i in range(n)]
    check(mesh, lambda a: lax.ppermute(a, ("dp", "tp"), ring).exp(), ((("dp", "tp"),),),
          (("dp", "tp"),), lambda a: torch.roll(a, 2, 0).exp(), data(2 * n, 3))


def test_shardwise_tensor_inputs_get_gradients_in_their_layout() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = sw.tensor(data(4, 6), sharding=PlacementMapping(mesh, [Sharded(1), Replicated()]),
                  requires_grad=True)
    w = sw.tensor(data(6, 3, seed=1), sharding=PlacementMapping(mesh, [Replicated()] * 2),
                  requires_grad=True)
    out = sw.shard_map(lambda a, b: lax.psum(a @ b, "tp"), mesh,
                       in_specs=(("dp", "tp"), ("tp",)), out_specs=("dp",))(x, w)
    out.backward(torch.ones(4, 3, dtype=torch.float64))
    xr, wr = x.to_torch().detach().requires_grad_(), w.to_torch().detach().requires_grad_()
    (xr @ wr).sum().backward()
    assert x.grad is not None and w.grad is not None
    assert x.grad.placements == x.placements and w.grad.placements == w.placements
    assert torch.allclose(x.grad.to_torch(), xr.grad)
    assert torch.allclose(w.grad.to_torch(), wr.grad)


def test_functional_grad_and_jvp() -> None:
    t = sw.tensor(data(8, 3), sharding=PlacementMapping(M1, [Sharded(0)]))
    loss = sw.shard_map(lambda a: lax.psum((a ** 3).sum(), "x"), M1, in_specs=(("x",),),
                        out_specs=())
    value, g = sw.value_and_grad(loss)(t)
    x = t.to_torch()
    assert torch.allclose(value.to_torch(), (x ** 3).sum())
    assert g.placements == (Sharded(0),)
    assert torch.allclose(g.to_torch(), 3 * x ** 2)
    gather = sw.shard_map(lambda a: lax.all_gather(a.sin(), "x", tiled=True), M1,
                          in_specs=(("x",),), out_specs=None)
    out, tan = sw.jvp(gather, (t,), (torch.ones(8, 3, dtype=torch.float64),))
    assert torch.allclose(out.to_torch(), x.sin())
    assert torch.allclose(tan.to_torch(), x.cos())


def test_grad_mode_follows_the_caller() -> None:
    x = data(8, 3).requires_grad_()
    fn = sw.shard_map(lambda a: lax.psum(a * 2, "x"), M1, in_specs=(("x",),), out_specs=None)
    with torch.no_grad():
        assert not fn(x).requires_grad
    assert fn(x).requires_grad
    with torch.inference_mode():
        assert fn(torch.ones(8, 3)).to_torch().is_inference()


def test_pmax_ties_split_the_gradient() -> None:
    x = torch.ones(8, 1, dtype=torch.float64, requires_grad=True)
    out = sw.shard_map(lambda a: lax.pmax(a, "x"), M1, in_specs=(("x",),), out_specs=None)(x)
    out.to_torch().sum().backward()
    assert torch.allclose(x.grad, torch.full((8, 1), 0.25, dtype=torch.float64))


def test_autocast_follows_the_caller() -> None:
    mesh = DeviceMesh.cpu(4, "x")
    dtypes: set[torch.dtype] = set()

    def fn(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = a @ w
        dtypes.add(y.dtype)
        return lax.psum(y, "x")

    a, w = torch.ones(8, 4), torch.ones(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sw.shard_map(fn, mesh, (("x",), None), None)(a, w)
    assert dtypes == {torch.bfloat16} and out.dtype == torch.bfloat16
    assert torch.is_grad_enabled()
