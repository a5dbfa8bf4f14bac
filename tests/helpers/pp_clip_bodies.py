"""clip_grad_norm_ across pipeline stages on Gloo ranks: each process holds only its
stage's gradients, so the global norm is reduced over the pp axis (run by
tests/pipelining/test_clip_gloo.py on 4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardwise import DeviceMesh, ShardingError
from shardwise.pipelining import clip_grad_norm_, pipeline


def _models(n: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = nn.Sequential(*(nn.Linear(3, 3) for _ in range(n)))
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    return ref, model


def _check(mesh: DeviceMesh, n: int, norm_type: float) -> None:
    ref, model = _models(n)
    pipe = pipeline(model, mesh, split_points=[str(k) for k in range(1, n)])
    local = {id(p) for p in pipe.parameters()}
    for p in model.parameters():  # this process holds only its stage's gradients
        if id(p) not in local:
            p.grad = None
    norm = clip_grad_norm_(pipe.parameters(), 0.1, norm_type, pipe=pipe)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    named = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-6, atol=0)


def clip_pp_x_tp(world: int) -> None:
    _check(DeviceMesh.cpu((2, world // 2), ("pp", "tp")), 2, 2.0)


def clip_pp_only_inf(world: int) -> None:
    _check(DeviceMesh.cpu(world, "pp"), world, float("inf"))


def clip_needs_the_pipe(world: int) -> None:
    _, model = _models(world)
    with pytest.raises(ShardingError, match="pipe=pipe"):
        clip_grad_norm_(model.parameters(), 0.1)


BODIES = ["clip_pp_x_tp", "clip_pp_only_inf", "clip_needs_the_pipe"]
