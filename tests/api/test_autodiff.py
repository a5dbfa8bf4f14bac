"""Gradients (reverse mode) and tangents (forward mode) of every op against
single-device torch autograd applied to the global value.

For a reducing op on a non-Partial input (psum semantics) the single-device
reference is the sum of the local values; for a Partial input of a non-SUM
op the reference is written over the per-device local values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import shardwise as sw
from shardwise import (
    CPU,
    DeviceMesh,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
)
from shardwise.sharding import Layout
from tests.helpers.meshes import M4, M22, M23
from tests.helpers.shardcheck import assert_shares_replicas

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

SINGLE = PlacementMapping(DeviceMesh.single(CPU(0)), [Replicated()])


def on(mesh: DeviceMesh, *placements) -> PlacementMapping:
    return PlacementMapping(mesh, list(placements))


def rand(shape: tuple, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def scalar(t: torch.Tensor) -> sw.Tensor:
    """A 0-d shardwise Tensor that keeps ``t``'s autograd graph."""
    return sw.from_local([t], SINGLE, shape=())


def weighted(f: Callable, w: torch.Tensor) -> Callable:
    """x -> sum(f(x) * w) as a scalar shardwise Tensor (a generic linear loss)."""
    return lambda x: scalar((f(x).to_torch() * w).sum())


@dataclass(frozen=True)
class Case:
    name: str
    value: tuple  # global shape of the input
    sharding: object  # input sharding (None: single device)
    f: Callable[[sw.Tensor], sw.Tensor]
    ref: Callable[[torch.Tensor], torch.Tensor]  # the same function on the global value

    def make(self, requires_grad: bool = False) -> sw.Tensor:
        return sw.tensor(rand(self.value, 1), sharding=self.sharding,
                         requires_grad=requires_grad)


def blocks_sum(v: torch.Tensor, k: int, dim: int = 0) -> torch.Tensor:
    """Sum of the ``k`` equal blocks of ``v`` along ``dim`` (psum over a sharding axis)."""
    return sum(v.chunk(k, dim))  # type: ignore[return-value]


CASES = [
    # layout ops: the reference is the identity on the global value
    Case("shard R->S0", (5, 3), on(M22, Replicated(), Replicated()),
         lambda x: sw.shard(x, M22, ["dp", None]), lambda v: v),
    Case("shard S0->S1 (all_to_all)", (5, 7), on(M4, Sharded(0)),
         lambda x: sw.shard(x, M4, on(M4, Sharded(1))), lambda v: v),
    Case("shard S(dp)->S(tp,dp)", (6, 5), on(M23, Sharded(0), Replicated()),
         lambda x: sw.shard(x, M23, NamedMapping(M23, (("tp", "dp"), None))), lambda v: v),
    Case("shard S0S1->S1S0", (5, 7), on(M22, Sharded(0), Sharded(1)),
         lambda x: sw.shard(x, M22, on(M22, Sharded(1), Sharded(0))), lambda v: v),
    Case("shard R->P(sum)->R", (4, 3), on(M4, Replicated()),
         lambda x: sw.all_gather(sw.shard(x, M4, on(M4, Partial()))), lambda v: v),
    Case("shard R->P(max)->S0", (4, 3), on(M22, Replicated(), Sharded(1)),
         lambda x: sw.shard(x, M22, on(M22, Partial(ReduceOp.MAX), Sharded(0))), lambda v: v),
    Case("shard empty rows", (0, 3), on(M4, Sharded(0)),
         lambda x: sw.shard(x, M4, on(M4, Sharded(1))), lambda v: v),
    Case("all_gather(0) uneven", (5, 3), on(M22, Sharded(0), Sharded(1)),
         lambda x: sw.all_gather(x, 0), lambda v: v),
    Case("all_gather(None)", (2, 3), on(M23, Sharded(1), Sharded(0)),
         lambda x: sw.all_gather(x), lambda v: v),
    Case("all_gather(-1)", (4, 5), on(M4, Sharded(1)),
         lambda x: sw.all_gather(x, -1), lambda v: v),
    Case("all_to_all uneven", (5, 6), on(M4, Sharded(0)),
         lambda x: sw.all_to_all(x, 1, 0), lambda v: v),
    Case("all_to_all 2-D mesh", (4, 6), on(M23, Replicated(), Sharded(1)),
         lambda x: sw.all_to_all(x, 0, 1), lambda v: v),
    Case("distributed_broadcast", (3, 2), None,
         lambda x: sw.distributed_broadcast(x, M22), lambda v: v),
    Case("to_device single", (5, 3), on(M22, Sharded(0), Sharded(1)),
         lambda x: sw.to_device(x, CPU(1)), lambda v: v),
    Case("cpu", (5, 3), on(M4, Sharded(1)), sw.cpu, lambda v: v),
    Case("transfer_to other mesh", (5, 3), on(M4, Sharded(0)),
         lambda x: sw.transfer_to(x, sharding=on(M23, Sharded(1), Sharded(0))), lambda v: v),
    Case("ppermute cycle", (8, 3), on(M4, Sharded(0)),
         lambda x: sw.ppermute(x, [(k, (k + 1) % 4) for k in range(4)]),
         lambda v: torch.roll(v, 2, 0)),
    Case("ppermute partial (zeros)", (8, 3), on(M4, Sharded(0)),
         lambda x: sw.ppermute(x, [(0, 2), (3, 1)]),
         lambda v: torch.cat([torch.zeros_like(v[:2]), v[6:], v[:2], torch.zeros_like(v[:2])])),
    Case("ppermute along axis", (4, 6), on(M22, Sharded(0), Sharded(1)),
         lambda x: sw.ppermute(x, [(0, 1), (1, 0)], axis_name="tp"),
         lambda v: torch.cat([v[:, 3:], v[:, :3]], 1)),
    # reducing ops on Partial(SUM) inputs: the global value is kept
    Case("all_reduce P(sum)", (4, 3), on(M22, Partial(), Sharded(0)),
         lambda x: sw.all_reduce(x), lambda v: v),
    Case("reduce_scatter P(sum)", (5, 3), on(M4, Partial()),
         lambda x: sw.reduce_scatter(x, 0), lambda v: v),
    Case("reduce_scatter P(sum) 2 axes", (5, 3), on(M22, Partial(), Partial()),
         lambda x: sw.reduce_scatter(x, 1), lambda v: v),
    # psum semantics on non-Partial inputs: the sum of the local values
    Case("all_reduce R (psum)", (3, 2), on(M22, Replicated(), Replicated()),
         lambda x: sw.all_reduce(x), lambda v: 4 * v),
    Case("all_reduce R over tp", (3, 2), on(M23, Replicated(), Replicated()),
         lambda x: sw.all_reduce(x, reduce_axes="tp"), lambda v: 3 * v),
    Case("all_reduce S0 (psum of blocks)", (4, 3), on(M4, Sharded(0)),
         lambda x: sw.all_reduce(x), lambda v: blocks_sum(v, 4)),
    Case("all_reduce S over dp", (4, 6), on(M22, Sharded(0), Sharded(1)),
         lambda x: sw.all_reduce(x, reduce_axes="dp"), lambda v: blocks_sum(v, 2)),
    Case("all_reduce S(dp,tp) over both", (4, 3), NamedMapping(M22, (("tp", "dp"), None)),
         lambda x: sw.all_reduce(x, reduce_axes=("dp", "tp")), lambda v: blocks_sum(v, 4)),
    Case("all_reduce R avg", (3, 2), on(M4, Replicated()),
         lambda x: sw.all_reduce(x, reduce_op="avg"), lambda v: v),
    Case("all_reduce R prod", (3, 2), on(M22, Replicated(), Replicated()),
         lambda x: sw.all_reduce(x, reduce_axes="dp", reduce_op=ReduceOp.PROD),
         lambda v: v * v),
    Case("reduce_scatter R", (6, 2), on(M23, Replicated(), Replicated()),
         lambda x: sw.reduce_scatter(x, 0), lambda v: 6 * v),
    Case("reduce_scatter S1 over tp", (4, 4), on(M22, Replicated(), Sharded(1)),
         lambda x: sw.reduce_scatter(x, 0, reduce_axes="tp"), lambda v: blocks_sum(v, 2, 1)),
    # a chain
    Case("chain", (6, 4), on(M22, Sharded(0), Replicated()),
         lambda x: sw.all_gather(sw.all_to_all(sw.shard(x, M22, on(M22, Sharded(0), Sharded(0))),
                                               1, 0), 1),
         lambda v: v),
]
IDS = [c.name for c in CASES]


def torch_grad(case: Case, w: torch.Tensor) -> torch.Tensor:
    v = case.make().to_torch().detach().requires_grad_()
    (g,) = torch.autograd.grad((case.ref(v) * w).sum(), v)
    return g


def grad_layout(x: sw.Tensor) -> Layout:
    """Gradients land in the input's layout; Partial(SUM) axes come back Replicated."""
    return x.dist_layout.with_partial(tuple(None if op in (None, ReduceOp.SUM) else ReduceOp.SUM
                                       for op in x.dist_layout.partial))


def out_weight(case: Case) -> torch.Tensor:
    return rand(tuple(case.ref(case.make().to_torch()).shape), 2)


# --- reverse mode -----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_torch(case: Case) -> None:
    w = out_weight(case)
    x = case.make(requires_grad=True)
    out = case.f(x)
    torch.testing.assert_close(out.to_torch().detach(), case.ref(x.to_torch().detach()))
    assert out.requires_grad
    weighted(case.f, w)(x).backward()
    g = x.grad
    assert g is not None and g.dist_layout == grad_layout(x) and g.shape == x.shape
    torch.testing.assert_close(g.to_torch(), torch_grad(case, w))
    assert_shares_replicas(g)  # replicas of the gradient share one buffer


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_accumulates(case: Case) -> None:
    w = out_weight(case)
    x = case.make(requires_grad=True)
    weighted(case.f, w)(x).backward()
    weighted(case.f, w)(x).backward()
    torch.testing.assert_close(x.grad.to_torch(), 2 * torch_grad(case, w))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_functional_grad_value_and_grad(case: Case) -> None:
    w = out_weight(case)
    x = case.make()
    loss = weighted(case.f, w)
    g = sw.grad(loss)(x)
    assert g.dist_layout == grad_layout(x)
    torch.testing.assert_close(g.to_torch(), torch_grad(case, w))
    value, g2 = sw.value_and_grad(loss)(x)
    want = (case.ref(x.to_torch()) * w).sum()
    torch.testing.assert_close(value.to_torch(), want)
    assert not value.requires_grad
    torch.testing.assert_close(g2.to_torch(), g.to_torch())
    assert not x.requires_grad and x.grad is None  # functional: the input is untouched


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vjp_matches_torch(case: Case) -> None:
    x = case.make()
    out, vjp_fn = sw.vjp(case.f, x)
    v = x.to_torch()
    torch.testing.assert_close(out.to_torch(), case.ref(v))
    w = rand(out.shape, 3)
    want = torch_grad(case, w)
    # the cotangent as data, in the output's layout, and in another layout
    cots = [w, sw.tensor(w, sharding=out.sharding if out.dist_layout.mesh.is_single
                         else on(out.mesh, *[Replicated()] * out.mesh.ndim))]
    if out.ndim:
        cots.append(sw.tensor(w, sharding=on(M4, Sharded(out.ndim - 1))))
    for cot in cots:
        (g,) = vjp_fn(cot)
        assert g.dist_layout == grad_layout(x)
        torch.testing.assert_close(g.to_torch(), want)


# --- forward mode -----------------------------------------------------------------------
def torch_jvp(case: Case, v: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.func.jvp(case.ref, (v,), (t,))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jvp_matches_torch_func_jvp(case: Case) -> None:
    x = case.make()
    t = rand(x.shape, 4)
    v = x.to_torch()
    want_out, want_tan = torch_jvp(case, v, t)
    # also against torch.autograd.functional.jvp
    alt_out, alt_tan = torch.autograd.functional.jvp(case.ref, (v,), (t,))
    torch.testing.assert_close(alt_out, want_out)
    torch.testing.assert_close(alt_tan, want_tan)
    tangents = [t, sw.tensor(t, sharding=on(M4, Sharded(0))), sw.tensor(t, sharding=x.sharding)]
    for tan in tangents:
        out, tan_out = sw.jvp(case.f, (x,), (tan,))
        assert tan_out.dist_layout == out.dist_layout and tan_out.shape == out.shape
        torch.testing.assert_close(out.to_torch(), want_out)
        torch.testing.assert_close(tan_out.to_torch(), want_tan)
        assert not out.requires_grad


def test_jvp_tangent_is_not_zero_and_is_linear() -> None:
    """The reference system returned zero tangents in forward mode."""
    x = sw.tensor(rand((8, 4), 1), sharding=on(M4, Sharded(0)))
    t = rand((8, 4), 2)
    f = lambda a: sw.all_gather(sw.shard(a, M4, on(M4, Sharded(1))))  # noqa: E731
    _, t1 = sw.jvp(f, (x,), (t,))
    _, t2 = sw.jvp(f, (x,), (3 * t,))
    assert t1.to_torch().abs().sum() > 0
    torch.testing.assert_close(t2.to_torch(), 3 * t1.to_torch())


def test_jvp_two_primals() -> None:
    a = sw.tensor(rand((4, 2), 1), sharding=on(M4, Sharded(0)))
    b = sw.tensor(rand((4, 2), 2), sharding=on(M22, Partial(), Sharded(1)))

    def f(x: sw.Tensor, y: sw.Tensor) -> sw.Tensor:
        return sw.from_local([sw.cpu(x).to_torch() * sw.cpu(y).to_torch()], on(
            DeviceMesh.single(CPU(0)), Replicated()))

    ta, tb = rand((4, 2), 3), rand((4, 2), 4)
    out, tan = sw.jvp(f, (a, b), (ta, tb))
    av, bv = a.to_torch(), b.to_torch()
    torch.testing.assert_close(out.to_torch(), av * bv)
    torch.testing.assert_close(tan.to_torch(), ta * bv + av * tb)


# --- Partial inputs of every reduce op: reference over the local values ------------------
COMBINE = {
    ReduceOp.SUM: lambda xs: sum(xs),
    ReduceOp.AVG: lambda xs: sum(xs) / len(xs),
    ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
    ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
    ReduceOp.PROD: lambda xs: torch.stack(xs).prod(0),
}


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("fn", ["all_reduce", "reduce_scatter", "to_torch", "shard"])
def test_partial_inputs_every_op(op: ReduceOp, fn: str) -> None:
    locals_ = [rand((6, 2), 10 + k) for k in range(4)]
    x = sw.from_local([t.clone() for t in locals_], on(M4, Partial(op)), requires_grad=True)
    ops = {
        "all_reduce": lambda t: sw.all_reduce(t).to_torch(),
        "reduce_scatter": lambda t: sw.reduce_scatter(t, 0).to_torch(),
        "to_torch": lambda t: t.to_torch(),
        "shard": lambda t: sw.shard(t, M4, on(M4, Sharded(1))).to_torch(),
    }
    w = rand((6, 2), 5)
    leaves = [t.clone().requires_grad_() for t in locals_]
    want_value = COMBINE[op](leaves)
    grads = torch.autograd.grad((want_value * w).sum(), leaves)
    out = ops[fn](x)
    torch.testing.assert_close(out, want_value)
    scalar((out * w).sum()).backward()
    g = x.grad
    assert g.dist_layout == grad_layout(x)
    if op is ReduceOp.SUM:  # every partial gets the same gradient: Replicated
        assert g.placements == (Replicated(),)
        torch.testing.assert_close(g.to_torch(), grads[0])
    else:  # per-device derivatives under Partial(SUM)
        assert g.placements == (Partial(ReduceOp.SUM),)
        for k in range(4):
            torch.testing.assert_close(g.shards[k], grads[k])
    # forward mode: per-device tangents through the same reduction. Tangents are laid
    # out like the primal, except that a Partial(PROD) axis linearises to Partial(SUM).
    tans = [rand((6, 2), 20 + k) for k in range(4)]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(locals_, tans, strict=True)]
        want_tan = fwAD.unpack_dual(COMBINE[op](duals)).tangent
    xs = sw.from_local([t.clone() for t in locals_], on(M4, Partial(op)))
    tan_op = ReduceOp.SUM if op is ReduceOp.PROD else op
    tl = sw.from_local(tans, on(M4, Partial(tan_op)))
    _, tan_out = sw.jvp(lambda t: sw.all_reduce(t), (xs,), (tl,))
    torch.testing.assert_close(tan_out.to_torch(), want_tan)


@pytest.mark.parametrize("op", list(ReduceOp))
def test_jvp_of_partial_primal_built_from_a_global_value(op: ReduceOp) -> None:
    """Regression: a Partial(PROD) primal's global tangent was laid out with PROD's
    identity 1 on the off-root devices, so the tangent was not even linear."""
    v, t = rand((3, 2), 1), rand((3, 2), 2)
    for sharding in (on(M4, Partial(op)), on(M22, Partial(op), Partial(ReduceOp.SUM))):
        x = sw.tensor(v, sharding=sharding)
        for f in (sw.cpu, sw.all_reduce, lambda a: a,
                  lambda a: sw.shard(a, a.mesh, on(a.mesh, Sharded(0),
                                                   *[Replicated()] * (a.mesh.ndim - 1)))):
            out, tan = sw.jvp(f, (x,), (t,))
            torch.testing.assert_close(out.to_torch(), v)
            torch.testing.assert_close(tan.to_torch(), t)
            _, tan2 = sw.jvp(f, (x,), (2 * t,))
            torch.testing.assert_close(tan2.to_torch(), 2 * t)


# --- replication never overcounts -------------------------------------------------------
def test_no_overcount_through_broadcast_and_replication() -> None:
    w = rand((3, 2), 1)
    x = sw.tensor(rand((3, 2), 2), requires_grad=True)
    y = sw.distributed_broadcast(x, M22)
    weighted(lambda t: t, w)(y).backward()
    torch.testing.assert_close(x.grad.to_torch(), w)  # not 4 * w
    r = sw.tensor(rand((4, 2), 3), sharding=on(M22, Replicated(), Replicated()),
                  requires_grad=True)
    z = sw.shard(sw.shard(r, M22, on(M22, Sharded(0), Replicated())), M22,
                 on(M22, Replicated(), Replicated()))
    w2 = rand((4, 2), 4)
    weighted(lambda t: t, w2)(z).backward()
    torch.testing.assert_close(r.grad.to_torch(), w2)
    assert all(s is r.grad.shards[0] for s in r.grad.shards)
    # forward: the broadcast tangent is the tangent, not 4x
    _, tan = sw.jvp(lambda t: sw.distributed_broadcast(t, M22), (x.detach(),), (w,))
    torch.testing.assert_close(tan.to_torch(), w)


# --- .backward() on scalar Tensors ----------------------------------------------------
def test_backward_on_a_replicated_scalar() -> None:
    x = sw.tensor(torch.tensor(2.0), sharding=on(M22, Replicated(), Replicated()),
                  requires_grad=True)
    y = sw.all_reduce(x)  # psum: 4 * x
    assert y.item() == 8.0
    y.backward()
    assert x.grad.item() == 4.0 and x.grad.dist_layout == x.dist_layout


def test_backward_on_a_partial_scalar() -> None:
    parts = [torch.tensor(float(k)) for k in range(4)]
    p = sw.from_local(parts, on(M4, Partial()), shape=(), requires_grad=True)
    assert p.item() == 6.0
    p.backward()
    assert p.grad.placements == (Replicated(),) and p.grad.item() == 1.0
    m = sw.from_local(parts, on(M4, Partial(ReduceOp.MAX)), shape=(), requires_grad=True)
    m.backward()
    assert [s.item() for s in m.grad.shards] == [0.0, 0.0, 0.0, 1.0]


def test_backward_with_explicit_gradient() -> None:
    x = sw.tensor(rand((5, 3), 1), sharding=on(M4, Sharded(0)), requires_grad=True)
    y = sw.shard(x, M4, on(M4, Sharded(1)))
    w = rand((5, 3), 2)
    y.backward(w)
    torch.testing.assert_close(x.grad.to_torch(), w)
    x2 = sw.tensor(rand((5, 3), 1), sharding=on(M4, Sharded(0)), requires_grad=True)
    sw.shard(x2, M4, on(M4, Sharded(1))).backward(sw.tensor(w, sharding=on(M22, Sharded(0),
                                                                           Sharded(1))))
    torch.testing.assert_close(x2.grad.to_torch(), w)


# --- functional API details -----------------------------------------------------------
def test_grad_argnums_and_has_aux() -> None:
    a = sw.tensor(rand((4,), 1), sharding=on(M4, Sharded(0)))
    b = sw.tensor(rand((4,), 2), sharding=on(M22, Replicated(), Sharded(0)))

    def f(x: sw.Tensor, y: sw.Tensor):
        s = (sw.cpu(x).to_torch() * sw.cpu(y).to_torch() ** 2).sum()
        return scalar(s), "aux"

    ga, gb = sw.grad(f, argnums=(0, 1), has_aux=True)(a, b)[0]
    av, bv = a.to_torch(), b.to_torch()
    torch.testing.assert_close(ga.to_torch(), bv**2)
    torch.testing.assert_close(gb.to_torch(), 2 * av * bv)
    assert ga.dist_layout == a.dist_layout and gb.dist_layout == b.dist_layout
    (value, aux), g1 = sw.value_and_grad(f, argnums=1, has_aux=True)(a, b)
    assert aux == "aux"
    torch.testing.assert_close(value.to_torch(), (av * bv**2).sum())
    torch.testing.assert_close(g1.to_torch(), 2 * av * bv)
    g_last = sw.grad(lambda x, y: f(x, y)[0], argnums=-1)(a, b)
    torch.testing.assert_close(g_last.to_torch(), 2 * av * bv)
    with pytest.raises(sw.ShardingError, match="argnums"):
        sw.grad(lambda x: f(x, x)[0], argnums=3)(a)


def test_vjp_two_primals_and_partial_cotangent() -> None:
    a = sw.tensor(rand((4, 2), 1), sharding=on(M4, Sharded(0)))
    b = sw.tensor(rand((4, 2), 2), sharding=on(M22, Sharded(1), Sharded(0)))
    out, fn = sw.vjp(lambda x, y: sw.shard(x, M22, on(M22, Sharded(0), Replicated())), a, b)
    w = rand((4, 2), 3)
    cot = sw.tensor(w, sharding=on(M22, Partial(), Replicated()))  # any layout, even Partial
    ga, gb = fn(cot)
    torch.testing.assert_close(out.to_torch(), a.to_torch())
    torch.testing.assert_close(ga.to_torch(), w)
    torch.testing.assert_close(gb.to_torch(), torch.zeros(4, 2, dtype=torch.float64))
    assert gb.dist_layout == b.dist_layout
