"""``shardwise bench`` finds the repository's suite, or says how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import command as cli

ROOT = Path(__file__).resolve().parents[2]


def test_finds_the_repository_suite() -> None:
    assert cli.find_benchmarks() == ROOT
    assert cli.find_benchmarks([ROOT / "src" / "shardwise"]) == ROOT


def test_missing_suite_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.find_benchmarks([tmp_path]) is None
    # an installed package: neither its folder nor the current folder is in a checkout
    monkeypatch.setattr(cli, "find_benchmarks", lambda starts=None: None)
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/" in err and "python -m benchmarks" in err


def test_bench_help_lists_the_suite_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise bench")
    for option in ("--quick", "--out", "--no-gloo", "--no-dtensor", "--devices"):
        assert option in out


def test_python_m_benchmarks_parses_the_same_options() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m benchmarks") and "--no-gloo" in proc.stdout
