"""A dead or mismatched rank makes the others raise CollectiveError, not hang."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.helpers import HELPERS_DIR, faults
from tests.helpers.harness import check_body, free_port, run_bounded, run_on_ranks


def test_dead_rank_makes_others_raise() -> None:
    start = time.monotonic()
    results = run_on_ranks(faults.__name__, ["body_dead_rank"], 3, limit_s=120,
                           timeout_s=faults.TIMEOUT_S)
    assert results[2] == {"<exit>": "exit code 17"}, results.get(2)
    for r in (0, 1):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_dead_rank"] is None, results[r]["body_dead_rank"]
    assert time.monotonic() - start < 120


def test_mismatched_collective_raises_within_timeout() -> None:
    results = run_on_ranks(faults.__name__, ["body_mismatched_collective"], 2, limit_s=120,
                           timeout_s=faults.TIMEOUT_S)
    for r in (0, 1):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_mismatched_collective"] is None, \
            results[r]["body_mismatched_collective"]


def test_same_size_mismatch_is_caught_when_checking() -> None:
    results = run_on_ranks(faults.__name__, ["body_same_size_mismatch_checked"], 2, limit_s=120,
                           timeout_s=faults.TIMEOUT_S)
    for r in (0, 1):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_same_size_mismatch_checked"] is None, \
            results[r]["body_same_size_mismatch_checked"]


def test_a_rank_that_dies_without_reporting_fails_the_body() -> None:
    """The harness must not count a silent exit as a pass (exit code 0 included)."""
    with pytest.raises(AssertionError, match=r"rank 1\n<exit>: exit code 0"):
        check_body(faults.__name__, ["body_rank_exits_silently"], 2, "body_rank_exits_silently")


def test_a_frozen_store_host_is_named_within_the_timeout() -> None:
    """Rank 0 hosts the store and freezes (SIGSTOP): ranks 1 and 2 raise in time naming
    it (TCPStore's reads ignore their timeout then; the diagnosis has its own)."""
    start = time.monotonic()
    results = run_on_ranks(faults.__name__, ["body_store_host_frozen"], 3, limit_s=60,
                           timeout_s=faults.FAST_TIMEOUT_S, frozen=frozenset({0}))
    for r in (1, 2):
        assert r in results, f"rank {r} did not report: {results}"
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_store_host_frozen"] is None, results[r]["body_store_host_frozen"]
    assert time.monotonic() - start < 60


def test_a_stalled_rank_is_the_culprit_not_the_rank_waiting_for_it() -> None:
    results = run_on_ranks(faults.__name__, ["body_stalled_rank_culprit"], 4, limit_s=60,
                           timeout_s=faults.FAST_TIMEOUT_S)
    for r in range(4):
        assert r in results, f"rank {r} did not report: {results}"
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_stalled_rank_culprit"] is None, \
            results[r]["body_stalled_rank_culprit"]


def test_torchrun_names_a_witness_not_the_bystander_as_root_cause() -> None:
    """The witnesses of rank 2's stall (ranks 0 and 3) fail first; rank 1, which raised
    because rank 0 waited for rank 2, fails later: torchrun's root cause is a witness,
    whose error names rank 2."""
    torchrun = Path(sys.executable).with_name("torchrun")
    script = Path(HELPERS_DIR) / "stall_under_torchrun.py"
    start = time.monotonic()
    out = run_bounded([str(torchrun), "--nproc-per-node", "4", "--master-port",
                       str(free_port()), str(script)], 90)
    assert time.monotonic() - start < 90
    assert out.returncode != 0
    text = out.stdout + out.stderr
    root = text.split("Root Cause (first observed failure):")[1]
    rank = int(root.split("rank      : ")[1].split()[0])
    assert rank in (0, 3), text[-4000:]
    assert "[2] did not arrive" in text, text[-4000:]
