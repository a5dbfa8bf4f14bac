"""auto_plan's refusals and ``shardwise plan``'s report (the Megatron pairing is
auto_plan's doctest; the time targets are ``benchmarks/planning.py`` rows)."""

from __future__ import annotations

import re

import pytest

from shardwise.cli import command
from shardwise.planning import ModelConfig, auto_plan
from shardwise.sharding.errors import ShardingError

TINY = ModelConfig.gpt(vocab=64, seq=16, dim=32, heads=4, layers=1)


def test_a_budget_nothing_fits_names_the_smallest_plan_and_what_dominates_it() -> None:
    with pytest.raises(ShardingError) as err:
        auto_plan(TINY, devices=2, batch=4, memory_budget=1024, max_pp=1)
    msg = str(err.value)
    assert "Cannot fit the model on 2 devices in 1.0 KiB per device" in msg
    assert re.search(r"the smallest plan \(dp2\(fsdp\), recompute\) needs [\d.]+ KiB, "
                     r"mostly activations \([\d.]+ KiB\)", msg)
    assert "Got memory_budget=1024" in msg


def test_plan_command_prints_the_top_plans_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert command.main(["plan", "--devices", "2", "--batch", "4", "--layers", "1",
                         "--dim", "32", "--vocab", "64", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt (") and "on 2 devices, batch 4, h100: best dp2" in out
    for row in ("step time", "memory/device", "  optimizer", "sent/step over dp",
                "where the time goes", "  #1  |"):
        assert row in out, row
    # the two data-parallel plans, one sharded (FSDP), side by side (either order: their
    # estimates differ by the optimizer's share of the bytes)
    top = re.findall(r"^  #[12]  (dp\S*)$", out, re.M)
    assert sorted(top) == ["dp2", "dp2(fsdp)"], top
    with pytest.raises(SystemExit):
        command.main(["plan", "--batch", "4"])     # --devices is required


def test_planning_bench_rows_report_the_targets() -> None:
    from benchmarks.planning import table
    from benchmarks.report import check_targets

    rows = [{"plan": f"dp{i}", "predicted_ms": 10.0 + i, "measured_ms": 10.5 + i,
             "error": -0.05} for i in range(10)]
    res = {"model": {"config": "gpt", "batch": 16, "world": 4}, "plans": rows,
           "within_20": 10, "spearman": 1.0,
           "auto_plan": {"plan": "dp0", "predicted_ms": 10.0, "measured_ms": 10.5,
                         "fastest_ms": 10.5, "over_fastest": 0.0},
           "scale": [{"case": "8b", "plan": "dp128 x tp8", "seconds": 30.0,
                      "max_rss_mib": 2000.0, "time_s": 5.0, "peak_gib": 40.0},
                     {"case": "70b", "error": "over 900 s"}]}
    met = {(t["target"], t["scope"]): t["met"] for t in check_targets({"planning": res})}
    assert met == {("planning_time", "10 plans"): True, ("planning_rank", "10 plans"): True,
                   ("planning_pick", "dp0"): True, ("planning_scale", "8b"): True,
                   ("planning_scale", "8b RSS"): True, ("planning_scale", "70b"): None}
    text = table(res)
    assert "within 20%: 10 of 10; Spearman 1.00" in text and "scale 70b: over 900 s" in text


def test_llama_styles_pair_megatron_where_the_times_tie() -> None:
    """After column-parallel q/k/v an unsharded ``wo`` costs the same all_reduce a
    row-parallel one does: the tie goes to the smaller memory, Megatron's pairing (the
    first minimum left ``wo`` and ``w2`` unsharded)."""
    llama = ModelConfig.llama3_8b(seq=2048).with_(layers=1)   # fake: sizes cost nothing
    choice = auto_plan(llama, devices=8, batch=8, profile="h100", max_pp=1, refine=1)
    tp = next(c for c in choice.candidates if c.plan.tp > 1)
    styles = dict(tp.plan.styles)
    assert styles["layers.*.attn.wo"] == styles["layers.*.mlp.w2"] == "rowwise"
    assert styles["layers.*.attn.wq"] == styles["layers.*.mlp.w1"] == "colwise"
