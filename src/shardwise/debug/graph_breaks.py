"""List torch.compile's graph breaks in shardwise programs, by cause.

Invariants:
- Inside ``with GraphBreakCounter() as gb:`` every graph break of a shardwise program
  that Dynamo meets while compiling is recorded (:mod:`shardwise.ops.graph_breaks`),
  strict mode or not; a frame compiled before the block (cached) breaks no more.
- ``import shardwise.debug`` stays torch-free: the op floor is imported on enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.debug.counting import Counting, Listener

__all__ = ["GraphBreakCounter"]


class GraphBreakCounter(Counting):
    """``with GraphBreakCounter() as gb:`` counts the graph breaks of compiled shardwise
    programs by cause (the first line of Dynamo's reason); ``gb.events`` holds each
    :class:`~shardwise.ops.graph_breaks.GraphBreak` (reason in full, compile id, whether
    in shardwise's code).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> f = torch.compile(torch.nn.Softplus(), backend=shardwise.compile_backend("aot_eager"),
    ...                   dynamic=False)
    >>> with GraphBreakCounter() as gb, torch.no_grad():
    ...     y = f(x)   # one graph: no break
    >>> gb.total, gb
    (0, GraphBreakCounter(no graph breaks))
    """

    def _record(self, event: Any) -> None:  # a shardwise.ops.graph_breaks.GraphBreak
        self.events.append(event)
        self.counts[event.cause] += 1

    def _listeners(self) -> tuple[Callable[[Listener], None], Callable[[Listener], None]]:
        from shardwise.ops import graph_breaks

        return graph_breaks.add_listener, graph_breaks.remove_listener

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"GraphBreakCounter({parts or 'no graph breaks'})"
