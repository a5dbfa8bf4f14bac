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


# --- the hit path of the process runtime ------------------------------------------------
# Values of which this process holds only some devices' blocks (None for the others,
# as another process's devices are): the one- and two-operand hits run their rows
# once per distinct block here. Built here in one process, each value fresh (a value held as blocks
# keeps its derived-whole check in its operand cache after its first op), with no
# mesh held wholly, as in a process world (no derived whole even where every distinct
# block is here).
@pytest.fixture
def process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.runtime import local

    monkeypatch.setattr(local, "local_mesh", lambda mesh, device: False)


def held_here(value: torch.Tensor, layout: Layout, mine: set[int]) -> sw.Tensor:
    """``value`` laid out as ``layout``, with the blocks of the devices in ``mine``
    (replicas sharing one buffer, as everywhere) and None for the others."""
    from shardwise.tensors.tensor import Tensor

    mesh = layout.mesh
    reps = layout.representatives()
    made = {r: value[block(mesh, layout, value.shape, r)].clone()
            for r in {reps[k] for k in mine}}
    return Tensor([made[reps[k]] if k in mine else None for k in range(mesh.num_devices)],
                  layout, value.shape, value.dtype)


def check_here(got: sw.Tensor, want: torch.Tensor, mine: set[int]) -> None:
    """The blocks of ``mine`` are ``want``'s, bit for bit; the others are None."""
    layout = got.dist_layout
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    for k, s in enumerate(got.shards):
        if k not in mine:
            assert s is None
            continue
        assert s is not None
        expect = want[block(layout.mesh, layout, want.shape, k)]
        assert s.dtype == expect.dtype and s.shape == expect.shape
        assert torch.equal(s, expect)


@pytest.mark.parametrize("mine", [{0}, {3}, {1, 2}, set()])
def test_the_process_hit_path_runs_each_block_here(mine: set[int], process_world: None
                                                   ) -> None:
    """One and two operands, one or two devices of a 4-device line here: the first call
    decides, the second is a hit (nothing decided) and gives the same blocks."""
    from shardwise.propagation.decide import decide

    x, y = values(8, 8, seed=1), values(8, 8, seed=2)
    s0 = lay(LINE, "x", None)
    calls = [(lambda a, b: a + b, x + y), (lambda a, b: a * b, x * y),
             (lambda a, b: a.sum(1), x.sum(1)), (lambda a, b: torch.softmax(a, -1),
                                                 torch.softmax(x, -1)),
             (lambda a, b: F.gelu(a), F.gelu(x)), (lambda a, b: a.float(), x.float())]
    for f, want in calls:
        check_here(f(held_here(x, s0, mine), held_here(y, s0, mine)), want, mine)
    entries, before = execute.decision_cache_info()[0], decide.cache_info()
    for f, want in calls:
        check_here(f(held_here(x, s0, mine), held_here(y, s0, mine)), want, mine)
    assert decide.cache_info() == before and execute.decision_cache_info()[0] == entries


def test_the_process_hit_path_calls_once_per_distinct_block(process_world: None) -> None:
    """Replicas this process holds share one result buffer (one call); distinct blocks
    here each get their own call, the first kept when the rest goes to the general loop."""
    x, y = values(8, 8, seed=1), values(8, 8, seed=2)
    calls: list[int] = []

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(id(a))
        return a + b

    def neg(a: torch.Tensor) -> torch.Tensor:
        calls.append(id(a))
        return -a

    # MESH is dp=2 x tp=4: devices 0-3 hold dp row 0, device k tp column k % 4
    for layout, mine, distinct in [(lay(MESH, "dp", None), {0, 1}, 1),    # replicas
                                   (lay(MESH, "dp", None), {0, 1, 4}, 2),
                                   (lay(MESH, "tp", None), {1, 5}, 1),
                                   (lay(MESH, "tp", None), {0, 1, 4}, 2),
                                   (lay(LINE, "x", None), {0, 1}, 2)]:
        for _ in range(2):  # the decision, then the hit
            calls.clear()
            out = execute.apply("add", (held_here(x, layout, mine),
                                        held_here(y, layout, mine)), add)
            assert len(calls) == distinct
            check_here(out, x + y, mine)
            calls.clear()
            out = execute.apply("neg", (held_here(x, layout, mine),), neg)
            assert len(calls) == distinct
            check_here(out, -x, mine)
            reps = layout.representatives()
            for j in mine:
                for k in mine:
                    if reps[j] == reps[k]:
                        assert out.shards[j] is out.shards[k]


def test_the_process_hit_path_reports_a_failing_block(process_world: None) -> None:
    """A local call that fails, or gives a block of another shape, on a hit: the same
    error as the general path (op, blocks, global shapes, rule)."""
    from shardwise.sharding.errors import ShardingError

    x, y = values(8, 8, seed=1), values(8, 8, seed=2)
    s0 = lay(LINE, "x", None)

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel")

    def short(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b)[:1]

    execute.apply("add", (held_here(x, s0, {1}), held_here(y, s0, {1})), add)
    for one in (False, True):
        ops = (held_here(x, s0, {1}),) if one else (held_here(x, s0, {1}),
                                                   held_here(y, s0, {1}))
        if one:
            execute.apply("neg", ops, lambda a: -a)
            ops = (held_here(x, s0, {1}),)
        with pytest.raises(ShardingError, match=r"failed on the local blocks .* no kernel"):
            execute.apply("neg" if one else "add", ops,
                          (lambda a: broken(a, a)) if one else broken)
        ops = (held_here(x, s0, {1}),) if one else (held_here(x, s0, {1}),
                                                   held_here(y, s0, {1}))
        with pytest.raises(AssertionError, match="computed a block of shape"):
            execute.apply("neg" if one else "add", ops,
                          (lambda a: short(a, a)) if one else short)


def test_the_process_hit_path_leaves_recording_diverges_to_the_general_path(
        process_world: None) -> None:
    """``x[S] + b[R]`` with b requiring grad: b's diverge records, so the hit path
    hands the op to the general one (which sums b's gradient shares); without grad
    the diverge is the identity and the hit runs it."""
    x, b = values(8, 8, seed=1), values(8, seed=2)
    for grad in (False, True, True, False):
        bs = held_here(b, lay(LINE, None), {1})
        if grad:
            bs = sw.Tensor([None, bs.shards[1].requires_grad_(), None, None],
                           bs.dist_layout, bs.shape)
        check_here(held_here(x, lay(LINE, "x", None), {1}) + bs, x + b, {1})
