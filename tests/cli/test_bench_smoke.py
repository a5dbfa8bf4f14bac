"""Smoke tests of the benchmark suite: tiny sizes, JSON keys and tables only.

No timing asserts: timings on a shared machine are noise at these sizes. The
suite validates every measured result against a reference before timing it, so a
passing run also means the simulated (and DTensor) results were right.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import run_suite
from benchmarks.report import TARGETS, tables
from benchmarks.simulated import CASES
from benchmarks.suite import parser, write

TINY = {"size": 16, "small": 8, "repeat": 1, "small_repeat": 3, "small_inner": 2,
        "profile_calls": 5, "ckpt": {"tensors": 2, "repeat": 1, "shape": (16, 32)},
        "attention": {"seq": 16, "heads": 4, "dim": 8, "repeat": 1}}
ROW_KEYS = {"case", "op", "time", "min", "faults_per_call", "must_move_bytes", "copy_ceiling",
            "clone_ceiling", "x_copy", "x_clone", "dtensor", "dtensor_over_shardwise"}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    res = run_suite("quick", devices=(2, 4), gloo=False, compile=False, **TINY)
    path, text = write(res, tmp_path_factory.mktemp("bench"))
    return json.loads(path.read_text()), path, text


def test_top_level_keys(result: tuple[dict, Path, Path]) -> None:
    data, _, _ = result
    assert {"meta", "simulated", "memory", "profile", "targets", "gloo_skipped"} <= set(data)
    assert {"preset", "torch", "threads", "seconds", "loadavg_start"} <= set(data["meta"])


def test_simulated_section(result: tuple[dict, Path, Path]) -> None:
    sim = result[0]["simulated"]
    assert {"tensor", "devices", "modes", "dtensor", "validation", "large", "small"} <= set(sim)
    assert sim["devices"] == [2, 4] and sim["tensor"] == [16, 16]
    assert {"available", "why_not", "how"} <= set(sim["dtensor"])
    assert all(all(ok.values()) for ok in sim["validation"].values())
    blocks = [b for b in sim["large"] if "rows" in b]
    assert {(b["mode"], b["devices"]) for b in blocks} <= {(m, n) for m in ("default", "reuse")
                                                           for n in (2, 4)}
    assert {("default", 2), ("default", 4)} <= {(b["mode"], b["devices"]) for b in blocks}
    for b in blocks:
        assert set(b["ceilings"]) == {"copy_", "clone"}
        assert [r["case"] for r in b["rows"]] == list(CASES)
        for r in b["rows"]:
            assert set(r) >= ROW_KEYS
            assert r["time"] > 0 and r["must_move_bytes"] >= 0
            assert (r["dtensor"] is None) == (not sim["dtensor"]["available"]
                                              or r["case"] not in ("S(0)->R", "S(0)->S(1)",
                                                                   "P->R", "P->S(0)", "R->S(0)"))
    for b in sim["small"]:
        assert b["shape"] == [8, 8]
        cases = {r["case"] for r in b["rows"]}
        assert set(CASES) <= cases
        assert all({"us", "min_us", "dtensor_us", "dtensor_over_shardwise"} <= set(r)
                   for r in b["rows"])


def test_attention_section(result: tuple[dict, Path, Path]) -> None:
    att = result[0]["attention"]
    assert set(att["simulated"]) == {"1", "2", "4"} and att["gloo"] == {}
    for cp, rows in att["simulated"].items():
        assert set(rows) == {"full", "ring", "alltoall", "all_gather"}
        for name in ("ring", "alltoall", "all_gather"):
            assert rows[name]["bytes"] == rows[name]["closed_form"], (cp, name, rows[name])
    assert "context-parallel attention" in result[2].read_text()


def test_memory_profile_targets(result: tuple[dict, Path, Path]) -> None:
    data = result[0]
    mem = data["memory"]
    assert "error" not in mem, mem.get("error")
    assert {"devices", "tensor", "tensor_mib", "rows", "peak_rss_mib"} <= set(mem)
    assert all({"case", "rss_growth_mib", "note"} <= set(r) for r in mem["rows"])
    prof = data["profile"]
    assert set(prof["ops"]) == {"S(0)->R", "S(0)->S(1)", "P->R", "P->S(0)", "R->S(0)",
                                "ppermute"}
    for p in prof["ops"].values():
        assert p["top"] and {"function", "tottime_us", "cumtime_us", "ncalls_per_op"} <= set(
            p["top"][0])
    keys = {t["target"] for t in data["targets"]}
    assert {"copy", "free", "overhead", "memory"} <= keys <= set(TARGETS)
    assert all({"scope", "value", "limit", "unit", "met"} <= set(t) for t in data["targets"])


def test_checkpoint_section(result: tuple[dict, Path, Path]) -> None:
    ckpt = result[0]["checkpoint"]
    assert "error" not in ckpt, ckpt.get("error")
    assert ckpt["tensors"] == 2 and ckpt["tensor"] == [16, 32]
    assert [r["case"].split(",")[0] for r in ckpt["rows"]] == [
        "dcp.save", "dcp.load", "dcp.load", "checkpoint.save (atomic",
        "checkpoint.load (CRC-32s checked)", "save_safetensors (by offsets)",
        "load_safetensors (slices"]
    assert all(r["shardwise_mib_s"] > 0 and r["reference_mib_s"] > 0 for r in ckpt["rows"])
    assert [r["case"].split(",")[0] for r in ckpt["checksum_rows"]] == [
        "checkpoint.save", "checkpoint.load", "save_safetensors", "load_safetensors"]
    assert all(r["ratio"] > 0 for r in ckpt["checksum_rows"])
    mem = ckpt["memory"]
    assert "error" not in mem, mem.get("error")
    assert mem["largest_block_mib"] > 0 and mem["anon_peak_above_model_mib"] is not None
    keys = {t["target"] for t in result[0]["targets"]}
    assert {"checkpoint", "checkpoint_checksums", "checkpoint_memory"} <= keys


def test_moe_section(result: tuple[dict, Path, Path]) -> None:
    moe = result[0]["moe"]
    rows = {(r["runtime"], r["ep"], r["mode"].split()[0]): r for r in moe["rows"]}
    assert set(rows) == {("torch", 0, "one"), *(("simulated", ep, mode) for ep in (1, 2, 4)
                                               for mode in ("dropless", "capacity"))}
    assert all(r["ms"] > 0 for r in moe["rows"])
    for ep in (2, 4):  # fixed slots move exactly the closed form; routed rows about it
        assert rows["simulated", ep, "capacity"]["bytes"] == rows[
            "simulated", ep, "capacity"]["formula_bytes"] > 0
        assert 0.5 < rows["simulated", ep, "dropless"]["bytes"] / rows[
            "simulated", ep, "dropless"]["formula_bytes"] < 1.5
    assert rows["simulated", 1, "dropless"]["bytes"] == 0
    assert "expert parallel: MoE layer" in result[2].read_text()


def test_table_written(result: tuple[dict, Path, Path]) -> None:
    data, _, text = result
    table = text.read_text()
    assert table.strip() == tables(data).strip()
    assert "targets (issue 7):" in table and "copy ceiling" in table


def test_cli_arguments() -> None:
    args = parser().parse_args(["--quick", "--out", "somewhere", "--no-gloo", "--devices", "4",
                                "--no-checkpoint"])
    assert args.quick and args.no_gloo and args.out == "somewhere" and args.devices == [4]
    assert args.no_checkpoint


def test_gloo_section_tiny() -> None:
    from benchmarks import gloo

    res = gloo.run(world=2, size=8, repeat=1, warmup=0, small_repeat=1, choices=False,
                   limit_s=120.0)
    assert res is not None
    assert {"meta", "notes", "large", "small", "primitive_choice", "validation"} <= set(res)
    for r in res["large"]:
        assert {"case", "shardwise_ms", "raw_ms", "dtensor_ms", "shardwise_over_raw"} <= set(r)
    assert "\n".join(gloo.gloo_tables(res))


def test_torch_native_training_steps(result: tuple[dict, Path, Path]) -> None:
    data, _, text = result
    tn = data["torch"]
    keys = {"case", "clock", "shardwise_ms", "torch_ms", "ratio", "shardwise_min_ms",
            "torch_min_ms", "ratio_min"}
    assert keys <= set(tn["mlp"])
    assert [g["dim"] for g in tn["gpt"]] == [32, 256]
    assert all(keys <= set(g) and g["shardwise_ms"] > 0 and g["torch_ms"] > 0 for g in tn["gpt"])
    gpt = [t for t in data["targets"] if t["target"] == "torch_gpt"]
    assert [t["limit"] for t in gpt] == [3.0, 1.5]
    assert "GPT V=64 T=16 D=256" in text.read_text()


def test_gpt_gloo_section_tiny() -> None:
    """The GPT step comparison runs (2 ranks: TP 2 x FSDP 1), checks that both
    programs' losses agree before timing, and reports a target row."""
    from benchmarks import gpt_gloo
    from benchmarks.report import check_targets

    res = gpt_gloo.run(world=2, tp=2, layers=1, repeat=1, warmup=0, check=1, limit_s=240)
    assert res is not None and res["benchmark"] == "gpt_gloo"
    assert res["losses"]["shardwise"] and res["losses"]["dtensor"]
    assert set(res["step"]) == {"shardwise", "dtensor", "shardwise_unchecked"}
    assert "DTensor" in "\n".join(gpt_gloo.tables(res))
    rows = [t for t in check_targets({"gpt_gloo": [res]}) if t["target"] == "gpt_dtensor"]
    assert len(rows) == 1 and rows[0]["value"] == res["x_dtensor"]


def test_compile_section_tables() -> None:
    # the section compiles a model (~20 s): its row's form is checked here, its run
    # by `shardwise bench`
    from benchmarks.compiled import tables as compile_tables
    from benchmarks.report import check_targets

    assert "skipped: transformers is not installed" in "\n".join(
        compile_tables({"skipped": "transformers is not installed"}))
    row = {"case": "tiny HF Llama", "eager_ms": 5.0, "compiled_ms": 6.0, "ratio": 1.2,
           "ratio_min": 1.1, "compile_s": 15.0, "max_abs_diff": 0.0, "recompiles": 0}
    assert "1.20x" in "\n".join(compile_tables(row))
    (target,) = [t for t in check_targets({"compile": row}) if t["target"] == "compile"]
    assert target["met"] is True and "compile" in TARGETS
    cases = ("forward eager", "forward compiled", "train eager", "train compiled")
    lib = {"ms": dict(zip(cases, (20.0, 8.0, 40.0, 16.0), strict=True)),
           "first_s": dict.fromkeys(cases, 1.0), "graph_breaks": 0, "unique_graphs": 2,
           "max_abs_diff": 0.0}
    slower = {**lib, "ms": {k: 2 * v for k, v in lib["ms"].items()}}
    steps = {"case": "tiny HF Llama", "gloo": {"world": 2, "dtensor": slower, "shardwise": lib},
             "simulated": lib}
    text = "\n".join(compile_tables({**row, "steps": steps}))
    assert "dtensor, 2 Gloo ranks" in text and "DeviceMesh.cpu(2)" in text
    met = {t["target"]: t["met"] for t in check_targets({"compile": {**row, "steps": steps}})}
    assert met["compile_forward_vs_dtensor"] is True and met["compile_train_vs_dtensor"] is True
    four = {"case": "tiny HF Llama", "gloo": {"world": 4, "dtensor": lib, "shardwise": slower}}
    both = check_targets({"compile": {**row, "steps": steps, "steps4": four}})
    scoped = {(t["target"], t["scope"]): t["met"] for t in both}
    assert scoped[("compile_train_vs_dtensor", "Llama train compiled, 4 Gloo ranks")] is False
    assert scoped[("compile_train_vs_dtensor", "Llama train compiled, 2 Gloo ranks")] is True
    assert "dtensor, 4 Gloo ranks" in "\n".join(compile_tables({**row, "steps4": four}))
    assert "compile_train_vs_dtensor" in TARGETS
    gpt = {"case": "GPT example D=256", "ms": {"shardwise eager": 13.0, "shardwise compiled": 13.0,
                                              "torch eager": 10.0, "torch compiled": 10.0,
                                              "shardwise compiled, AdamW loop": 15.0,
                                              "torch compiled, AdamW loop": 12.0},
           "first_s": {"shardwise compiled": 7.0}, "graph_breaks": 0, "ratio": 1.3,
           "ratio_eager": 1.3, "ratio_adamw_loop": 1.25}
    text = "\n".join(compile_tables({**row, "simulated_gpt": gpt}))
    assert "1.30x torch compiled" in text and "default loop" in text and "1.25x" in text
    (sim,) = [t for t in check_targets({"compile": {**row, "simulated_gpt": gpt}})
              if t["target"] == "compile_simulated_vs_torch"]
    assert sim["met"] is False and sim["limit"] == 1.2


def test_dispatch_section_tiny() -> None:
    """The per-op dispatch rows on 2 Gloo ranks: every way measured, checked against torch
    on the local blocks, and the target evaluated per op."""
    from benchmarks import dispatch
    from benchmarks.report import check_targets

    res = dispatch.run(repeat=1, inner=2, ops=["gelu", "add", "linear"], limit_s=240)
    assert res is not None and res["benchmark"] == "dispatch"
    assert [r["op"] for r in res["rows"]] == ["gelu", "add", "linear"]
    assert all(r["floor_us"] is not None and r["dtensor_us"] is not None
               and r["shardwise_us"] is not None for r in res["rows"])
    assert "DTensor +us" in "\n".join(dispatch.tables(res))
    rows = [t for t in check_targets({"dispatch": res}) if t["target"] == "dispatch"]
    assert len(rows) == 3 and all(t["met"] in (True, False) for t in rows)


def test_entry_point_section(result: tuple[dict, Path, Path]) -> None:
    """Every (entry point, op) row, checked against torch before timing; the issue 22
    target covers gelu and add on sw.tensor, sw.shard and from_local."""
    from benchmarks.entry_points import ENTRIES, OPS, TARGET_ENTRIES, TARGET_OPS

    data, _, text = result
    rows = data["entry_points"]["rows"]
    assert [(r["entry"], r["op"]) for r in rows] == [(e, o) for e in ENTRIES for o in OPS]
    assert all(r["shardwise_us"] > 0 and r["torch_us"] > 0 for r in rows)
    targets = [t for t in data["targets"] if t["target"] == "entry_point"]
    assert len(targets) == len(TARGET_ENTRIES) * len(TARGET_OPS)
    assert "per-op overhead by entry point" in text.read_text()
