"""The pure planner: one test per row of the transition table in the
``shardwise.planner`` docstring, plus its ordering, merging, uneven-size and caching
rules, its closed set of step kinds and the runtimes' handler tables for them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardwise.planner import (
    COLLECTIVES,
    Plan,
    Step,
    StepKind,
    check_handlers,
    make_plan,
    permute_sources,
)
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.meshes import M22, line

SUM, AVG, MIN, MAX, PROD = ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD
MESHES = [line(n) for n in (2, 3, 4)]
SHAPES = [(8, 12), (5, 7), (2, 3), (0, 4)]


def lay(mesh: DeviceMesh, dims: tuple, partial: tuple | None = None) -> Layout:
    return Layout(mesh, dims, partial or (None,) * mesh.ndim)


def R(mesh: DeviceMesh) -> Layout:
    return lay(mesh, ((), ()))


def S(mesh: DeviceMesh, d: int) -> Layout:
    return lay(mesh, ((0,), ()) if d == 0 else ((), (0,)))


def P(mesh: DeviceMesh, op: ReduceOp) -> Layout:
    return lay(mesh, ((), ()), (op,))


def summary(plan: Plan) -> list[tuple]:
    return [(s.kind, s.axes, s.dim, s.dim2, s.reduce_op) for s in plan.steps]


def check_chain(plan: Plan) -> None:
    cur = plan.src
    for s in plan.steps:
        assert s.before == cur
        cur = s.after
    assert cur == plan.dst


params = pytest.mark.parametrize("mesh", MESHES, ids=repr)
shapes = pytest.mark.parametrize("shape", SHAPES, ids=str)
ops = pytest.mark.parametrize("op", list(ReduceOp))


# --- the transition table --------------------------------------------------------------
@params
@shapes
def test_R_to_S_is_a_local_slice(mesh: DeviceMesh, shape: tuple) -> None:
    for d in (0, 1):
        plan = make_plan(R(mesh), S(mesh, d), shape, 4)
        assert summary(plan) == [("slice", (0,), d, None, None)]
        assert plan.collectives == () and plan.bytes_per_device == 0
        check_chain(plan)


@params
@shapes
def test_S_to_R_is_all_gather(mesh: DeviceMesh, shape: tuple) -> None:
    for d in (0, 1):
        plan = make_plan(S(mesh, d), R(mesh), shape, 4)
        assert summary(plan) == [("all_gather", (0,), d, None, None)]
        check_chain(plan)


@params
@shapes
def test_S_to_S_is_one_all_to_all(mesh: DeviceMesh, shape: tuple) -> None:
    for d, e in ((0, 1), (1, 0)):
        plan = make_plan(S(mesh, d), S(mesh, e), shape, 4)
        assert summary(plan) == [("all_to_all", (0,), d, e, None)]
        check_chain(plan)


@params
@shapes
@ops
def test_P_to_R_is_all_reduce(mesh: DeviceMesh, shape: tuple, op: ReduceOp) -> None:
    plan = make_plan(P(mesh, op), R(mesh), shape, 4)
    assert summary(plan) == [("all_reduce", (0,), None, None, op)]
    check_chain(plan)


@params
@shapes
@ops
def test_P_to_S_is_reduce_scatter(mesh: DeviceMesh, shape: tuple, op: ReduceOp) -> None:
    for d in (0, 1):
        plan = make_plan(P(mesh, op), S(mesh, d), shape, 4)
        assert summary(plan) == [("reduce_scatter", (0,), d, None, op)]
        check_chain(plan)


@params
@ops
def test_P_to_other_P_is_all_reduce_then_make_partial(mesh: DeviceMesh, op: ReduceOp) -> None:
    for op2 in ReduceOp:
        plan = make_plan(P(mesh, op), P(mesh, op2), (5, 3), 4)
        if op2 is op:
            assert plan.steps == ()
        else:
            assert summary(plan) == [("all_reduce", (0,), None, None, op),
                                     ("make_partial", (0,), None, None, op2)]
            check_chain(plan)


@params
@ops
def test_R_to_P_is_make_partial(mesh: DeviceMesh, op: ReduceOp) -> None:
    plan = make_plan(R(mesh), P(mesh, op), (5, 3), 4)
    assert summary(plan) == [("make_partial", (0,), None, None, op)]
    assert plan.collectives == () and plan.bytes_per_device == 0


@params
@shapes
@ops
def test_S_to_P_is_all_gather_then_make_partial(mesh: DeviceMesh, shape: tuple,
                                                 op: ReduceOp) -> None:
    plan = make_plan(S(mesh, 1), P(mesh, op), shape, 4)
    assert summary(plan) == [("all_gather", (0,), 1, None, None),
                             ("make_partial", (0,), None, None, op)]
    check_chain(plan)


# --- merging, ordering ----------------------------------------------------------------
def test_steps_over_several_axes_merge_into_one_collective() -> None:
    plan = make_plan(lay(M22, ((0, 1), ())), R(M22), (8, 8), 4)
    assert summary(plan) == [("all_gather", (0, 1), 0, None, None)]
    plan = make_plan(lay(M22, ((), ()), (SUM, SUM)), R(M22), (8, 8), 4)
    assert summary(plan) == [("all_reduce", (0, 1), None, None, SUM)]
    plan = make_plan(lay(M22, ((), ()), (MAX, MAX)), lay(M22, ((), (1, 0))), (8, 8), 4)
    assert summary(plan) == [("reduce_scatter", (1, 0), 1, None, MAX)]
    plan = make_plan(R(M22), lay(M22, ((1, 0), ())), (8, 8), 4)
    assert summary(plan) == [("slice", (1, 0), 0, None, None)]


def test_gathers_on_different_dims_stay_separate() -> None:
    plan = make_plan(lay(M22, ((0,), (1,))), R(M22), (8, 8), 4)
    assert summary(plan) == [("all_gather", (0,), 0, None, None),
                             ("all_gather", (1,), 1, None, None)]


def test_order_all_to_all_then_slice_then_reduction() -> None:
    src = lay(M22, ((1,), ()), (SUM, None))
    dst = lay(M22, ((), (1, 0)))
    assert [s.kind for s in make_plan(src, dst, (8, 8), 4).steps] == ["all_to_all",
                                                                      "reduce_scatter"]
    src = lay(M22, ((), ()), (None, SUM))
    dst = lay(M22, ((0,), (1,)))
    assert [s.kind for s in make_plan(src, dst, (8, 8), 4).steps] == ["slice",
                                                                      "reduce_scatter"]


def test_mixed_reduce_ops_resolve_last_axis_first() -> None:
    plan = make_plan(lay(M22, ((), ()), (SUM, MAX)), R(M22), (4, 4), 4)
    assert summary(plan) == [("all_reduce", (1,), None, None, MAX),
                             ("all_reduce", (0,), None, None, SUM)]
    # an axis the target keeps Partial is resolved, then made again
    plan = make_plan(lay(M22, ((), ()), (SUM, MAX)), lay(M22, ((), ()), (SUM, None)),
                     (4, 4), 4)
    assert [s.kind for s in plan.steps] == ["all_reduce", "all_reduce", "make_partial"]
    check_chain(plan)


def test_make_partial_runs_outer_axis_first() -> None:
    """Partial axes reduce last axis first, so identities are laid down outer first."""
    plan = make_plan(R(M22), lay(M22, ((), ()), (PROD, SUM)), (4, 4), 4)
    assert summary(plan) == [("make_partial", (0,), None, None, PROD),
                             ("make_partial", (1,), None, None, SUM)]
    plan = make_plan(R(M22), lay(M22, ((), ()), (SUM, SUM)), (4, 4), 4)
    assert summary(plan) == [("make_partial", (0, 1), None, None, SUM)]  # one op: merged
    m3 = DeviceMesh.cpu((2, 1, 2), ("a", "b", "c"))
    plan = make_plan(lay(m3, ((), ())), lay(m3, ((), ()), (SUM, PROD, SUM)), (4, 4), 4)
    assert [s.axes for s in plan.steps] == [(0,), (1,), (2,)]  # PROD between: not merged


def test_prod_made_over_an_inner_sum_partial_resolves_it_first() -> None:
    """Regression: PROD's identity 1 on every device of an inner SUM axis sums to size."""
    src = lay(M22, ((), ()), (None, SUM))
    plan = make_plan(src, lay(M22, ((), ()), (PROD, SUM)), (4, 4), 4)
    assert summary(plan) == [("all_reduce", (1,), None, None, SUM),
                             ("make_partial", (0,), None, None, PROD),
                             ("make_partial", (1,), None, None, SUM)]
    # a SUM axis outside (before) the PROD axis is left alone
    src = lay(M22, ((), ()), (SUM, None))
    plan = make_plan(src, lay(M22, ((), ()), (SUM, PROD)), (4, 4), 4)
    assert summary(plan) == [("make_partial", (1,), None, None, PROD)]


def test_uneven_pieces_that_do_not_nest() -> None:
    m = M22
    # 6 rows: 2-way [3, 3] vs 4-way [2, 2, 1, 1]
    plan = make_plan(lay(m, ((0,), ())), lay(m, ((0, 1), ())), (6, 2), 4)
    assert [s.kind for s in plan.steps] == ["all_gather", "slice"]
    plan = make_plan(lay(m, ((0,), ())), lay(m, ((0, 1), ())), (8, 2), 4)
    assert summary(plan) == [("slice", (1,), 0, None, None)]
    # 0 and 1 rows nest trivially? 1 row: [1, 0] vs [1, 0, 0, 0]
    plan = make_plan(lay(m, ((0,), ())), lay(m, ((0, 1), ())), (1, 2), 4)
    assert summary(plan) == [("slice", (1,), 0, None, None)]
    check_chain(plan)


def test_reorder_of_axes_on_one_dim_is_one_permute() -> None:
    plan = make_plan(lay(M22, ((0, 1), ())), lay(M22, ((1, 0), ())), (8, 8), 4)
    check_chain(plan)
    assert summary(plan) == [("permute", (0, 1), 0, None, None)]
    assert plan.bytes_per_device == 2 * 8 * 4  # one block each
    # uneven: the blocks differ by order (9 rows: [3, 2, 2, 2] vs the same sizes on
    # other devices), so it stays a gather and a slice
    plan = make_plan(lay(M22, ((0, 1), ())), lay(M22, ((1, 0), ())), (9, 8), 4)
    assert [s.kind for s in plan.steps] == ["all_gather", "slice"]
    # with a Partial axis and another sharded dim alongside, only the dim permutes
    m = DeviceMesh.cpu((2, 3, 2), ("a", "b", "c"))
    src = lay(m, ((0, 1), (2,)))
    dst = lay(m, ((1, 0), (2,)))
    assert summary(make_plan(src, dst, (12, 4), 4)) == [("permute", (0, 1), 0, None, None)]
    srcp, dstp = lay(m, ((0, 1), ()), (None, None, SUM)), lay(m, ((1, 0), ()), (None, None, SUM))
    assert [s.kind for s in make_plan(srcp, dstp, (6, 4), 4).steps] == ["permute"]


def test_dims_trading_axes_move_by_all_to_all_and_permute() -> None:
    m = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    plan = make_plan(lay(m, ((0,), (1,))), lay(m, ((1,), (0,))), (16, 16), 4)
    check_chain(plan)
    assert [s.kind for s in plan.steps] == ["all_to_all", "permute", "all_to_all"]
    assert plan.bytes_per_device == 64 + 128 + 96  # against 896 for gather + slice
    plan = make_plan(lay(m, ((0,), (1,))), lay(m, ((1, 0), ())), (16, 16), 4)
    assert [s.kind for s in plan.steps] == ["all_to_all", "permute"]
    # uneven: no permute (block sizes depend on the order), gather instead
    plan = make_plan(lay(m, ((0,), (1,))), lay(m, ((1,), (0,))), (6, 6), 4)
    check_chain(plan)
    assert "permute" not in [s.kind for s in plan.steps]


@pytest.mark.parametrize("shape", [(2, 3, 2), (3, 2), (2, 2, 2, 2)], ids=str)
def test_permute_sources_is_a_bijection_holding_the_right_block(shape: tuple) -> None:
    names = tuple("abcd"[: len(shape)])
    m = DeviceMesh.cpu(shape, names)
    axes = tuple(range(len(shape)))
    rows = 1
    for s in shape:
        rows *= s
    for order in [axes[::-1], axes[1:] + axes[:1]]:
        plan = make_plan(lay(m, (axes, ())), lay(m, (order, ())), (rows, 1), 4)
        (step,) = plan.steps
        source = permute_sources(step)
        assert sorted(source) == list(range(m.num_devices))

        def block(layout: Layout, k: int) -> int:
            index, coord = 0, m.coord_of(k)
            for a in layout.dims[0]:
                index = index * m.mesh_shape[a] + coord[a]
            return index

        for k in range(m.num_devices):
            assert block(step.after, k) == block(step.before, source[k])


# --- accounting, printing, caching, purity ---------------------------------------------
def test_bytes_per_device() -> None:
    m = MESHES[2]  # 4 devices
    cases = [
        (S(m, 0), S(m, 1), 2 * 12 * 4 * 3 // 4),  # all_to_all: block before * (n-1)/n
        (S(m, 0), R(m), 8 * 12 * 4 * 3 // 4),  # all_gather: block after * (n-1)/n
        (P(m, SUM), R(m), 2 * 8 * 12 * 4 * 3 // 4),  # all_reduce: 2 * block * (n-1)/n
        (P(m, SUM), S(m, 0), 8 * 12 * 4 * 3 // 4),  # reduce_scatter: block before
        (R(m), S(m, 0), 0),
    ]
    for src, dst, want in cases:
        plan = make_plan(src, dst, (8, 12), 4)
        assert plan.bytes_per_device == want, summary(plan)
        assert plan.steps[0].bytes_per_device == want


def test_step_properties_and_printing() -> None:
    plan = make_plan(lay(M22, ((), ()), (MAX, None)), lay(M22, ((), (0,))), (8, 8), 4)
    (step,) = plan.steps
    assert isinstance(step, Step) and step.is_collective and step.kind in COLLECTIVES
    assert step.axis_names == ("dp",)
    text = str(step)
    assert text.startswith("reduce_scatter(") and "axes=('dp',)" in text
    assert "dim=1" in text and "op=max" in text and "128 B/device" in text
    text = str(plan)
    assert text.splitlines()[0].startswith("Plan DeviceMesh(dp=2, tp=2)")
    assert "1. reduce_scatter" in text and "total 128 B/device moved" in text
    assert len(plan) == 1
    big = make_plan(lay(M22, ((0,), ())), R(M22), (1024, 1024), 4)
    assert "2.0 MiB/device" in str(big)
    assert not make_plan(R(M22), lay(M22, ((0,), ())), (4, 4), 4).steps[0].is_collective


def test_same_layout_is_an_empty_plan() -> None:
    plan = make_plan(S(M22, 0), S(M22, 0), (3, 3), 4)
    assert plan.steps == () and len(plan) == 0 and plan.bytes_per_device == 0
    assert "no steps" in str(plan)


def test_plans_are_cached() -> None:
    a = make_plan(S(M22, 0), S(M22, 1), (8, 8), 4)
    assert make_plan(S(M22, 0), S(M22, 1), (8, 8), 4) is a
    assert make_plan(lay(M22, ((0,), ())), lay(M22, ((), (0,))), (8, 8), 4) is a
    assert make_plan(S(M22, 0), S(M22, 1), (8, 8), 8) is not a


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="one mesh"):
        make_plan(S(M22, 0), S(MESHES[0], 0), (4, 4), 4)
    with pytest.raises(ValueError, match="rank"):
        make_plan(S(M22, 0), S(M22, 1), (4, 4, 4), 4)


def test_step_kind_is_a_closed_str_enum() -> None:
    plan = make_plan(S(M22, 0), R(M22), (8, 8), 4)
    (step,) = plan.steps
    assert step.kind is StepKind.ALL_GATHER and step.kind == "all_gather"
    assert f"{step.kind}" == "all_gather" and {step.kind: 1} == {"all_gather": 1}
    assert all(isinstance(s.kind, StepKind) for s in make_plan(
        lay(M22, ((0,), ()), (None, SUM)), lay(M22, ((1,), ()), (MAX, None)), (8, 8), 4).steps)
    assert {k for k in StepKind if k.is_collective} == COLLECTIVES
    assert {k.value for k in StepKind} - {k.value for k in COLLECTIVES} == {"slice",
                                                                           "make_partial"}
    # a kind given by name becomes the member; an unknown name is refused at once
    made = Step("all_gather", step.axes, step.before, step.after, 0)
    assert made.kind is StepKind.ALL_GATHER and made == Step(
        StepKind.ALL_GATHER, step.axes, step.before, step.after, 0)
    with pytest.raises(ValueError, match=r"Step kind must be one of .* Got 'gather'"):
        Step("gather", step.axes, step.before, step.after, 0)


def test_runtime_handler_tables_cover_every_kind() -> None:
    from shardwise.runtime.process import backend as process
    from shardwise.runtime.simulated import backend as simulated

    assert set(simulated.STEP_HANDLERS) == set(StepKind)
    assert set(process._SPEC_OF) == set(StepKind) - {StepKind.PERMUTE}
    with pytest.raises(TypeError, match=r"no handler for step kinds \['permute'\]"):
        check_handlers({k: None for k in StepKind if k is not StepKind.PERMUTE}, "a runtime")
    check_handlers({}, "a runtime", elsewhere=list(StepKind))


def test_phases_run_in_order_and_each_only_appends() -> None:
    from shardwise.planner.phases import Planner

    src = lay(M22, ((1, 0), ()), (None, None))
    dst = lay(M22, ((), (0,)), (None, SUM))
    p = Planner(src, dst, (8, 8), 4)
    seen: list[int] = []
    for phase in Planner.PHASES:
        getattr(p, phase)()
        assert [s.kind for s in p.b.steps[: len(seen)]] == seen
        seen = [s.kind for s in p.b.steps]
    assert p.b.cur == dst
    assert [s.kind for s in make_plan(src, dst, (8, 8), 4).steps] == seen


def test_planner_is_pure_python() -> None:
    code = ("import sys, shardwise.planner, shardwise.planner.phases, shardwise.planner.cache; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
