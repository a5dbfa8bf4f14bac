"""The dispatch's decision cache (ops/execute.py) never serves a wrong decision.

Each test runs one op on operands that share some of the key and differ in the rest
(shape, layout, dtype, params, kept layouts, a layout changed in place), on values
held as blocks (``from_local``: the cached path every op of the process runtime takes)
and as whole values, and checks value, dtype, shape and layout against plain torch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.debug import CommCounter
from shardwise.ops import execute
from shardwise.sharding import Layout, ReduceOp
from tests.helpers.computecheck import LINE, MESH, lay, show, values
from tests.helpers.shardcheck import block

SUM = ReduceOp.SUM


def blocks_of(value: torch.Tensor, layout: Layout) -> sw.Tensor:
    """``value`` laid out as ``layout``, held as blocks (no whole value)."""
    mesh = layout.mesh
    shards = [value[block(mesh, layout, value.shape, k)].clone()
              for k in range(mesh.num_devices)]
    return sw.from_local(shards, layout, value.shape)


def check(got: sw.Tensor, want: torch.Tensor) -> None:
    value = got.to_torch()
    assert value.dtype == want.dtype and value.shape == want.shape
    torch.testing.assert_close(value, want, rtol=0, atol=1e-12)


@pytest.fixture(autouse=True)
def fresh() -> None:
    execute.clear_decisions()


def test_a_hit_decides_nothing_and_runs_the_same() -> None:
    from shardwise.propagation.decide import decide

    x = values(8, 8, seed=1)
    check(blocks_of(x, lay(LINE, "x", None)).sum(1), x.sum(1))
    entries, before = execute.decision_cache_info()[0], decide.cache_info()
    out = blocks_of(x * 2, lay(LINE, "x", None)).sum(1)
    check(out, (x * 2).sum(1))
    assert decide.cache_info() == before and execute.decision_cache_info()[0] == entries


@pytest.mark.parametrize("held", ["blocks", "whole"])
def test_shapes_layouts_dtypes_and_params_each_decide(held: str) -> None:
    make: Callable[[torch.Tensor, Layout], sw.Tensor] = (
        blocks_of if held == "blocks" else lambda v, lo: sw.tensor(v, sharding=lo))
    cases = [  # (value, layout, dim): one op, every part of the key varied
        (values(8, 8, seed=1), lay(LINE, "x", None), 1),
        (values(8, 8, seed=2), lay(LINE, "x", None), 0),              # params
        (values(8, 4, seed=3), lay(LINE, "x", None), 1),              # shape
        (values(8, 8, seed=4), lay(LINE, None, "x"), 1),              # layout
        (values(8, 8, seed=5).float(), lay(LINE, "x", None), 1),      # dtype
        (values(8, 8, seed=6), lay(MESH, "dp", "tp"), 1),             # mesh
        (values(8, 8, seed=7), lay(LINE, "x", None), 1),              # the first again
    ]
    entries = []
    for _ in range(2):  # the second round: every decision is a hit
        for value, layout, dim in cases:
            out = make(value, layout).softmax(dim)
            check(out, value.softmax(dim))
            sums = make(value, layout).sum(dim)
            check(sums, value.sum(dim))
            assert show(sums) == show(blocks_of(value, layout).sum(dim))
        entries.append(execute.decision_cache_info()[0])
    assert entries[0] == entries[1]


def test_partial_and_sharded_operands_differ() -> None:
    x, y = values(8, 8, seed=1), values(8, 8, seed=2)
    s0 = lay(LINE, "x", None)
    a = blocks_of(x, s0) + blocks_of(y, s0)
    parts = [torch.randn(8, 8, generator=torch.Generator().manual_seed(k),
                         dtype=torch.float64) for k in range(4)]
    p = sw.from_local(parts, lay(LINE, None, None, partial={"x": SUM}), (8, 8))
    b = p + blocks_of(y, s0)
    check(a, x + y)
    check(b, sum(parts) + y)
    assert show(a) == "[S(x), R]"


def test_a_layout_changed_in_place_is_a_new_key() -> None:
    x = values(8, 8, seed=1)
    t = blocks_of(x, lay(LINE, "x", None))
    check(t.softmax(0), x.softmax(0))
    t.data = blocks_of(x, lay(LINE, None, "x"))  # same value, another layout
    out = t.softmax(0)
    check(out, x.softmax(0))
    assert show(out) == "[R, S(x)]"


def test_kept_layouts_are_part_of_the_key() -> None:
    """``tanh(p)`` on a Partial reduces it, unless an earlier op left the value
    reduce_scattered at hand (kept): then it runs on the kept blocks, with no collective.
    A cached decision from one case never serves the other."""
    y = values(8, 8, seed=2)
    s0 = lay(LINE, "x", None)

    def partial(seed: int) -> tuple[sw.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        parts = [torch.randn(8, 8, generator=gen, dtype=torch.float64) for _ in range(4)]
        return sw.from_local(parts, lay(LINE, None, None, partial={"x": SUM}), (8, 8)), sum(
            parts)

    counts = []
    for seed, warm in [(1, False), (2, True), (3, False), (4, True)]:
        p, value = partial(seed)
        if warm:
            check(p + blocks_of(y, s0), value + y)  # reduce_scatters p, kept
        with CommCounter() as cc:
            out = torch.tanh(p)
        check(out, torch.tanh(value))
        counts.append(cc.total)
    assert counts[0] == counts[2] > 0 and counts[1] == counts[3] == 0


def test_integer_partials_are_never_cached_past_their_reduction() -> None:
    parts = [torch.full((4,), 2**62, dtype=torch.int64) for _ in range(4)]
    p = sw.from_local(parts, Layout(LINE, ((),), (SUM,)), (4,))
    want = sum(parts) * 1.5  # wraps in int64 first, as the global value does
    for _ in range(2):
        check(p * 1.5, want)


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execute, "DECISIONS_MAX", 3)
    for n in range(2, 10):
        x = values(8, n, seed=n)
        check(blocks_of(x, lay(LINE, "x", None)).sum(1), x.sum(1))
        assert execute.decision_cache_info()[0] <= 3


def test_grad_flows_through_a_cached_diverge() -> None:
    """``x[S] @ w[R]``: w's gradient is summed over the replicas (its diverge), on the
    cached path too; without grad the diverge (the identity) is skipped."""
    x, w = values(8, 4, seed=1), values(4, 3, seed=2)
    want = torch.func.grad(lambda w_: (x @ w_).square().sum())(w)
    for _ in range(2):
        ws = sw.from_local([w.clone().requires_grad_() for _ in range(4)],
                           lay(LINE, None, None), w.shape)
        xs = blocks_of(x, lay(LINE, "x", None))
        with torch.no_grad():
            check(xs @ ws, x @ w)
        (xs @ ws).square().sum().backward()
        assert ws.grad is not None
        check(ws.grad, want)


def test_functional_ops_with_params() -> None:
    x = values(8, 8, seed=1)
    t = blocks_of(x, lay(LINE, "x", None))
    for approximate in ("none", "tanh", "none"):
        check(F.gelu(t, approximate=approximate), F.gelu(x, approximate=approximate))
    g, b = values(8, seed=3), values(8, seed=4)
    gs, bs = blocks_of(g, lay(LINE, None)), blocks_of(b, lay(LINE, None))
    for shape in ((8,), (8, 8), (8,)):
        check(F.layer_norm(t, shape), F.layer_norm(x, shape))
    check(F.layer_norm(t, (8,), gs, bs), F.layer_norm(x, (8,), g, b))


@pytest.mark.parametrize("case", ["rows", "columns", "partial", "bias grad"])
def test_linear_adds_its_bias_in_the_call_only_where_exact(case: str) -> None:
    """F.linear on blocks folds the bias into the local call once its decision is
    cached, where the add would change nothing; elsewhere it adds it by the rule."""
    x, w, b = values(8, 6, seed=1), values(4, 6, seed=2), values(4, seed=3)
    x_lay, w_lay = {"rows": (lay(LINE, "x", None), lay(LINE, None, None)),
                    "columns": (lay(LINE, None, None), lay(LINE, "x", None)),
                    "partial": (lay(LINE, None, "x"), lay(LINE, None, "x")),
                    "bias grad": (lay(LINE, "x", None), lay(LINE, None, None))}[case]
    for _ in range(3):  # the first call caches the decision, the others may fold
        bs = blocks_of(b, lay(LINE, None))
        if case == "bias grad":
            bs = sw.from_local([b.clone().requires_grad_() for _ in range(4)],
                               lay(LINE, None), b.shape)
        out = F.linear(blocks_of(x, x_lay), blocks_of(w, w_lay), bs)
        check(out, F.linear(x, w, b))
        if case == "bias grad":
            out.sum().backward()
            assert bs.grad is not None
            check(bs.grad, torch.full_like(b, 8.0))


def test_linear_gives_the_same_bits_on_every_call() -> None:
    """The bias is folded (or not) by the layouts alone, never by what the cache holds:
    the first call and later ones run the same arithmetic."""
    x, w, b = values(8, 6, seed=1), values(4, 6, seed=2), values(4, seed=3)
    outs = [F.linear(blocks_of(x, lay(LINE, "x", None)), blocks_of(w, lay(LINE, None, None)),
                     blocks_of(b, lay(LINE, None))).to_torch() for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
