"""The schedule generators, lowering and validation (pure: no torch needed).

The orders are checked against torch.distributed.pipelining's own generators where torch
accepts the sizes; every size (fewer microbatches than stages included) validates.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.pipelining import (
    SCHEDULES,
    Action,
    Kind,
    compute_table,
    lower,
    parse_table,
    read_csv,
    stage_ranks,
    validate,
    write_csv,
)
from shardwise.sharding import ShardingError


def stages_per_rank(name: str, v: int) -> int:
    return {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2}.get(name, v)


def compute_rows(table: dict[int, list[Action | None]]) -> dict[int, list[str]]:
    return {r: [str(a) for a in row if a is not None and a.kind.is_compute]
            for r, row in table.items()}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(SCHEDULES), p=st.integers(1, 6), data=st.data())
def test_every_table_validates_lowers_and_round_trips(name: str, p: int, data: Any) -> None:
    m = data.draw(st.integers(1, 4 * p), label="m")
    v = stages_per_rank(name, data.draw(st.integers(1, 3), label="v"))
    t = compute_table(name, v * p, p, m)
    validate(t, v * p, m)
    assert read_csv(write_csv(t)) == t
    for fsdp in (False, True):
        lowered = lower(t, fsdp=fsdp)
        validate(lowered, v * p, m)
        assert read_csv(write_csv(lowered)) == lowered
        assert compute_rows(lowered) == compute_rows(t)
    # each rank's compute: every (local stage, microbatch) once forward, once backward
    where = stage_ranks(t)
    assert sorted(where) == list(range(v * p))
    if name == "ZBVZeroBubble":
        assert all(where[r] == r and where[2 * p - 1 - r] == r for r in range(p))
    else:
        assert all(where[s] == s % p for s in range(v * p))


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("name", SCHEDULES)
def test_fewer_microbatches_than_stages(name: str, m: int) -> None:
    p = 4
    v = stages_per_rank(name, 2)
    t = compute_table(name, v * p, p, m)
    validate(t, v * p, m)
    per_pair = 3 if "ZeroBubble" in name else 2   # F, B or F, I, W
    assert sum(len(row) for row in t.values()) == per_pair * v * p * m


def _torch_orders() -> list[tuple[str, int, int, int, list[str], list[str]]]:
    """(name, p, m, rank, torch's compute order, ours) where torch generates one."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")

    def norm(ops: list[Any]) -> list[str]:
        compute = ("F", "B", "I", "W")
        return [str(a) for a in ops if a is not None and a.computation_type.value in compute]

    out = []
    for p in (1, 2, 3, 4):
        for m in range(1, 3 * p + 1):
            ns = SimpleNamespace(_num_stages=p, _n_microbatches=m)
            for name, cls in (("GPipe", sched.ScheduleGPipe), ("1F1B", sched.Schedule1F1B)):
                order = cls._get_pipeline_order(ns)
                mine = compute_rows(compute_table(name, p, p, m))
                # torch's 1F1B IR numbers the last rank's forwards from 1 (its runtime
                # does not read that IR); torch refuses 1F1B with m < p
                for r in range(p):
                    if name == "1F1B" and (r == p - 1 or m < p):
                        continue
                    out.append((name, p, m, r, norm(order[r]), mine[r]))
            rounds = max(1, m // p)
            for v in (1, 2, 3):
                if m % rounds:
                    continue  # torch refuses these; ours splits the rounds unevenly
                ns = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds,
                                     pp_group_size=p, _n_microbatches=m)
                for name, icls in (("Interleaved1F1B", sched.ScheduleInterleaved1F1B),
                                   ("InterleavedZeroBubble",
                                    sched.ScheduleInterleavedZeroBubble)):
                    mine = compute_rows(compute_table(name, v * p, p, m))
                    for r in range(p):
                        out.append((name, p, m, r,
                                    norm(icls._calculate_single_rank_operations(ns, r)),
                                    mine[r]))
            ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            mine = compute_rows(compute_table("ZBVZeroBubble", 2 * p, p, m))
            for r in range(p):
                zbv = sched.ScheduleZBVZeroBubble._calculate_single_rank_operations
                out.append(("ZBVZeroBubble", p, m, r, norm(zbv(ns, r)), mine[r]))
    return out


def test_orders_match_torch_where_torch_generates_them() -> None:
    cases = _torch_orders()
    assert len(cases) > 300
    wrong = [c[:4] for c in cases if c[4] != c[5]]
    assert wrong == []


def test_interleaved_uneven_rounds() -> None:
    # m = 9 on 4 ranks: torch refuses (9 % 2 rounds); ours runs rounds of 5 and 4
    t = compute_table("Interleaved1F1B", 8, 4, 9)
    validate(t, 8, 9)
    forwards = [str(a) for a in t[0] if a is not None and a.kind is Kind.FORWARD]
    assert forwards[:10] == ["0F0", "0F1", "0F2", "0F3", "0F4", "4F0", "4F1", "4F2", "4F3",
                             "4F4"]
    assert forwards[10:14] == ["0F5", "0F6", "0F7", "0F8"]


def test_lower_places_sends_and_receives() -> None:
    t = lower(compute_table("Interleaved1F1B", 4, 2, 2))
    # stage 1 -> 2 crosses ranks (1 -> 0); stage 3 is last: no send after its forward
    assert t[1][:3] == [Action.parse("1RECV_F0"), Action.parse("1F0"),
                        Action.parse("1SEND_F0")]
    assert Action.parse("3SEND_F0") not in t[1]
    assert t[0].index(Action.parse("2RECV_F0")) + 1 == t[0].index(Action.parse("2F0"))
    # ZBV: stages p-1 and p sit on the same rank, so that edge has no send or receive
    z = lower(compute_table("ZBVZeroBubble", 4, 2, 2))
    comms = {f"{a.stage}{a.kind.value}" for a in z[1] if a is not None and a.kind.is_comm}
    assert comms == {"1RECV_F", "1SEND_B", "2SEND_F", "2RECV_B"}
    # lowering is idempotent and keeps UNSHARD/RESHARD
    u = lower(compute_table("1F1B", 2, 2, 2), fsdp=True)
    assert lower(u) == u
    assert u[0][0] == Action(0, Kind.UNSHARD) and u[0][-1] == Action(0, Kind.RESHARD)


def table(rows: list[list[str]]) -> dict[int, list[Action | None]]:
    return parse_table(rows)


@pytest.mark.parametrize(("rows", "match"), [
    ([["0F0", "0B0"], ["1F0"]], r"1B0 is missing \(rank 1 runs stage 1\)"),
    ([["0F0", "0I0"], ["1F0", "1B0"]], r"0W0 is missing"),
    ([["0F0", "0B0", "0I0", "0W0"], ["1F0", "1B0"]], r"both appear"),
    ([["0F0", "0B0", "0F0"], ["1F0", "1B0"]], r"0F0 appears twice"),
    ([["0F0", "0B0", "1F0"], ["1F0", "1B0"]], r"stage 1 appears on rank 0 and on rank 1"),
    ([["0F0", "0B0"], ["1F0", "1B0", "2F0"]], r"2B0 is missing \(rank 1 runs stage 2\)"),
    ([["0F0", "0W0", "0I0"], ["1F0", "1B0"]], r"runs 0W0 before 0I0"),
    # a cross-rank deadlock: rank 0 waits for 1B0 before running 0F1, which 1F1 needs
    ([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]],
     r"deadlocks: rank 0 waits at 0B0 for 1B0 \(rank 1, queued behind 1F1\).*"
     r"rank 1 waits at 1F1 for 0F1 \(rank 0, queued behind 0B0\)"),
    ([["0F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], r"0RECV_B0 is missing"),
    ([["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0SEND_B0"],
      ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], r"0SEND_B0 on rank 0 sends or receives nothing"),
    ([["0F0", "0SEND_F0", "0RECV_B0", "0B0", "1SEND_B0"], ["1RECV_F0", "1F0", "1B0"]],
     r"stage 1 appears on rank 0 and on rank 1"),
])
def test_validate_names_the_action_the_rank_and_the_rule(rows: list[list[str]],
                                                         match: str) -> None:
    with pytest.raises(ShardingError, match=match):
        validate(table(rows))


def test_validate_against_declared_sizes() -> None:
    t = compute_table("1F1B", 2, 2, 2)
    validate(t, 2, 2)
    with pytest.raises(ShardingError, match=r"0F0.*microbatch 2|no forward of microbatch 2"):
        validate(t, 2, 3)
    with pytest.raises(ShardingError, match="stage 2 has no forward"):
        validate(t, 3, 2)
    with pytest.raises(ShardingError, match=r"1F0 on rank 1 names stage 1, but the pipeline "
                                            r"has stages 0\.\.0"):
        validate(t, 1, 2)


def test_user_csv_table_runs_through_validate() -> None:
    csv_text = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    t = read_csv(csv_text)
    assert t[0][2] is None
    validate(t)
    assert io.StringIO(write_csv(t)).read() == csv_text


@pytest.mark.parametrize(("call", "match"), [
    (lambda: compute_table("Looped", 4, 4, 4), "Unknown pipeline schedule 'Looped'"),
    (lambda: compute_table("1F1B", 8, 4, 4), "n_stages must equal pp_size=4"),
    (lambda: compute_table("ZBVZeroBubble", 4, 4, 4), "n_stages must be 2 \\* pp_size = 8"),
    (lambda: compute_table("Interleaved1F1B", 6, 4, 4), "multiple of pp_size=4"),
    (lambda: compute_table("GPipe", 4, 4, 0), "n_microbatches must be a positive int; got 0"),
])
def test_compute_table_errors(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ShardingError, match=match):
        call()


def test_torch_class_names_are_accepted() -> None:
    assert compute_table("ScheduleGPipe", 2, 2, 2) == compute_table("GPipe", 2, 2, 2)
