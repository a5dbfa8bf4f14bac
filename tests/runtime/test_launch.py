"""The example program runs unchanged under python and under torchrun; the
distributed API behaves without torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise as sw
import shardwise.distributed as sd
from tests.helpers import HELPERS_DIR
from tests.helpers.harness import free_port, run_bounded

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


FORGOT = HELPERS_DIR / "forgot_initialize.py"


def _torchrun(*args: str, limit_s: float = 150) -> subprocess.CompletedProcess[str]:
    """torchrun with 2 ranks under a hard limit (:func:`harness.run_bounded`)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return run_bounded([str(torchrun), "--nproc-per-node", "2", "--master-port",
                        str(free_port()), *args], limit_s)


def test_forgotten_initialize_under_torchrun_is_an_error() -> None:
    out = _torchrun(str(FORGOT))
    assert out.returncode != 0, out.stdout
    assert "holds" not in out.stdout  # nothing was simulated silently
    assert "shardwise.distributed.initialize()" in out.stderr, out.stderr[-3000:]
    assert "WORLD_SIZE=2" in out.stderr


def test_initialized_under_torchrun_holds_own_shards() -> None:
    out = _torchrun(str(FORGOT), "--init")
    assert out.returncode == 0, out.stderr[-3000:]
    found = sorted(re.findall(r"process (\d) holds \[(\d)\]; psum 2\.0", out.stdout))
    assert found == [("0", "0"), ("1", "1")], (out.stdout, out.stderr[-3000:])


@pytest.mark.parametrize(("world", "fails"), [("2", True), ("1", False)])
def test_world_size_from_the_environment(world: str, fails: bool) -> None:
    """The check reads the launcher's WORLD_SIZE; a world of one simulates as before."""
    env = {**os.environ, "WORLD_SIZE": world, "RANK": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(FORGOT)], capture_output=True, text=True,
                         timeout=120, check=False, env=env)
    if fails:
        assert out.returncode != 0 and "maybe_initialize()" in out.stderr, out.stderr[-2000:]
        assert "holds" not in out.stdout
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "process 0 holds [0, 1]; psum 2.0" in out.stdout
