"""The Megatron MLP on the simulated 2x4 mesh: zero collectives to a Partial(SUM)
over tp, one all_reduce in the whole forward, values and gradients equal torch.
(The same check runs on Gloo ranks as ``body_megatron`` in tests/runtime/test_gloo.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.debug import CommCounter
from shardwise.runtime import simulated
from shardwise.sharding import ReduceOp
from tests.helpers.computecheck import MESH, lay, values

XV, AV, BV = values(8, 16, seed=1), values(16, 12, seed=2) / 4, values(12, 16, seed=3) / 4


def forward() -> tuple[sw.Tensor, list[sw.Tensor], CommCounter]:
    x = sw.tensor(XV, sharding=lay(MESH, "dp", None), requires_grad=True)
    w1 = sw.tensor(AV, sharding=lay(MESH, None, "tp"), requires_grad=True)
    w2 = sw.tensor(BV, sharding=lay(MESH, "tp", None), requires_grad=True)
    with CommCounter() as cc:
        h = sw.gelu(x @ w1)
        assert str(h.dist_layout).endswith("[S(dp), S(tp)]"), h.dist_layout
        partial = h @ w2
        assert cc.total == 0, cc
        assert partial.dist_layout.partial == (None, ReduceOp.SUM)
        assert partial.dist_layout.dims == ((0,), ())
        out = sw.all_reduce(partial)
    assert dict(cc.counts) == {"all_reduce": 1}, cc
    return out, [x, w1, w2], cc


def reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    refs = [v.clone().requires_grad_(True) for v in (XV, AV, BV)]
    out = F.gelu(refs[0] @ refs[1]) @ refs[2]
    (out ** 2).sum().backward()
    return out, refs


@pytest.mark.parametrize("loss", ["torch", "shardwise"])
def test_megatron_mlp(loss: str) -> None:
    expect, refs = reference()
    out, params, _ = forward()
    assert torch.allclose(out.to_torch(), expect.detach(), atol=1e-10)
    if loss == "torch":
        (out.to_torch() ** 2).sum().backward()
    else:
        scalar = (out ** 2).sum()
        assert scalar.shape == ()
        scalar.backward()
    for p, r in zip(params, refs):
        assert p.grad is not None and r.grad is not None
        assert p.grad.dist_layout == p.dist_layout
        assert torch.allclose(p.grad.to_torch(), r.grad, atol=1e-10)


def test_megatron_functional_grad() -> None:
    _, refs = reference()

    def f(x: sw.Tensor, w1: sw.Tensor, w2: sw.Tensor) -> sw.Tensor:
        return (sw.all_reduce(sw.gelu(x @ w1) @ w2) ** 2).sum()

    x = sw.tensor(XV, sharding=lay(MESH, "dp", None))
    w1 = sw.tensor(AV, sharding=lay(MESH, None, "tp"))
    w2 = sw.tensor(BV, sharding=lay(MESH, "tp", None))
    grads = sw.grad(f, argnums=(0, 1, 2))(x, w1, w2)
    for g, r in zip(grads, refs):
        assert torch.allclose(g.to_torch(), r.grad, atol=1e-10)


def test_diverge_axes_of_the_megatron_ops() -> None:
    """x is replicated over tp but x @ W1 is sharded there (and W1 over dp): their
    gradients are sums of shares, which the backend's diverge provides."""
    from shardwise.propagation.binding import bind
    from shardwise.propagation.decide import decide

    x, w1 = lay(MESH, "dp", None), lay(MESH, None, "tp")
    dec = decide(bind("matmul", ((8, 16), (16, 12))), (x, w1), (None, None), (8, 8))
    assert dec.diverge == ((1,), (0,))
    dec = decide(bind("mul", ((8, 16), ())), (x, None), (None, ()), (8, 0))
    assert dec.diverge == ((), ())
    p = lay(MESH, None, None, partial={"tp": ReduceOp.SUM})
    dec = decide(bind("mul", ((8, 16), (8, 16))), (p, lay(MESH, None, None)), (None, None),
                 (8, 8))
    assert dec.diverge == ((), (1,))


def test_simulated_diverge_is_the_identity() -> None:
    shards = [torch.ones(2)] * 8
    out = simulated.diverge(shards, lay(MESH, None), (0, 1))
    assert all(a is b for a, b in zip(out, shards))


def test_replicated_scalar_times_sharded_gradient() -> None:
    c = sw.tensor(torch.tensor(3.0, dtype=torch.float64), sharding=lay(MESH),
                  requires_grad=True)
    x = sw.tensor(XV, sharding=lay(MESH, "dp", "tp"), requires_grad=True)
    (c * x).sum().backward()
    assert c.grad is not None and x.grad is not None
    assert torch.allclose(c.grad.to_torch(), XV.sum())
    assert torch.allclose(x.grad.to_torch(), torch.full_like(XV, 3.0))


def test_forward_mode_tangents() -> None:
    x = sw.tensor(XV, sharding=lay(MESH, "dp", None))
    w1 = sw.tensor(AV, sharding=lay(MESH, None, "tp"))
    tangent = values(8, 16, seed=9)
    out, tan = sw.jvp(lambda t: (t @ w1).tanh().sum(1), (x,), (tangent,))
    ref, ref_tan = torch.func.jvp(lambda t: torch.tanh(t @ AV).sum(1), (XV,), (tangent,))
    assert torch.allclose(out.to_torch(), ref) and torch.allclose(tan.to_torch(), ref_tan)
