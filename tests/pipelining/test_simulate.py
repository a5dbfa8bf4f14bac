"""The schedule simulator: the textbook bubbles exactly on equal stage costs, costs and
latency, every generated/lowered/user table, and the pictures."""

from __future__ import annotations

import itertools
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
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
    read_csv,
    simulate,
    validate,
    write_csv,
)
from shardwise.pipelining.tables import dependencies
from shardwise.sharding import ShardingError

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 4 * p + 1)]


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_gpipe_and_1f1b_bubble_is_exactly_the_formula(name: str) -> None:
    # bubble = (p-1)(f+b) / (m(f+b) + (p-1)(f+b)) = (p-1)/(m+p-1): f=1, b=2
    for p, m in SIZES:
        sim = simulate(compute_table(name, p, p, m), forward=1.0, backward=2.0)
        assert sim.step_time == (m + p - 1) * 3.0, (p, m)
        assert sim.bubble == (p - 1) / (m + p - 1), (p, m)


def test_peak_inflight() -> None:
    for p, m in SIZES:
        one = simulate(compute_table("1F1B", p, p, m)).peak_inflight
        assert one[0] == min(m, p), (p, m)
        assert all(n <= p for n in one.values())
        assert simulate(compute_table("GPipe", p, p, m)).peak_inflight == dict.fromkeys(
            range(p), m)


def test_interleaved_bubble_is_smaller_by_the_virtual_stage_factor() -> None:
    # each of the v*p stages costs f=1, b=2: busy m*v*3 per rank, idle (p-1)*3,
    # i.e. the bubble time is (p-1)/v over m of 1F1B's; exact for every m >= p
    # (uneven rounds included, where torch refuses)
    for p, m in SIZES:
        if m < p:
            continue
        for v in (1, 2, 3):
            sim = simulate(compute_table("Interleaved1F1B", v * p, p, m))
            assert sim.bubble == (p - 1) / (v * m + p - 1), (p, m, v)


def test_zero_bubble_is_smaller_than_1f1b() -> None:
    for p, m in SIZES:
        if p == 1:
            continue
        one = simulate(compute_table("1F1B", p, p, m)).bubble
        zbv = simulate(compute_table("ZBVZeroBubble", 2 * p, p, m)).bubble
        assert zbv < one, (p, m)
        for v in (1, 2, 3):
            inter = simulate(compute_table("Interleaved1F1B", v * p, p, m)).bubble
            zb = simulate(compute_table("InterleavedZeroBubble", v * p, p, m)).bubble
            assert zb < min(one, inter), (p, m, v)


def test_zbv_is_zero_bubble_in_the_steady_state() -> None:
    # f = I = W = 1: p=4, m=8 idles 3 time units of 51 per rank (ramp up and down)
    sim = simulate(compute_table("ZBVZeroBubble", 8, 4, 8), forward=1.0, backward=2.0)
    assert sim.step_time == 51.0
    assert sim.busy == dict.fromkeys(range(4), 48.0)


def _check_run(table: dict[int, list[Action | None]], sim: Any, p2p: float) -> None:
    """Each rank runs one action at a time in table order; each starts after its deps."""
    deps = dependencies(table)
    owner = {a: r for r, row in table.items() for a in row if a is not None}
    for r, spans in sim.spans.items():
        assert [s.action for s in spans] == [a for a in table[r] if a is not None]
        for before, after in itertools.pairwise(spans):
            assert before.end <= after.start
        for s in spans:
            for d in deps(s.action):
                assert sim.span(d).end + (p2p if owner[d] != r else 0.0) <= s.start


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(SCHEDULES), p=st.integers(1, 6), data=st.data())
def test_every_generated_table_simulates(name: str, p: int, data: Any) -> None:
    m = data.draw(st.integers(1, 4 * p), label="m")
    v = {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2}.get(name, data.draw(st.integers(1, 3)))
    p2p = data.draw(st.sampled_from([0.0, 0.25, 1.0]), label="p2p")
    t = compute_table(name, v * p, p, m)
    validate(t, v * p, m)
    csv_t = read_csv(write_csv(t))
    assert csv_t == t
    sim = simulate(csv_t, p2p=p2p)
    _check_run(t, sim, p2p)
    assert 0.0 <= sim.bubble < 1.0
    # the lowered tables (with FSDP's UNSHARD/RESHARD too) predict the same step:
    # a RECV waits for its SEND plus p2p, exactly as the compute dependency did
    for fsdp in (False, True):
        low = lower(t, fsdp=fsdp)
        low_sim = simulate(low, p2p=p2p)
        _check_run(low, low_sim, p2p)
        assert low_sim.step_time == sim.step_time
        assert low_sim.bubble == sim.bubble
        assert low_sim.peak_inflight == sim.peak_inflight


def test_p2p_latency_is_added_per_cross_rank_dependency() -> None:
    # GPipe on 2 ranks, 1 microbatch: F0 -> (p2p) -> F1, B1 -> (p2p) -> B0
    t = compute_table("GPipe", 2, 2, 1)
    assert simulate(t, p2p=0.5).step_time == 6.0 + 2 * 0.5
    assert simulate(lower(t), p2p=0.5).step_time == 7.0
    # stages on one rank pay no latency: ZBV's turn at the bottom of the V
    z = simulate(compute_table("ZBVZeroBubble", 2, 1, 1), p2p=10.0)
    assert z.step_time == 6.0


def test_costs_per_stage_per_action_and_the_weight_half() -> None:
    t = compute_table("GPipe", 2, 2, 1)
    sim = simulate(t, forward=[1.0, 3.0], backward=[2.0, 4.0])
    assert sim.step_time == 1 + 3 + 4 + 2
    assert sim.span("1F0") == sim.span(Action(1, Kind.FORWARD, 0))
    assert (sim.span("1F0").start, sim.span("1F0").end) == (1.0, 4.0)
    per_mb = simulate(compute_table("GPipe", 1, 1, 2),
                      forward=lambda a: 1.0 + (a.microbatch or 0), backward=0.5)
    assert per_mb.step_time == 1 + 2 + 0.5 + 0.5
    zb = compute_table("InterleavedZeroBubble", 1, 1, 1)    # [0F0, 0I0, 0W0]
    sim = simulate(zb, forward=1.0, backward=2.0, weight=1.5)
    assert [(s.action.kind.value, s.end - s.start) for s in sim.spans[0]] == [
        ("F", 1.0), ("I", 0.5), ("W", 1.5)]
    default = simulate(zb, forward=1.0, backward=3.0)      # weight = backward / 2
    assert [s.end - s.start for s in default.spans[0]] == [1.0, 1.5, 1.5]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"forward": [1.0]}, r"forward has 1 per-stage costs, but the table has stages 0\.\.1"),
    ({"backward": 1.0, "weight": 2.0}, r"1I0 costs -1.0; costs must be >= 0"),
])
def test_cost_errors(kwargs: dict[str, Any], match: str) -> None:
    t = compute_table("InterleavedZeroBubble", 2, 2, 1)
    with pytest.raises(ShardingError, match=match):
        simulate(t, **kwargs)


def test_a_schedule_object_with_actions() -> None:
    t = compute_table("1F1B", 2, 2, 4)
    assert simulate(SimpleNamespace(actions=t)).step_time == simulate(t).step_time
    with pytest.raises(ShardingError, match="got int"):
        simulate(3)


def test_user_tables_deadlock_or_missing_backward_are_clear_errors() -> None:
    deadlock = read_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(ShardingError, match=r"deadlocks: rank 0 waits at 0B0 for 1B0"):
        simulate(deadlock)
    missing = read_csv("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")
    with pytest.raises(ShardingError, match=r"0B1 is missing \(rank 0 runs stage 0\)"):
        simulate(missing)
    # a user's own order (with idle slots, as torch's CSVs have) runs; idle slots are
    # not time: the ranks wait on dependencies
    mine = read_csv("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    assert simulate(mine).step_time == simulate(compute_table("1F1B", 2, 2, 2)).step_time


def test_unshard_and_reshard_are_accepted() -> None:
    # torch's _simulate_comms_compute rejects these ("Unsupported action type UNSHARD")
    t = lower(compute_table("Interleaved1F1B", 8, 4, 4), fsdp=True)
    assert any(a is not None and a.kind is Kind.UNSHARD for a in t[0])
    assert simulate(t).bubble == simulate(compute_table("Interleaved1F1B", 8, 4, 4)).bubble


def test_timeline_text() -> None:
    sim = simulate(compute_table("GPipe", 2, 2, 2))
    text = sim.timeline(width=36)
    lines = text.splitlines()
    assert lines[0] == "step 9 (bubble 0.333), peak in-flight {0: 2, 1: 2}"
    assert lines[1] == "rank 0 |[0F0[0F1............[0B0    [0B1    |"
    assert lines[2] == "rank 1 |....[1F0[1F1[1B0    [1B1    ........|"
    assert all(len(line) == len(lines[1]) for line in lines[1:])
    assert len(simulate(compute_table("1F1B", 4, 4, 16)).timeline(width=10).splitlines()[1]) \
        == len("rank 0 |") + 10 + 1
    with pytest.raises(ShardingError, match="width must be >= 1"):
        sim.timeline(width=0)


def test_rich_table() -> None:
    console_mod = pytest.importorskip("rich.console")
    console = console_mod.Console(record=True, width=120)
    console.print(simulate(compute_table("1F1B", 2, 2, 2)))
    out = console.export_text()
    assert "step 9, bubble 0.333" in out and "[0B0" in out


def test_svg_picture(tmp_path: Path) -> None:
    sim = simulate(compute_table("InterleavedZeroBubble", 4, 2, 2))
    path = tmp_path / "timeline.svg"
    sim.save_svg(path)
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    titles = [e.text for e in root.iter() if e.tag.endswith("title")]
    assert len(titles) == sum(len(row) for row in sim.spans.values())
    assert "0F0 0-1" in titles


def test_png_picture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulate(compute_table("1F1B", 2, 2, 2))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="needs matplotlib"):
        sim.save_png(tmp_path / "t.png")
    monkeypatch.undo()
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the refusal above is what a machine without it gets
        return
    sim.save_png(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
