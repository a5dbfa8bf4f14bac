"""Count the collectives shardwise runs, by kind, with the bytes each moves.

Counted where plans execute (every backend alike), so the same test can check
"exactly one all_reduce per step" on the simulated mesh and under torchrun.
Backward-pass collectives are not counted: they mirror the forward ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["CommCounter"]


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

    def _record(self, kind: str, nbytes: int, step: Any) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes
        self.log.append((kind, nbytes, step))

    def __enter__(self) -> CommCounter:
        # imported here: ``import shardwise.debug`` stays torch-free (the runtime is torch)
        from shardwise.runtime import observe

        observe.add(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        from shardwise.runtime import observe

        observe.remove(self._record)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {v} ({self.bytes[k]} B)" for k, v in sorted(self.counts.items()))
        return f"CommCounter({parts or 'no collectives'})"
