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


# --- the batched path: torch's foreach op once on the local pieces --------------------
def _lists(blocks: bool) -> tuple[list[Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    values = [torch.rand(5, 4, generator=g) + 0.5, torch.rand(8, generator=g) + 0.5,
              torch.rand(0, 3, generator=g)]
    places = [(Sharded(0), Sharded(1)), (R, Sharded(0)), (Sharded(0), R)]
    ts = [put(v.clone(), *p) for v, p in zip(values, places)]
    if blocks:
        ts = [t.map_blocks(torch.clone) for t in ts]
    return ts, values


FOREACH_CASES: list[tuple[str, Any]] = [
    ("_foreach_add", lambda a, b, s: (a, b)), ("_foreach_add", lambda a, b, s: (a, 2.5)),
    ("_foreach_mul", lambda a, b, s: (a, s)), ("_foreach_sqrt", lambda a, b, s: (a,)),
    ("_foreach_div", lambda a, b, s: (a, b)), ("_foreach_maximum", lambda a, b, s: (a, b)),
    ("_foreach_addcmul", lambda a, b, s: (a, b, b, 0.5)),
    ("_foreach_lerp", lambda a, b, s: (a, b, 0.25)),
]


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", range(len(FOREACH_CASES)))
def test_foreach_ops_equal_torch_in_the_tensors_layouts(case: int, inplace: bool,
                                                        blocks: bool) -> None:
    name, make = FOREACH_CASES[case]
    ts, values = _lists(blocks)
    others, plain_others = _lists(blocks)
    scalars = [2.0, -1.0, 0.5]
    op = getattr(torch, name + ("_" if inplace else ""))
    got = op(*make(ts, others, scalars))
    want = getattr(torch, name + ("_" if inplace else ""))(*make(values, plain_others, scalars))
    if inplace:  # torch returns the list it wrote into
        assert got is ts and want is values
        got, want = ts, values
    for g, w, t in zip(got, want, ts):
        assert isinstance(g, sw.Tensor) and g.dist_layout == t.dist_layout, g
        assert g.dtype == w.dtype
        assert torch.equal(g.to_torch(), w), name


def test_foreach_ops_take_the_per_tensor_path_where_layouts_differ() -> None:
    ts, values = _lists(False)
    other = [put(v.clone(), R, R) for v in values]  # another layout than ts's
    got = torch._foreach_mul(ts, other)
    for g, t, v in zip(got, ts, values):
        assert g.dist_layout == t.dist_layout and torch.equal(g.to_torch(), v * v)
    partial = [put(torch.ones(4), Partial(), R)]
    (p,) = torch._foreach_add(partial, 1.0)  # a Partial: the per-tensor rule (reduced)
    assert torch.equal(p.to_torch(), torch.full((4,), 2.0))


def test_foreach_adamw_equals_torch_and_keeps_layouts() -> None:
    ts, values = _lists(True)
    ours = [torch.nn.Parameter(t) for t in ts]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    for params in (ours, theirs):
        opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
        for step in range(3):
            opt.zero_grad()
            sum((p * p * (step + 1)).sum() for p in params).backward()
            opt.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p.to_torch(), q.detach())


def test_foreach_on_like_laid_out_lists_is_one_torch_call(monkeypatch: Any) -> None:
    ts, _ = _lists(True)
    calls: list[int] = []
    real = torch._foreach_mul_

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "_foreach_mul_", counted)
        from shardwise.ops import foreach
        foreach._batched("_foreach_mul_", True, (ts, 2.0), {})
    # one call, on every distinct local block of the three tensors
    assert len(calls) == 1 and calls[0] == sum(len(t.held.buffers()) for t in ts), calls
