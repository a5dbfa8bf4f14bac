"""The shard_map bodies on real Gloo process groups (2 and 4 ranks) and simulated."""

from __future__ import annotations

import pytest
import shardmap_bodies as bodies
from harness import run_on_ranks

_RESULTS: dict[int, dict[int, dict[str, str | None]]] = {}


def _results(world: int) -> dict[int, dict[str, str | None]]:
    if world not in _RESULTS:  # spawn once per world size, run every body there
        _RESULTS[world] = run_on_ranks("shardmap_bodies", bodies.BODIES, world)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", bodies.BODIES)
def test_shardmap_body_on_gloo(world: int, name: str) -> None:
    results = _results(world)
    assert sorted(results) == list(range(world)), f"ranks that reported: {sorted(results)}"
    failures = {r: res.get("<setup>") or res.get(name) for r, res in results.items()}
    failures = {r: tb for r, tb in failures.items() if tb}
    assert not failures, "\n".join(f"--- rank {r}\n{tb}" for r, tb in failures.items())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", bodies.BODIES)
def test_shardmap_body_simulated(world: int, name: str) -> None:
    getattr(bodies, name)(world)
