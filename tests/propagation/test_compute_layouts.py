"""The layout each op chooses, and what it costs: an explicit table.

Each row: the op, its operands' layouts, the output layout, and the collectives
run to reshard the operands (counted with CommCounter). Values are checked too.
"""

from __future__ import annotations

import operator

import pytest
import torch

import shardwise as sw
from shardwise.sharding import ReduceOp
from tests.helpers.computecheck import LINE, MESH, lay, run, show, values
from tests.helpers.shardcheck import block

SUM, MAX = ReduceOp.SUM, ReduceOp.MAX
P_TP = {"tp": SUM}
X8 = values(8, 8, seed=1)
Y8 = values(8, 8, seed=2, positive=True)
V8 = values(8, seed=3)

# id: (sw fn, torch fn, inputs, expected output layout, expected collectives)
TABLE = {
    # elementwise: disagreeing operands take the cheapest plan
    "S(0)+R slices R": (operator.add, operator.add, [(X8, lay(MESH, "dp", None)),
                                                     (Y8, lay(MESH, None, None))],
                        "[S(dp), R]", {}),
    "R+S(0) slices R": (operator.add, operator.add, [(X8, lay(MESH, None, None)),
                                                     (Y8, lay(MESH, "dp", None))],
                        "[S(dp), R]", {}),
    "S(0)+S(1) one all_to_all": (operator.add, operator.add, [(X8, lay(LINE, "x", None)),
                                                              (Y8, lay(LINE, None, "x"))],
                                 "[S(x), R]", {"all_to_all": 1}),
    "S(dp),S(tp)+S(dp),S(tp)": (operator.mul, operator.mul, [(X8, lay(MESH, "dp", "tp")),
                                                             (Y8, lay(MESH, "dp", "tp"))],
                                "[S(dp), S(tp)]", {}),
    "matrix + broadcast row": (operator.add, operator.add, [(X8, lay(MESH, "dp", "tp")),
                                                            (V8, lay(MESH, None))],
                               "[S(dp), S(tp)]", {}),
    "broadcast size-1 dim is never sharded": (
        operator.add, operator.add, [(X8, lay(LINE, None, "x")),
                                     (values(1, 8, seed=4), lay(LINE, "x", None))],
        "[R, S(x)]", {"all_to_all": 1}),
    "broadcast size-1 dim is gathered": (
        operator.add, operator.add, [(X8, lay(LINE, None, None)),
                                     (values(1, 8, seed=4), lay(LINE, "x", None))],
        "[R, R]", {"all_gather": 1}),
    "times a constant": (lambda t: t * 2.0, lambda t: t * 2.0, [(X8, lay(MESH, "dp", "tp"))],
                         "[S(dp), S(tp)]", {}),
    "gelu keeps sharding": (sw.gelu, torch.nn.functional.gelu, [(X8, lay(MESH, "tp", "dp"))],
                            "[S(tp), S(dp)]", {}),
    # contractions
    "x[S(dp)] @ w[S(tp)]": (operator.matmul, operator.matmul, [(X8, lay(MESH, "dp", None)),
                                                               (Y8, lay(MESH, None, "tp"))],
                            "[S(dp), S(tp)]", {}),
    "h[S(tp) k] @ w[S(tp) k]: Partial": (
        operator.matmul, operator.matmul, [(X8, lay(MESH, None, "tp")),
                                           (Y8, lay(MESH, "tp", None))],
        "[R, R] partial tp:sum", {}),
    "x[S(dp),S(tp)] @ w[S(tp),R]": (
        operator.matmul, operator.matmul, [(X8, lay(MESH, "dp", "tp")),
                                           (Y8, lay(MESH, "tp", None))],
        "[S(dp), R] partial tp:sum", {}),
    "k sharded on one side: slice the other": (
        operator.matmul, operator.matmul, [(X8, lay(LINE, None, "x")),
                                           (Y8, lay(LINE, None, None))],
        "[R, R] partial x:sum", {}),
    "einsum batch + contraction": (
        lambda a, b: sw.einsum("bij,bjk->bik", a, b), lambda a, b: torch.einsum(
            "bij,bjk->bik", a, b),
        [(values(2, 4, 8), lay(MESH, "dp", None, "tp")), (values(2, 8, 4), lay(MESH, "dp", "tp",
                                                                               None))],
        "[S(dp), R, R] partial tp:sum", {}),
    # reductions
    "sum over sharded dim: Partial": (lambda t: t.sum(0), lambda t: t.sum(0),
                                      [(X8, lay(MESH, "dp", "tp"))], "[S(tp)] partial dp:sum", {}),
    "sum over unsharded dim": (lambda t: t.sum(1), lambda t: t.sum(1),
                               [(X8, lay(MESH, "dp", None))], "[S(dp)]", {}),
    "mean over all: Partial": (lambda t: t.mean(), lambda t: t.mean(),
                               [(X8, lay(MESH, "dp", "tp"))], "[] partial dp:sum, tp:sum", {}),
    "amax over sharded dim: Partial(max)": (
        lambda t: t.amax(1), lambda t: t.amax(1), [(X8, lay(MESH, "dp", "tp"))],
        "[S(dp)] partial tp:max", {}),
    "amin keepdim": (lambda t: t.amin(0, keepdim=True), lambda t: t.amin(0, keepdim=True),
                     [(X8, lay(LINE, "x", None))], "[R, R] partial x:min", {}),
    # layout of dims
    "transpose carries shardings": (lambda t: t.T, lambda t: t.T, [(X8, lay(MESH, "dp", "tp"))],
                                    "[S(tp), S(dp)]", {}),
    "softmax gathers its dim": (lambda t: t.softmax(1), lambda t: t.softmax(1),
                                [(X8, lay(MESH, "dp", "tp"))], "[S(dp), R]", {"all_gather": 1}),
    "softmax keeps other dims": (lambda t: t.softmax(0), lambda t: t.softmax(0),
                                 [(X8, lay(MESH, None, "tp"))], "[R, S(tp)]", {}),
    "reshape keeps unchanged dims": (lambda t: t.reshape(8, 2, 4), lambda t: t.reshape(8, 2, 4),
                                     [(X8, lay(MESH, "dp", "tp"))], "[S(dp), R, R]",
                                     {"all_gather": 1}),
    "reshape merge of replicated dims": (lambda t: t.reshape(64), lambda t: t.reshape(64),
                                         [(X8, lay(MESH, None, None))], "[R]", {}),
    "cat gathers its dim": (lambda a, b: sw.cat([a, b], 1), lambda a, b: torch.cat([a, b], 1),
                            [(X8, lay(MESH, "dp", "tp")), (Y8, lay(MESH, "dp", None))],
                            "[S(dp), R]", {"all_gather": 1}),
    "getitem full slices keep sharding": (lambda t: t[:, :], lambda t: t[:, :],
                                          [(X8, lay(MESH, "dp", "tp"))], "[S(dp), S(tp)]", {}),
    "getitem int gathers its dim": (lambda t: t[:, 3], lambda t: t[:, 3],
                                    [(X8, lay(MESH, "dp", "tp"))], "[S(dp)]", {"all_gather": 1}),
    "getitem None": (lambda t: t[None, ..., None], lambda t: t[None, ..., None],
                     [(X8, lay(MESH, "dp", "tp"))], "[R, S(dp), S(tp), R]", {}),
    # Partial through linear ops, resolved by nonlinear ones
    "neg keeps Partial": (operator.neg, operator.neg, [(X8, lay(MESH, "dp", None, partial=P_TP))],
                          "[S(dp), R] partial tp:sum", {}),
    "P + P keeps Partial": (operator.add, operator.add,
                            [(X8, lay(MESH, None, None, partial=P_TP)),
                             (Y8, lay(MESH, None, None, partial=P_TP))],
                            "[R, R] partial tp:sum", {}),
    "P + R: R made Partial locally": (operator.sub, operator.sub,
                                      [(X8, lay(MESH, None, None, partial=P_TP)),
                                       (Y8, lay(MESH, None, None))],
                                      "[R, R] partial tp:sum", {}),
    "P + constant resolves": (lambda t: t + 1.0, lambda t: t + 1.0,
                              [(X8, lay(MESH, None, None, partial=P_TP))], "[R, R]",
                              {"all_reduce": 1}),
    "P * R keeps Partial": (operator.mul, operator.mul,
                            [(X8, lay(MESH, None, None, partial=P_TP)),
                             (Y8, lay(MESH, "dp", None))], "[S(dp), R] partial tp:sum", {}),
    "P * P resolves one": (operator.mul, operator.mul,
                           [(X8, lay(MESH, None, None, partial=P_TP)),
                            (Y8, lay(MESH, None, None, partial=P_TP))],
                           "[R, R] partial tp:sum", {"all_reduce": 1}),
    "P / R keeps Partial": (operator.truediv, operator.truediv,
                            [(X8, lay(MESH, None, None, partial=P_TP)),
                             (Y8, lay(MESH, None, None))], "[R, R] partial tp:sum", {}),
    "R / P resolves the denominator": (operator.truediv, operator.truediv,
                                       [(Y8, lay(MESH, None, None)),
                                        (X8, lay(MESH, None, None, partial=P_TP))], "[R, R]",
                                       {"all_reduce": 1}),
    "P(sum) scattered by a sharded partner": (
        operator.mul, operator.mul, [(X8, lay(MESH, None, None, partial=P_TP)),
                                     (Y8, lay(MESH, "tp", None))], "[S(tp), R]",
        {"reduce_scatter": 1}),
    "relu resolves Partial": (sw.relu, torch.relu, [(X8, lay(MESH, None, None, partial=P_TP))],
                              "[R, R]", {"all_reduce": 1}),
    "sum keeps Partial, adds its own": (lambda t: t.sum(0), lambda t: t.sum(0),
                                        [(X8, lay(MESH, "dp", None, partial=P_TP))],
                                        "[R] partial dp:sum, tp:sum", {}),
    "amax resolves a Partial(sum)": (lambda t: t.amax(1), lambda t: t.amax(1),
                                     [(X8, lay(MESH, "dp", None, partial=P_TP))], "[S(dp)]",
                                     {"all_reduce": 1}),
    "neg of Partial(max) resolves": (operator.neg, operator.neg,
                                     [(X8, lay(LINE, None, None, partial={"x": MAX}))], "[R, R]",
                                     {"all_reduce": 1}),
    "transpose keeps Partial": (lambda t: t.T, lambda t: t.T,
                                [(X8, lay(MESH, "dp", None, partial=P_TP))],
                                "[R, S(dp)] partial tp:sum", {}),
    "getitem keeps Partial": (lambda t: t[1:3], lambda t: t[1:3],
                              [(X8, lay(MESH, None, None, partial=P_TP))],
                              "[R, R] partial tp:sum", {}),
}


@pytest.mark.parametrize("case", list(TABLE))
def test_layout_table(case: str) -> None:
    fn_sw, fn_torch, inputs, layout, counts = TABLE[case]
    out, cc = run(fn_sw, fn_torch, inputs)
    assert show(out) == layout, (show(out), layout)
    assert dict(cc.counts) == counts, cc


def test_chosen_plan_is_the_cheapest() -> None:
    """Every candidate layout costs at least as much as the chosen one (one op)."""
    from shardwise.planner import make_plan
    from shardwise.propagation.binding import bind
    from shardwise.propagation.decide import decide
    from shardwise.sharding import Layout

    a, b = lay(MESH, "dp", "tp"), lay(MESH, "tp", None)
    f = bind("add", ((8, 16), (8, 16)))
    dec = decide(f, (a, b), (None, None), (4, 4))
    for d0 in [(), (0,), (1,), (0, 1), (1, 0)]:
        for d1 in [(), (0,), (1,)]:
            if set(d0) & set(d1):
                continue
            want = Layout(MESH, (d0, d1), (None, None))
            cost = sum(make_plan(x, want, (8, 16), 4).bytes_per_device for x in (a, b))
            assert dec.cost <= cost, (want, cost, dec)


def test_tie_break_keeps_the_first_operand() -> None:
    x, y = values(8, 8, seed=1), values(8, 8, seed=2)
    out, cc = run(operator.add, operator.add,
                  [(x, lay(LINE, None, "x")), (y, lay(LINE, "x", None))])
    assert show(out) == "[R, S(x)]" and dict(cc.counts) == {"all_to_all": 1}


def test_more_parallel_output_wins_a_tie() -> None:
    # both ways cost 0 bytes (slices); the sharded output is preferred
    out, cc = run(operator.add, operator.add, [(values(8, 8), lay(MESH, None, None)),
                                               (values(8, 8, seed=1), lay(MESH, "dp", "tp"))])
    assert show(out) == "[S(dp), S(tp)]" and cc.total == 0


def test_replicas_share_one_result() -> None:
    x = sw.tensor(values(8, 8), sharding=lay(MESH, None, None))
    y = sw.tensor(values(8, 8, seed=1), sharding=lay(MESH, "dp", None))
    assert len({id(s) for s in (x + x).shards}) == 1
    assert len({id(s) for s in (x + y).shards}) == 2
    assert len({id(s) for s in (x @ y.T).shards}) == 2  # output [R, S(dp)]


def test_torch_runs_once_per_distinct_input(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch.tanh
    monkeypatch.setattr(torch, "tanh", lambda t: calls.append(1) or real(t))
    from shardwise.ops import compute
    from shardwise.runtime import local

    x = sw.tensor(values(8, 8), sharding=lay(MESH, "dp", None))
    blocks = sw.from_local([s.clone() for s in x.shards], x.dist_layout, shape=(8, 8))
    compute._elementwise("tanh", torch.tanh)(blocks)
    assert len(calls) == 1  # on the derived whole (a copy of the blocks: cache.whole_of)
    calls.clear()
    monkeypatch.setattr(local, "COPY_BYTES", 0)  # no copy: the blocks run the op
    blocks = sw.from_local([s.clone() for s in x.shards], x.dist_layout, shape=(8, 8))
    compute._elementwise("tanh", torch.tanh)(blocks)
    assert len(calls) == 2  # two distinct blocks (dp), shared by the tp replicas
    calls.clear()
    y = compute._elementwise("tanh", torch.tanh)(x)  # x holds its whole value: one call
    assert len(calls) == 1
    assert len({id(s) for s in y.shards}) == 2 and torch.equal(y.to_torch(), real(values(8, 8)))


def test_decisions_are_cached() -> None:
    from shardwise.ops.execute import clear_decisions, decision_cache_info
    from shardwise.propagation.decide import decide

    def pair() -> tuple[sw.Tensor, sw.Tensor]:
        # fresh values: a value relayouted once keeps the result, which its next ops
        # weigh too (another decision)
        return (sw.tensor(values(8, 8), sharding=lay(MESH, "dp", "tp")),
                sw.tensor(values(8, 8), sharding=lay(MESH, "tp", None)))  # another layout

    x, y = pair()
    x + y
    before = decide.cache_info()
    entries = decision_cache_info()[0]
    x, y = pair()
    x + y  # the same layouts, shapes and dtypes: the dispatch's decision cache answers
    assert decide.cache_info() == before and decision_cache_info()[0] == entries
    x, y = pair()
    clear_decisions()
    x + y  # without it, decide's own cache does
    after = decide.cache_info()
    assert after.hits > before.hits and after.misses == before.misses
    x + x  # decided once (one layout, no Partial: the elementwise rule keeps it)...
    before = decide.cache_info()
    x + x  # ...then the dispatch's decision cache answers
    assert decide.cache_info() == before


def test_the_second_identical_call_hits_the_decision_cache() -> None:
    """A first call leaves its operands keeping the layouts it moved them to; the
    decision for that state is stored too, so the second identical call hits."""
    from shardwise.ops.execute import clear_decisions, decision_cache_info
    from shardwise.propagation.decide import decide

    for make in (lambda v, lo: sw.tensor(v, sharding=lo),                # held whole
                 lambda v, lo: sw.from_local(                           # held as blocks
                     [v[block(MESH, lo, v.shape, k)].clone() for k in range(MESH.num_devices)],
                     lo, v.shape)):
        clear_decisions()
        x = make(values(8, 8), lay(MESH, "dp", "tp"))
        y = make(values(8, 8, seed=1), lay(MESH, "tp", None))
        first = x + y  # moves an operand: both now keep a layout
        entries, before = decision_cache_info()[0], decide.cache_info()
        second = x + y
        assert decide.cache_info() == before and decision_cache_info()[0] == entries
        assert torch.equal(first.to_torch(), second.to_torch())


def test_large_searches_are_cut_and_stay_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.ops.execute import clear_decisions
    from shardwise.propagation import decide as propagation

    monkeypatch.setattr(propagation, "MAX_COMBINATIONS", 1)
    propagation.decide.cache_clear()
    clear_decisions()  # decisions the dispatch cached before the patch
    try:
        out, cc = run(operator.add, operator.add, [(X8, lay(MESH, "dp", "tp")),
                                                   (Y8, lay(MESH, "tp", "dp"))])
        # only the first operand's shardings (and unsharded) were candidates
        assert show(out) == "[S(dp), S(tp)]" and cc.total > 0
        out, _ = run(operator.add, operator.add, [(Y8, lay(MESH, "tp", "dp")),
                                                  (X8, lay(MESH, "dp", "tp"))])
        assert show(out) == "[S(tp), S(dp)]"
    finally:
        propagation.decide.cache_clear()
        clear_decisions()
