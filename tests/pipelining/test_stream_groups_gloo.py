"""NCCL's stream layout, run on Gloo: with SHARDWISE_P2P_STREAM_GROUPS=1 every
point-to-point stream has its own two-rank process group (what NCCL needs, since it
ignores tags), and the pipeline's schedules still equal single-device torch; a
mismatched key and a dead peer still raise the same errors."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import pipe_bodies
from tests.helpers.harness import free_port, run_bounded, run_on_ranks

GPT_PP = Path(__file__).resolve().parents[2] / "examples" / "gpt_pp.py"

BODIES = ["body_stream_groups_pp4", "body_stream_groups_pp2_tp2"]
LIMIT_S = 60.0


@pytest.fixture(scope="module")
def forced() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit it
        mp.setenv("SHARDWISE_P2P_STREAM_GROUPS", "1")
        yield


@pytest.fixture(scope="module")
def schedules(forced: None) -> dict[int, dict[str, str | None]]:
    return run_on_ranks(pipe_bodies.__name__, BODIES, 4)


@pytest.mark.parametrize("name", BODIES)
def test_schedules_equal_torch_with_a_group_per_stream(
        schedules: dict[int, dict[str, str | None]], name: str) -> None:
    assert sorted(schedules) == [0, 1, 2, 3], schedules
    for r, res in schedules.items():
        assert res.get("<setup>") is None, res
        assert res[name] is None, f"rank {r}:\n{res[name]}"


def _faults(name: str) -> dict[int, dict[str, str | None]]:
    start = time.monotonic()
    results = run_on_ranks(pipe_bodies.__name__, [name], 2, limit_s=LIMIT_S,
                           timeout_s=pipe_bodies.FAULT_TIMEOUT_S)
    assert time.monotonic() - start < LIMIT_S
    return results


def test_a_mismatched_key_raises_on_both_ranks(forced: None) -> None:
    results = _faults("body_mismatched_tag")
    for r in (0, 1):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_mismatched_tag"] is None, results[r]["body_mismatched_tag"]


def test_a_dead_peer_makes_the_other_stage_raise(forced: None) -> None:
    results = _faults("body_dead_peer")
    assert results[1] == {"<exit>": "exit code 17"}, results.get(1)
    assert results[0].get("<setup>") is None, results[0]
    assert results[0]["body_dead_peer"] is None, results[0]["body_dead_peer"]


def test_the_gpt_example_under_torchrun_with_a_group_per_stream(forced: None) -> None:
    """The command a GPU session runs with ``--backend nccl``, here on Gloo with NCCL's
    stream layout: interleaved 1F1B on pp=2 x tp=2 at parity with torch."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = run_bounded([torchrun, "--nproc-per-node", "4", "--master-port", str(free_port()),
                       str(GPT_PP), "--backend", "gloo", "--mesh", "2x1x2", "--schedule",
                       "Interleaved1F1B", "--steps", "2"], 240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(torch.distributed, 4 processes)" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("parity OK"), out.stdout
