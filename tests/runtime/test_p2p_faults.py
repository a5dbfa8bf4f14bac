"""Pipeline transfers under the failure model of every collective: a mismatched tag, a
dead or a stalled peer raise CollectiveError (naming the peer, the stages and the tag)
on every rank within the timeout, never a hang."""

from __future__ import annotations

import time

import pytest

from tests.helpers import pipe_bodies
from tests.helpers.harness import run_on_ranks

LIMIT_S = 60.0


def _run(name: str, world: int = 2) -> dict[int, dict[str, str | None]]:
    start = time.monotonic()
    results = run_on_ranks(pipe_bodies.__name__, [name], world, limit_s=LIMIT_S,
                           timeout_s=pipe_bodies.FAULT_TIMEOUT_S)
    assert time.monotonic() - start < LIMIT_S
    return results


@pytest.mark.parametrize("name", ["body_mismatched_tag", "body_stalled_peer"])
def test_every_rank_raises(name: str) -> None:
    results = _run(name)
    for r in (0, 1):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r][name] is None, results[r][name]


def test_a_dead_peer_makes_the_other_stage_raise() -> None:
    results = _run("body_dead_peer")
    assert results[1] == {"<exit>": "exit code 17"}, results.get(1)
    assert results[0].get("<setup>") is None, results[0]
    assert results[0]["body_dead_peer"] is None, results[0]["body_dead_peer"]


def test_a_stage_dying_mid_step_makes_every_other_rank_raise() -> None:
    """pp=4: the last stage dies in its second forward; ranks 0-2 raise CollectiveError
    (the failure travels up the pipeline: each rank's wait on its dead or failed
    neighbour ends), none hangs."""
    results = _run("body_stage_dies_mid_step", world=4)
    assert results[3] == {"<exit>": "exit code 17"}, results.get(3)
    for r in (0, 1, 2):
        assert results[r].get("<setup>") is None, results[r]
        assert results[r]["body_stage_dies_mid_step"] is None, \
            results[r]["body_stage_dies_mid_step"]
