"""The example program runs unchanged under python and under torchrun; the
distributed API behaves without torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

import shardwise as sw
import shardwise.distributed as sd

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tour.py"


def test_example_simulated() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "runtime: simulated" in out.stdout
    assert "all checks passed" in out.stdout


def test_example_under_torchrun() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    out = subprocess.run([str(torchrun), "--nproc-per-node", "4", "--master-port", str(port),
                          str(EXAMPLE)], capture_output=True, text=True, timeout=180,
                         check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch.distributed, 4 processes" in out.stdout
    assert out.stdout.count("all checks passed") == 1  # only process 0 prints


def test_not_initialized_defaults() -> None:
    assert not sd.is_initialized()
    assert sd.process_index() == 0
    assert sd.process_count() == 1


def test_maybe_initialize_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert sd.maybe_initialize() is False
    assert not sd.is_initialized()


def test_initialize_without_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(sw.ShardingError, match="torchrun"):
        sd.initialize()


def test_collective_error_is_in_the_family() -> None:
    assert issubclass(sd.CollectiveError, sw.ShardingError)
    assert issubclass(sd.CollectiveError, RuntimeError)
