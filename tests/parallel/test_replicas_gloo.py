"""The opt-in replica check on Gloo processes (issue 24, item 6)."""

from __future__ import annotations

import pytest

from tests.helpers import replica_bodies
from tests.helpers.harness import run_on_ranks


def _passed(name: str, world: int) -> None:
    results = run_on_ranks(replica_bodies.__name__, [name], world, limit_s=90, timeout_s=5.0)
    for r in range(world):
        assert r in results, f"rank {r} did not report: {results}"
        assert results[r].get("<setup>") is None, results[r]
        assert results[r][name] is None, f"rank {r}:\n{results[r][name]}"


def test_a_differing_parameter_is_named_at_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_CHECK_REPLICAS", "2")
    _passed("body_param_differs", 3)


def test_a_differing_input_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_CHECK_REPLICAS", "1")
    _passed("body_input_differs", 3)


def test_two_ranks_are_both_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_CHECK_REPLICAS", "1")
    _passed("body_two_ranks_name_both", 2)


def test_the_check_off_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDWISE_CHECK_REPLICAS", raising=False)
    _passed("body_check_off_installs_nothing", 2)
