"""torch-native bodies shared by both runtimes: ``n`` devices as a simulated mesh or
``n`` Gloo processes (see ``harness.py``). Each compares with single-device torch,
which every rank computes itself from the same seed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded

R = Replicated()


def _mesh(n: int) -> DeviceMesh:
    return DeviceMesh.cpu((2, n // 2), ("dp", "tp")) if n >= 4 else DeviceMesh.cpu((1, n),
                                                                                  ("dp", "tp"))


def megatron(model: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """Column-parallel first layer, row-parallel second, over mesh axis 1 ("tp")."""
    def put(p: torch.Tensor, *places: Any) -> nn.Parameter:
        return nn.Parameter(sw.tensor(p.detach(), sharding=PlacementMapping(mesh, places)))

    model[0].weight = put(model[0].weight, R, Sharded(0))
    model[0].bias = put(model[0].bias, R, Sharded(0))
    model[2].weight = put(model[2].weight, R, Sharded(1))
    model[2].bias = put(model[2].bias, R, R)
    return model


def body_megatron_mlp_adamw_clip(n: int) -> None:
    """5 AdamW steps with clip_grad_norm_ on a column/row-parallel MLP: the losses,
    the global grad norms and the parameters equal single-device torch's to 1e-5."""
    mesh = _mesh(n)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    model = megatron(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), R]))
        ys = sw.tensor(y, sharding=PlacementMapping(mesh, [Sharded(0), R]))
        loss = ((model(xs) - ys) ** 2).mean()
        rloss = F.mse_loss(ref(x), y)
        opt.zero_grad()
        ropt.zero_grad()
        loss.backward()
        rloss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ropt.step()
        assert abs(float(loss) - float(rloss)) <= 1e-5 * abs(float(rloss)), (loss, rloss)
        assert abs(float(norm) - float(rnorm)) <= 1e-5 * float(rnorm), (norm, rnorm)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), rtol=1e-5, atol=1e-6)
        for state in opt.state[p].values():
            if isinstance(state, sw.Tensor) and state.ndim:
                assert state.dist_layout == p.dist_layout
                # each process holds only its own shards
                assert len(state.addressable_shards) == len(p.addressable_shards)


def body_torch_ops_on_process_meshes(n: int) -> None:
    """A transformer's ops on sharded tensors equal torch's on every rank."""
    mesh = _mesh(n)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    w, b = torch.ones(8), torch.zeros(8)
    cases = [
        (lambda t: F.layer_norm(t, (8,), w, b), None),
        (lambda t: F.softmax(t, -1), None),
        (lambda t: t.transpose(1, 2).reshape(4, -1), None),
        (lambda t: torch.cat([t, t], 1).sum(1), None),
        (lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), None),
        (lambda t: t.var(-1), None),
    ]
    for fn, _ in cases:
        torch.testing.assert_close(fn(xs).to_torch(), fn(x), rtol=1e-5, atol=1e-6)
    torch.manual_seed(3)
    want = F.dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(F.dropout(xs, 0.3).to_torch(), want)


def body_init_matches_single_device(n: int) -> None:
    """Every process seeds alike and initializes its own blocks: the model equals
    single-device torch's init (drawn per block, the blocks would repeat per process)."""
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module

    mesh = _mesh(n)

    def mlp() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def planned(model: nn.Sequential) -> nn.Sequential:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           axis="tp")
        return fully_shard(model, mesh, axis="dp")

    with torch.device("meta"):  # deferred init: planned on meta, made real per process
        deferred = planned(mlp())
    deferred.to_empty(device="cpu")
    plain, model = mlp(), planned(mlp())
    for m in (plain, model, deferred):
        torch.manual_seed(5)
        for layer in (m[0], m[2]):
            layer.reset_parameters()
            nn.init.trunc_normal_(layer.weight, std=0.02)
        with torch.no_grad():
            m[2].bias.uniform_(-1.0, 1.0)
        m[0].bias.data.normal_()
    for m in (model, deferred):
        for (k, p), q in zip(m.named_parameters(), plain.parameters()):
            assert p.dist_layout.sharded_axes, k
            assert torch.equal(p.to_torch(), q), k
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), R]))
    torch.testing.assert_close(deferred(xs).to_torch(), plain(x))


def body_views_and_elementwise_on_process_meshes(n: int) -> None:
    """Views, splits, joins and the shared elementwise rule (issue 20) on blocks held by
    separate processes: torch's bits on every rank (only the gathers move data)."""
    mesh = _mesh(n)
    x = torch.rand(5, 6, 7, generator=torch.Generator().manual_seed(2)) * 0.9 + 0.05
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(2)]))
    ids = (x * 9).long()
    ids_s = sw.tensor(ids, sharding=PlacementMapping(mesh, [Sharded(1), Sharded(0)]))
    cases = [
        lambda t: torch.diagonal(t, 1, 0, 2), lambda t: torch.diag_embed(t[0]),
        lambda t: t.unfold(2, 3, 2), lambda t: torch.select_scatter(t, t[:, 0], 1, 3),
        lambda t: torch.tensor_split(t, [1, 4], 2)[1], lambda t: t[:, :1].expand(5, 4, 7),
        lambda t: t.repeat(1, 2, 1), lambda t: torch.rot90(t, 1, (0, 2)),
        lambda t: torch.meshgrid(t[0, 0], t[0, :, 0], indexing="xy")[0],
        lambda t: torch.hstack([t, t]), lambda t: torch.acos(t), lambda t: torch.lgamma(t),
        lambda t: torch.frexp(t).exponent, lambda t: torch.special.i0e(t),
        lambda t: t.movedim(0, -1).cfloat(),
    ]
    for fn in cases:
        assert torch.equal(fn(xs).to_torch(), fn(x))
    assert torch.equal(F.one_hot(ids_s).to_torch(), F.one_hot(ids))


def body_torch_func_transforms(n: int) -> None:
    """torch.func over shardwise Tensors (each aten op on gathered values, exact):
    ``grad`` w.r.t. a Sharded input and, through ``functional_call``, w.r.t. a Megatron
    MLP's shardwise parameters, and per-sample gradients (``vmap(grad(...))``) equal
    single-device torch's. A loss mixing the transformed input with parameters the
    transform does not see runs on the simulated mesh and is refused on processes (a
    collective would get the transform's wrapped tensor)."""
    import warnings

    from torch.func import functional_call, grad, vmap

    mesh = _mesh(n)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    model = megatron(copy.deepcopy(ref), mesh)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [R, Sharded(0)]))

    def loss(mod: nn.Module) -> Any:
        return lambda p, xb, yb: F.cross_entropy(functional_call(mod, p, (xb,)), yb)

    def value(t: Any) -> torch.Tensor:
        return t.to_torch() if isinstance(t, sw.Tensor) else t

    ps = {k: v.detach() for k, v in model.named_parameters()}
    rps = {k: v.detach() for k, v in ref.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        gp = grad(loss(model))(ps, x, y)
        per = vmap(grad(lambda p, xb, yb: loss(model)(p, xb[None], yb[None])),
                   in_dims=(None, 0, 0))(ps, x, y)
        gs = grad(lambda t: (t @ t.T).tanh().sum())(xs)  # the input transformed alone
        if sw.distributed.process_count() == 1:  # the model's own parameters in the loss
            gx = value(grad(lambda t: F.cross_entropy(model(t), y))(xs))
            torch.testing.assert_close(gx, grad(lambda t: F.cross_entropy(ref(t), y))(x))
        else:  # on a process mesh a collective meets the transformed input: refused
            with pytest.raises(sw.ShardingError, match="reached a collective"):
                grad(lambda t: F.cross_entropy(model(t), y))(xs)
    torch.testing.assert_close(value(gs), grad(lambda t: (t @ t.T).tanh().sum())(x))
    want = grad(loss(ref))(rps, x, y)
    want_per = vmap(grad(lambda p, xb, yb: loss(ref)(p, xb[None], yb[None])),
                    in_dims=(None, 0, 0))(rps, x, y)
    for name in rps:
        torch.testing.assert_close(value(gp[name]), want[name], msg=name)
        torch.testing.assert_close(value(per[name]), want_per[name], msg=name)


BODIES = ["body_megatron_mlp_adamw_clip", "body_torch_func_transforms",
          "body_torch_ops_on_process_meshes", "body_init_matches_single_device",
          "body_views_and_elementwise_on_process_meshes"]
