"""Multi-process safety by default (issue 13): every fault scenario in ``safety.py``
becomes a CollectiveError on the ranks that must see it, within the timeout.

Each launch has a hard wall-clock limit (the harness kills stragglers); a rank that
died on purpose reports its exit code; every other rank must report success (its
body checks the error, its message and its timing itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import safety
from tests.helpers.harness import free_port, run_on_ranks

LIMIT_S = 120.0


def _run(names: list[str], world: int, *, died: int | None = None, code: str = "17") -> None:
    start = time.monotonic()
    results = run_on_ranks(safety.__name__, names, world, limit_s=LIMIT_S,
                           timeout_s=safety.TIMEOUT_S)
    assert time.monotonic() - start < LIMIT_S
    for r in range(world):
        assert r in results, f"rank {r} did not report within {LIMIT_S} s: {results}"
        if r == died:
            assert set(results[r]) == {"<exit>"} and code in results[r]["<exit>"], results[r]
            continue
        assert results[r].get("<setup>") is None, results[r]["<setup>"]
        failed = {k: v for k, v in results[r].items() if v}
        assert not failed, f"rank {r}:\n" + "\n".join(f"--- {k}\n{v}" for k, v in failed.items())


# One world runs several disagreements in a row: nothing is exchanged when the control
# message disagrees, and every rank raises, so the world stays usable.
MISMATCHES = ["body_all_gather_other_dim", "body_all_reduce_shapes", "body_all_reduce_ops",
              "body_dtypes", "body_other_collective", "body_reduce_scatter_vs_all_reduce",
              "body_lax_mismatch", "body_learned_room"]


@pytest.mark.parametrize("world", [2, 3])
def test_disagreements_raise_on_every_rank(world: int) -> None:
    _run(MISMATCHES, world)


def test_group_creation_mismatch() -> None:
    _run(["body_group_creation_mismatch"], 4)


def test_other_axis_with_warm_groups_is_bounded() -> None:
    _run(["body_group_warm_other_axis"], 4)


@pytest.mark.parametrize("name", ["body_skip_all_gather_stay_alive", "body_skip_then_next",
                                  "body_stall", "body_stall_late_member",
                                  "body_skip_barrier", "body_skip_ppermute",
                                  "body_skip_lax_psum"])
def test_skips_and_stalls_are_bounded(name: str) -> None:
    _run([name], 3)


@pytest.mark.parametrize(("name", "code"), [
    ("body_killed_all_reduce", str(-9)), ("body_dead_all_reduce_large", "17"),
    ("body_dead_ppermute", str(-9)), ("body_dead_barrier", "17"),
    ("body_dead_lax_ppermute", str(-9))])
def test_dead_or_killed_peer_is_bounded(name: str, code: str) -> None:
    _run([name], 3, died=2, code=code)


RENDEZVOUS = """
import sys, time
import torch.distributed
import shardwise.distributed as sd
start = time.monotonic()  # after the imports: only the rendezvous is timed
try:
    sd.initialize("gloo", rank=int(sys.argv[1]), world_size=3, master_addr="127.0.0.1",
                  master_port=int(sys.argv[2]), timeout_s=float(sys.argv[3]))
except sd.CollectiveError as err:
    print(f"CollectiveError after {time.monotonic() - start:.1f}s: {err}")
    sys.exit(3)
print("initialized")
"""


def test_rendezvous_with_a_missing_process_is_bounded() -> None:
    """initialize() for 3 processes, only 2 started: both raise within the timeout."""
    port, timeout_s = free_port(), 4.0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RENDEZVOUS, str(r), str(port),
                               str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 3, (out, err[-2000:])
        assert "rendezvous of 3 processes" in out, out
        took = float(out.split("after ")[1].split("s:")[0])
        assert took < timeout_s + 10, out


def test_shutdown_releases_every_process_group() -> None:
    _run(["body_shutdown_releases_groups"], 4)
