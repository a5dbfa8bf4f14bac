"""torch._foreach_norm on shardwise Tensors: the per-tensor norms' values, with one
all_reduce per distinct layout of the reductions instead of one per tensor."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from tests.helpers.meshes import M22

R = Replicated()


def put(value: torch.Tensor, *places: Any) -> Any:
    return sw.tensor(value, sharding=PlacementMapping(M22, list(places)))


def operands() -> tuple[list[Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 4, generator=g) for _ in range(6)]
    values[2][0, 0] = 0.0  # ord 0 counts non-zeros
    layouts = [(Sharded(0), R), (Sharded(0), Sharded(1)), (Sharded(0), R),
               (R, R), (Sharded(0), Sharded(1)), (Sharded(1), Sharded(0))]
    return [put(v, *lay) for v, lay in zip(values, layouts)], values


@pytest.mark.parametrize("ord", [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0])
def test_foreach_norm_equals_the_per_tensor_norms_in_fewer_collectives(ord: float) -> None:
    ts, values = operands()
    with CommCounter() as one_each:
        per = [torch.linalg.vector_norm(t, ord) for t in ts]
        per_values = [p.to_torch() for p in per]
    with CommCounter() as cc:
        got = torch._foreach_norm(ts, ord)
    # (dp), (dp, tp) twice over: (S(dp), S(tp)) and (S(tp), S(dp)) reduce over the
    # same axes; the Replicated one needs none
    assert cc.counts == {"all_reduce": 2}, cc
    assert one_each.counts["all_reduce"] == 5, one_each
    want = torch._foreach_norm(values, ord)
    for g, p, w in zip(got, per_values, want):
        assert g.dist_layout.spec_entries() == () and g.dtype == w.dtype
        assert torch.equal(g.to_torch(), p)  # the same reductions, reduced together
        torch.testing.assert_close(g.to_torch(), w)


def test_foreach_norm_keeps_dtypes_apart_and_takes_plain_tensors_and_partials() -> None:
    x = torch.randn(8, 4)
    ts = [put(x, Sharded(0), R), put(x.to(torch.float64), Sharded(0), R), x * 2,
          put(x, Partial(), R)]
    got = torch._foreach_norm(ts, 2)
    want = [torch.linalg.vector_norm(v) for v in (x, x.double(), x * 2, x)]
    for g, w in zip(got, want):
        value = g.to_torch() if isinstance(g, sw.Tensor) else g
        assert value.dtype == w.dtype
        torch.testing.assert_close(value, w)
    low = torch._foreach_norm([ts[0], ts[0]], 2, dtype=torch.float64)
    assert [n.dtype for n in low] == [torch.float64] * 2
    torch.testing.assert_close(low[0].to_torch(), torch.linalg.vector_norm(x.double()))


def test_clip_grad_norm_takes_the_foreach_path_by_default() -> None:
    ts, values = operands()
    for t in ts:
        t.grad = t.detach() * 1.0
    params = [torch.nn.Parameter(v.clone()) for v in values]
    for p, v in zip(params, values):
        p.grad = v.clone()
    with CommCounter() as cc:
        total = torch.nn.utils.clip_grad_norm_(ts, 1.0)
    want = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert cc.counts == {"all_reduce": 2}, cc
    torch.testing.assert_close(total.to_torch(), want)
    for t, p in zip(ts, params):
        torch.testing.assert_close(t.grad.to_torch(), p.grad)
