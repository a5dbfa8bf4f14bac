"""Count the ops that ran through the gathered fallback (no sharding rule), by op.

Invariants:
- Inside ``with FallbackCounter() as fc:`` every fallback run is counted, warned
  about or not (the warning is once per op per process; the counter sees each run).
- ``import shardwise.debug`` stays torch-free: the op floor is imported on enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.debug.counting import Counting, Listener

__all__ = ["FallbackCounter"]


class FallbackCounter(Counting):
    """``with FallbackCounter() as fc:`` counts fallback runs by op name, with the
    bytes each device received to gather their operands and the user lines.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> with FallbackCounter() as fc:
    ...     y = torch.nonzero(x) + 1   # nonzero has no rule (its size is the data's)
    >>> fc.total, fc.nbytes, fc.counts
    (1, 16, Counter({'torch.nonzero': 1}))
    >>> fc.events[0].where.endswith(">:2")   # the doctest's line
    True
    """

    @property
    def nbytes(self) -> int:
        """Bytes each device received for the fallbacks' gathers, all runs."""
        return sum(e.nbytes for e in self.events)

    def _record(self, event: Any) -> None:  # a shardwise.ops.fallbacks.Fallback
        self.events.append(event)
        self.counts[event.op] += 1

    def _listeners(self) -> tuple[Callable[[Listener], None], Callable[[Listener], None]]:
        from shardwise.ops import fallbacks

        return fallbacks.add_listener, fallbacks.remove_listener

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"FallbackCounter({parts or 'no fallbacks'})"
