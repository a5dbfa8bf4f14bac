"""torch.func's transforms over shardwise Tensors. The transforms wrap a Tensor below
``__torch_function__``, so each aten op they run on it reaches ``__torch_dispatch__``
and runs on the gathered values (the fallback: values exact, one
ShardwiseFallbackWarning per op; an error under ``shardwise.strict()``) and returns
plain tensors of the global values (views stay Replicated Tensors); the transform's own
autograd and batching do the rest. Compared with plain torch: values, dtype, shape.
Refused by name: writes in place into a shardwise Tensor under a transform, and a
Tensor holding the transform's wrapped values crossing out of it (jacfwd / hessian,
vmap mixing its input with a shardwise Tensor it does not see)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.func import grad, grad_and_value, jacfwd, jacrev, vjp, vmap

import shardwise as sw
from shardwise import PlacementMapping, Sharded
from shardwise.ops import registry
from tests.helpers.meshes import M2, M22

X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
W = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.fixture(autouse=True)
def _quiet_fallbacks() -> Iterator[None]:
    """Every aten op under a transform is a fallback: these tests check values (one
    test checks the warning itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        yield


def forms() -> dict[str, Callable[[], sw.Tensor]]:
    """X as a whole-value Tensor, as blocks (rows), as blocks of a 2-D mesh (columns
    over tp, rows over dp), and Partial."""
    rows = PlacementMapping(M2, [Sharded(0)])
    grid = PlacementMapping(M22, [Sharded(0), Sharded(1)])
    return {
        "whole": lambda: sw.tensor(X, sharding=rows),
        "blocks": lambda: sw.from_local([X[:2].clone(), X[2:].clone()], rows, shape=(4, 6)),
        "grid": lambda: sw.tensor(X, sharding=grid),
        "partial": lambda: sw.from_local([X * 0.25, X * 0.75],
                                         PlacementMapping(M2, [sw.Partial()]), shape=(4, 6)),
    }


def value(t: Any) -> torch.Tensor:
    return t.to_torch() if isinstance(t, sw.Tensor) else t


def same(got: Any, want: torch.Tensor) -> None:
    v = value(got)
    assert v.dtype == want.dtype and v.shape == want.shape, (v.dtype, v.shape, want.shape)
    torch.testing.assert_close(v, want, rtol=1e-12, atol=1e-12)


def loss(t: torch.Tensor) -> torch.Tensor:
    return (t @ W).tanh().pow(2).mean() + t.softmax(-1)[:, ::2].sum()


TRANSFORMS: dict[str, Callable[[Any], Any]] = {
    "grad": lambda x: grad(loss)(x),
    "grad_argnums": lambda x: grad(lambda t, w: (t @ w).sin().sum(), argnums=(0, 1))(x, W),
    "vjp": lambda x: vjp(lambda t: t.sin() * t, x)[1](torch.ones_like(X))[0],
    "jacrev": lambda x: jacrev(lambda t: (t @ W).sum(0))(x),
    "vmap": lambda x: vmap(lambda r: (r * 2).cumsum(0).sum())(x),
    "vmap_in_dims_1": lambda x: vmap(lambda c: c.max(), in_dims=1)(x),
    "vmap_of_grad": lambda x: vmap(grad(lambda r: (r * r).sin().sum()))(x),
    "per_sample_linear": lambda x: vmap(grad(lambda r: (r @ W).tanh().sum()))(x),
    "int_vmap": lambda x: vmap(lambda r: r.long() // 2)(x),
}


@pytest.mark.parametrize("form", list(forms()))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transforms_over_a_shardwise_tensor_equal_torch(transform: str, form: str) -> None:
    fn = TRANSFORMS[transform]
    got, want = fn(forms()[form]()), fn(X)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        same(g, w)


@pytest.mark.parametrize("form", ["whole", "blocks"])
def test_grad_wrt_a_plain_input_with_shardwise_values_inside(form: str) -> None:
    """A function of a plain input and of shardwise Tensors it closes over."""
    x = forms()[form]()
    same(grad(lambda w: (x @ w).tanh().pow(2).mean())(W),
         grad(lambda w: (X @ w).tanh().pow(2).mean())(W))
    same(vjp(lambda w: x @ w, W)[1](torch.ones(4, 3, dtype=torch.float64))[0],
         vjp(lambda w: X @ w, W)[1](torch.ones(4, 3, dtype=torch.float64))[0])
    same(vmap(lambda r: (x @ r).to_torch())(W.T), vmap(lambda r: X @ r)(W.T))


def test_each_aten_op_is_a_named_fallback_and_strict_refuses_it() -> None:
    x = forms()["whole"]()
    registry._WARNED.discard("aten.mul.Tensor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad(lambda t: (t * t).sum())(x)
    assert any("aten.mul.Tensor" in str(w.message) for w in caught
               if issubclass(w.category, sw.ShardwiseFallbackWarning))
    with sw.strict(), pytest.raises(sw.ShardingError, match=r"aten\.mul\.Tensor has no sharding"):
        grad(lambda t: (t * t).sum())(x)


def test_in_place_writes_into_a_shardwise_tensor_are_refused() -> None:
    """A write into the transformed Tensor (or a view of it) would land in a gathered
    copy; writes into the plain values ops return are torch's own."""
    x = forms()["whole"]()
    for write in (lambda r: r.mul_(2), lambda r: r.view(-1).mul_(2)):  # torch writes x
        with pytest.raises(sw.ShardingError, match=r"torch.func \(vmap\) ran aten.mul_.Tensor, "
                                                   r"which writes in place"):
            vmap(write)(x)
    assert torch.equal(x.to_torch(), X)
    same(grad(lambda t: t.clone().mul_(2).sum())(x), torch.full_like(X, 2.0))


def test_shardwise_values_the_transform_does_not_see() -> None:
    """A shardwise Tensor the function closes over, beside the transformed one: its
    gradients (and grad_and_value's value) equal torch's; vmap cannot unwrap what the
    mix leaves inside a shardwise result, and refuses it by name."""
    x = forms()["whole"]()
    w = sw.tensor(W, sharding=PlacementMapping(M2, [Sharded(1)]))
    for got, want in zip(grad_and_value(lambda t: (t @ w).sin().sum())(x),
                         grad_and_value(lambda t: (t @ W).sin().sum())(X)):
        same(got, want)
    same(vmap(grad(lambda r: (r @ w).sin().sum()))(x),
         vmap(grad(lambda r: (r @ W).sin().sum()))(X))
    with pytest.raises(sw.ShardingError, match="wrapped tensors"):
        vmap(lambda r: (r[:3] * w[0]).sum())(x)


@pytest.mark.parametrize("case", ["jacfwd", "hessian", "vmap_returns_shardwise"])
def test_wrapped_values_crossing_out_are_refused(case: str) -> None:
    """Values the transform wrapped, held inside a shardwise Tensor that leaves the
    transform: it cannot unwrap them, so the next op on them is refused by name."""
    x = forms()["whole"]()
    call = {"jacfwd": lambda: jacfwd(lambda t: (t @ W).sum(0))(x),
            "hessian": lambda: torch.func.hessian(lambda t: t.pow(3).sum())(x),
            "vmap_returns_shardwise": lambda: vmap(lambda r: x @ r)(W.T)}[case]
    with pytest.raises(sw.ShardingError, match=r"wrapped tensors.*Return x\.to_torch\(\)"):
        call()


def test_results_are_plain_global_values() -> None:
    """Layouts are not kept under a transform: every op ran on gathered values."""
    g = grad(lambda t: (t * t).sum())(forms()["grid"]())
    assert type(g) is torch.Tensor
    same(g, 2 * X)
