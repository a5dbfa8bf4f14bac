"""The pipeline benchmark section (benchmarks/pipeline.py) on 4 Gloo processes, tiny:
its rows, its table and its two target lines. No timing asserts (a shared machine);
the section itself checks that shardwise's and torch's losses agree before timing."""

from __future__ import annotations

from benchmarks import pipeline
from benchmarks.report import TARGETS, check_targets


def test_pipeline_rows_table_and_targets() -> None:
    res = pipeline.run(schedules=["1F1B", "ZBVZeroBubble"], repeat=1, warmup=0,
                       microbatches=4, forward_ms=1.0, backward_ms=2.0, weight_ms=1.0,
                       limit_s=240.0)
    assert res is not None and res["benchmark"] == "pipeline"
    assert [r["schedule"] for r in res["rows"]] == ["1F1B", "ZBVZeroBubble"]
    for r in res["rows"]:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0 and r["torch_ms"] > 0
        assert r["stages"] == (4 if r["schedule"] == "1F1B" else 8)
    assert res["costs_ms"]["forward"] >= 1.0 and res["p2p_ms"] > 0
    text = "\n".join(pipeline.tables(res))
    assert "ZBVZeroBubble" in text and "x torch" in text
    targets = check_targets({"pipeline": res})
    assert {t["target"] for t in targets} == {"pipeline_sim", "pipeline_torch"} <= set(TARGETS)
    assert len(targets) == 4
