"""scripts/gpu_check.sh's checks (``python -m benchmarks.gpu_check``) run on the CPU at
small size, so that they cannot rot before a GPU comes: every row passes, the table and
the JSON say so, and the JSON goes where ``--out`` says. The runner's reporting (a
failing row, a check that breaks, a run out of time) is checked without processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check, on_device

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 420   # about 50 s on 2 cores; the bound is for a stuck run, not for speed


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"gpu_check {argv} did not finish within {LIMIT_S} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_cpu_run_passes_every_row(tmp_path: Path) -> None:
    done = _run(["--device", "cpu", "--size", "small", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-cpu.json").read_text())
    rows = result["rows"]
    assert [r["key"] for r in rows] == [k for keys in gpu_check.ROWS.values() for k in keys]
    assert {r["key"]: r["status"] for r in rows if r["status"] != "PASS"} == {}, [
        (r["key"], r["detail"]) for r in rows if r["status"] != "PASS"]
    assert result["meta"]["device"] == "cpu" and result["meta"]["size"] == "small"
    out = done.stdout
    for r in rows:   # the table: one line per row, its title, result and detail
        assert any(r["title"] in ln and " PASS " in ln and r["detail"] in ln
                   for ln in out.splitlines()), r["title"]
    assert "parity OK on 2 processes" in out and "p2p loopback" in out
    assert "per-op dispatch, process runtime: 1 Gloo ranks" in out   # the speed tables
    assert "training steps (median ms" in out
    assert "13 passed, 0 failed, 0 skipped in" in out and str(tmp_path) in out
    assert out.count("compiled (aot_eager): 1 graphs, 0 graph breaks") == 2
    dispatch = next(r for r in rows if r["key"] == "speed.dispatch")["data"]["dispatch"]
    assert [r["op"] for r in dispatch["rows"]] == ["gelu", "add", "linear"]


def _fake_check(device: str, size: str) -> Iterator[tuple[str, Any]]:
    yield "world.collectives", lambda: (True, "fine", {})
    yield "world.agreement", lambda: 1 / 0
    raise RuntimeError("the check broke\nsecond line")


def test_a_failing_row_is_reported_and_the_others_still_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(on_device.CHECKS, "world", _fake_check)
    monkeypatch.delenv(gpu_check.BUDGET_ENV, raising=False)   # (else: an alarm here)
    out = io.StringIO()
    with redirect_stdout(out):
        assert gpu_check._child("world", "cpu", "small") == 0
    rows = [json.loads(ln[len(gpu_check._MARK):]) for ln in out.getvalue().splitlines()]
    assert [(r["key"], r["status"], r["detail"]) for r in rows] == [
        ("world.collectives", "PASS", "fine"),
        ("world.agreement", "FAIL", "ZeroDivisionError: division by zero"),
        ("world.p2p", "FAIL", "RuntimeError: the check broke")]


class _Fake:
    """A check's process that reported its rows (one failed)."""

    def __init__(self, check: str, device: str, size: str, budget: float) -> None:
        self.check = check

    def rows(self) -> list[dict[str, Any]]:
        return [{"key": k, "status": "FAIL" if k == "world.p2p" else "PASS",
                 "detail": "d", "seconds": 1.0, "data": {}} for k in gpu_check.ROWS[self.check]]


def test_the_run_writes_the_json_skips_past_its_time_and_exits_1_on_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "_Launched", _Fake)
    lines: list[str] = []
    result = gpu_check.run("cpu", "small", tmp_path, ["world", "speed"], say=lines.append)
    assert [r["status"] for r in result["rows"]] == ["PASS", "PASS", "FAIL", "PASS", "PASS"]
    assert json.loads((tmp_path / "gpu-cpu.json").read_text())["rows"] == result["rows"]
    assert lines[-1].startswith("4 passed, 1 failed, 0 skipped in")
    monkeypatch.setattr(gpu_check, "TOTAL_S", 10.0)   # no time left for any check
    result = gpu_check.run("cpu", "small", tmp_path, ["world"], say=lines.append)
    assert {r["status"] for r in result["rows"]} == {"SKIP"}
    assert "the run's 10 s were spent" in result["rows"][0]["detail"]
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: {"rows": [{"status": "FAIL"}]})
    assert gpu_check.main(["--device", "cpu", "--only", "world"]) == 1


def test_the_script_is_valid_bash() -> None:
    script = ROOT / "scripts" / "gpu_check.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
