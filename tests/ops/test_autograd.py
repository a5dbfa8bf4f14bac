"""torch.autograd.grad / torch.autograd.backward / Tensor.backward(gradient=) on
shardwise Tensors against single-device torch: values, dtype, shape, the layout of
each gradient, create_graph (a gradient penalty, second order), retain_graph, and
allow_unused / materialize_grads semantics equal to torch's.

Inputs come in both of the forms a Tensor holds autograd in: a whole value
(``shardwise.tensor(...).requires_grad_()``, as ``nn.Parameter`` does) and per-device
blocks (``shardwise.tensor(..., requires_grad=True)``, and every Partial leaf).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import M4, M22
from tests.helpers.shardcheck import whole_value

R = Replicated()
LAYOUTS = [
    pytest.param(PlacementMapping(M4, [Sharded(0)]), id="S0"),
    pytest.param(PlacementMapping(M4, [Sharded(1)]), id="Slast"),
    pytest.param(PlacementMapping(M4, [R]), id="R"),
    pytest.param(PlacementMapping(M22, [Sharded(0), Sharded(1)]), id="S0S1"),
    pytest.param(PlacementMapping(M22, [R, Sharded(0)]), id="RS0"),
]
FORMS = ["whole", "blocks"]


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def leaf(value: torch.Tensor, spec: PlacementMapping, form: str) -> sw.Tensor:
    """A leaf Tensor that records gradients on its whole value or on its blocks."""
    if form == "whole":
        x = sw.tensor(value, sharding=spec).requires_grad_()
        assert whole_value(x) is not None and x.is_leaf
        return x
    x = sw.tensor(value, sharding=spec, requires_grad=True)
    assert whole_value(x) is None and x.is_leaf
    return x


def loss_fn(x: Any, w: Any) -> Any:
    return (torch.tanh(x @ w) * x.sum(1, keepdim=True)).sum()


def check(got: Any, want: torch.Tensor, like: sw.Tensor, exact: bool = False) -> None:
    assert isinstance(got, sw.Tensor)
    assert got.dist_layout == like.dist_layout.without_partial(), (got, like)
    value = got.to_torch()
    assert value.dtype == want.dtype and value.shape == want.shape
    if exact:
        assert torch.equal(value, want)
    else:
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("spec", LAYOUTS)
def test_grad_values_and_layouts(spec: PlacementMapping, form: str) -> None:
    xv, wv = rand(4, 4, seed=1), rand(4, 4, seed=2)
    x, w = leaf(xv, spec, form), leaf(wv, spec, form)
    rx, rw = xv.clone().requires_grad_(), wv.clone().requires_grad_()
    gx, gw = torch.autograd.grad(loss_fn(x, w), [x, w])
    want = torch.autograd.grad(loss_fn(rx, rw), [rx, rw])
    check(gx, want[0], x)
    check(gw, want[1], w)
    assert not gx.requires_grad  # no create_graph: a plain value


@pytest.mark.parametrize("form", FORMS)
def test_elementwise_grad_is_bit_identical(form: str) -> None:
    spec = PlacementMapping(M4, [Sharded(0)])
    xv = rand(8, 3)
    x = leaf(xv, spec, form)
    rx = xv.clone().requires_grad_()
    (g,) = torch.autograd.grad((x.sin() * x).sum(), x)
    check(g, torch.autograd.grad((rx.sin() * rx).sum(), rx)[0], x, exact=True)


@pytest.mark.parametrize("form", FORMS)
def test_create_graph_gradient_penalty_and_second_order(form: str) -> None:
    spec = PlacementMapping(M22, [Sharded(0), Sharded(1)])
    xv, wv = rand(4, 4, seed=3), rand(4, 4, seed=4)
    x, w = leaf(xv, spec, form), leaf(wv, spec, form)
    rx, rw = xv.clone().requires_grad_(), wv.clone().requires_grad_()

    def penalty(x: Any, w: Any, grad: Callable[..., Any]) -> Any:
        loss = loss_fn(x, w)
        (g,) = grad(loss, [x], create_graph=True)
        return loss + (g * g).sum(), g

    total, g = penalty(x, w, torch.autograd.grad)
    ref_total, ref_g = penalty(rx, rw, torch.autograd.grad)
    check(g, ref_g.detach(), x)
    assert g.requires_grad  # the gradient records its own graph
    total.backward(retain_graph=True)
    ref_total.backward(retain_graph=True)
    check(x.grad, rx.grad, x)
    check(w.grad, rw.grad, w)
    # second order through torch.autograd.grad itself: d/dw of sum(dloss/dx)
    (h,) = torch.autograd.grad(g.sum(), [w])
    (ref_h,) = torch.autograd.grad(ref_g.sum(), [rw])
    check(h, ref_h, w)


@pytest.mark.parametrize("plain_seed", [True, False])
def test_grad_outputs_and_retain_graph(plain_seed: bool) -> None:
    spec = PlacementMapping(M4, [Sharded(1)])
    xv, seed = rand(4, 8), rand(4, 8, seed=5)
    x = leaf(xv, spec, "whole")
    rx = xv.clone().requires_grad_()
    y, ry = torch.exp(x) * 2, torch.exp(rx) * 2
    cot = seed if plain_seed else sw.tensor(seed, sharding=PlacementMapping(M4, [Sharded(0)]))
    (g1,) = torch.autograd.grad(y, x, grad_outputs=cot, retain_graph=True)
    (g2,) = torch.autograd.grad([y], [x], [cot])  # the graph was kept for this one
    want = torch.autograd.grad(ry, rx, seed)[0]
    check(g1, want, x, exact=True)
    check(g2, want, x, exact=True)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, x, cot)


def test_unused_input_semantics_equal_torch() -> None:
    spec = PlacementMapping(M4, [Sharded(0)])
    xv = rand(4, 2)
    x, unused = leaf(xv, spec, "whole"), leaf(xv, spec, "blocks")
    rx, ru = xv.clone().requires_grad_(), xv.clone().requires_grad_()
    msg = "appears to not have been used in the graph"
    with pytest.raises(RuntimeError, match=msg):
        torch.autograd.grad((rx * 2).sum(), [rx, ru])
    with pytest.raises(RuntimeError, match=msg):
        torch.autograd.grad((x * 2).sum(), [x, unused])
    got = torch.autograd.grad((x * 2).sum(), [x, unused], allow_unused=True)
    want = torch.autograd.grad((rx * 2).sum(), [rx, ru], allow_unused=True)
    assert want[1] is None and got[1] is None
    check(got[0], want[0], x, exact=True)
    got = torch.autograd.grad((x * 2).sum(), [x, unused], materialize_grads=True)
    check(got[1], torch.zeros(4, 2, dtype=torch.float64), unused, exact=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad((x * 2).sum(), [sw.tensor(xv, sharding=spec)])


def test_partially_used_blocks_get_zeros() -> None:
    # only the first two rows (device 0's block) reach the loss: the other blocks'
    # gradients are zero, not an "unused" error
    spec = PlacementMapping(M4, [Sharded(0)])
    xv = rand(8, 2)
    x = leaf(xv, spec, "blocks")
    rx = xv.clone().requires_grad_()
    (g,) = torch.autograd.grad(x[:2].sum() * 3, [x])
    check(g, torch.autograd.grad(rx[:2].sum() * 3, [rx])[0], x, exact=True)


def test_mixed_plain_and_shardwise_and_dict_inputs() -> None:
    spec = PlacementMapping(M4, [Sharded(0)])
    xv, bv = rand(4, 3), rand(3, seed=7)
    x = leaf(xv, spec, "whole")
    b = bv.clone().requires_grad_()  # plain torch, Replicated when mixed in
    rx, rb = xv.clone().requires_grad_(), bv.clone().requires_grad_()
    got = torch.autograd.grad((x * b).sum(), {"x": x, "b": b})
    want = torch.autograd.grad((rx * rb).sum(), {"x": rx, "b": rb})
    check(got["x"], want["x"], x, exact=True)
    assert not isinstance(got["b"], sw.Tensor)
    torch.testing.assert_close(got["b"], want["b"], rtol=1e-12, atol=1e-12)


def test_partial_input_gradient_is_replicated() -> None:
    spec = PlacementMapping(M4, [Partial()])
    parts = [rand(3, seed=k) for k in range(4)]
    x = sw.from_local([p.clone() for p in parts], spec, requires_grad=True)
    (g,) = torch.autograd.grad((x * x).sum(), [x])
    total = sum(parts, torch.zeros(3, dtype=torch.float64))
    assert str(g.dist_layout) == "DeviceMesh(x=4)[R]"
    torch.testing.assert_close(g.to_torch(), 2 * total)


@pytest.mark.parametrize("form", FORMS)
def test_backward_with_sharded_gradients(form: str) -> None:
    spec = PlacementMapping(M22, [Sharded(0), R])
    xv, seed = rand(4, 4), rand(4, 4, seed=9)
    x = leaf(xv, spec, form)
    rx = xv.clone().requires_grad_()
    cot = sw.tensor(seed, sharding=PlacementMapping(M22, [R, Sharded(1)]))
    y = torch.sigmoid(x)
    y.backward(gradient=cot, retain_graph=True)
    torch.sigmoid(rx).backward(gradient=seed)
    check(x.grad, rx.grad, x, exact=True)
    torch.autograd.backward([y], [cot])  # accumulates, as torch's does
    check(x.grad, 2 * rx.grad, x, exact=True)


def test_backward_inputs_accumulate_only_there() -> None:
    spec = PlacementMapping(M4, [Sharded(0)])
    xv, wv = rand(4, 4, seed=1), rand(4, 4, seed=2)
    x, w = leaf(xv, spec, "whole"), leaf(wv, spec, "blocks")
    rx, rw = xv.clone().requires_grad_(), wv.clone().requires_grad_()
    loss_fn(x, w).backward(inputs=[w])
    loss_fn(rx, rw).backward(inputs=[rw])
    assert x.grad is None and rx.grad is None
    check(w.grad, rw.grad, w)


def test_is_grads_batched_is_refused_by_name() -> None:
    x = leaf(rand(4), PlacementMapping(M4, [Sharded(0)]), "whole")
    with pytest.raises(sw.ShardingError, match="is_grads_batched"):
        torch.autograd.grad(x * 2, x, torch.eye(4, dtype=torch.float64),
                            is_grads_batched=True)


def test_torch_func_jvp_values_equal_torch() -> None:
    # jvp reaches shardwise through forward AD's make_dual (gathered, exact)
    xv = rand(4, 3)
    x = sw.tensor(xv, sharding=PlacementMapping(M4, [Sharded(0)]))
    with warnings.catch_warnings():  # (the fallback warns once per process)
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        out, tangent = torch.func.jvp(lambda t: t * t, (x,), (x,))
    assert torch.equal(out.to_torch(), xv * xv)
    assert torch.equal(tangent.to_torch(), 2 * xv * xv)
