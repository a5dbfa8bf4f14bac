"""The program position in the collective agreement, on Gloo processes (issue 24,
item 5): a divergent program stops at its first divergent collective, on every rank,
before any data moves; the same program agrees forward and backward."""

from __future__ import annotations

from tests.helpers import position_faults
from tests.helpers.harness import run_on_ranks


def _passed(name: str, world: int) -> None:
    results = run_on_ranks(position_faults.__name__, [name], world, limit_s=60,
                           timeout_s=position_faults.TIMEOUT_S)
    for r in range(world):
        assert r in results, f"rank {r} did not report: {results}"
        assert results[r].get("<setup>") is None, results[r]
        assert results[r][name] is None, f"rank {r}:\n{results[r][name]}"


def test_a_mispaired_style_stops_at_its_first_tp_collective() -> None:
    _passed("body_mispaired_styles", 3)


def test_a_mispaired_style_stops_where_it_creates_the_tp_group() -> None:
    _passed("body_mispaired_styles_cold", 3)


def test_the_same_program_agrees_forward_and_backward() -> None:
    _passed("body_same_program_agrees", 2)
