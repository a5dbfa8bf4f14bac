"""Count the collectives shardwise runs, by kind, with the bytes each moves.

Counted where plans execute (every backend alike), so the same test can check
"exactly one all_reduce per step" on the simulated mesh and under torchrun.
Backward-pass collectives are not counted: they mirror the forward ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from shardwise.planner import Step

__all__ = ["CommCounter"]

_ACTIVE: list[CommCounter] = []


def record(kind: str, nbytes: int, step: Step | None = None) -> None:
    """Called by the runtime for every collective it runs."""
    if not _ACTIVE:
        return
    kind = str(kind)  # a StepKind counts under its plain name, like lax's "psum"
    for counter in _ACTIVE:
        counter.counts[kind] += 1
        counter.bytes[kind] += nbytes
        counter.log.append((kind, nbytes, step))


def active() -> bool:
    return bool(_ACTIVE)


class CommCounter:
    """``with CommCounter() as cc:`` counts collectives (and bytes per device) by kind.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> with CommCounter() as cc:
    ...     y = shardwise.all_gather(x)
    >>> cc.counts, cc.bytes["all_gather"]   # each device receives the other's 2x4 block
    (Counter({'all_gather': 1}), 32)
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.log: list[tuple[str, int, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {v} ({self.bytes[k]} B)" for k, v in sorted(self.counts.items()))
        return f"CommCounter({parts or 'no collectives'})"
