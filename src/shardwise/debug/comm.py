"""Count the collectives shardwise runs, by kind, phase and source line, with bytes.

Counted where plans execute (every backend alike), so the same test can check
"exactly one all_reduce per step" on the simulated mesh and under torchrun.

Invariants:
- ``counts``/``bytes``/``log``/``total`` are the forward collectives (as before
  backward ones were counted); ``backward_counts``/``backward_bytes`` are the
  gradient's, recorded when autograd reaches them; ``events`` holds both.
- A backward collective is counted when the forward op it is the gradient of ran
  while a counter was active and the backward runs while one is active (open the
  counter around both: ``with CommCounter() as cc: loss = f(x); loss.backward()``).
  On the simulated mesh the replicas share one buffer and torch sums into it, so
  these are the collectives a one-process-per-device runtime runs, counted alike.
- Each event names the user source line that caused it (the first frame outside
  shardwise and torch; a backward event names its forward op's line).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from shardwise.debug.counting import Counting, Listener

__all__ = ["CommCounter", "LineCount"]


class LineCount(NamedTuple):
    """Collectives of one kind and phase caused by one source line."""

    where: str
    phase: str
    kind: str
    n: int
    nbytes: int


class CommCounter(Counting):
    """``with CommCounter() as cc:`` counts collectives (and bytes per device) by kind.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> with CommCounter() as cc:
    ...     y = shardwise.all_gather(x)
    >>> cc.counts, cc.bytes["all_gather"]   # each device receives the other's 2x4 block
    (Counter({'all_gather': 1}), 32)
    >>> [(row.phase, row.kind, row.n) for row in cc.by_line()]
    [('forward', 'all_gather', 1)]
    """

    def __init__(self) -> None:
        super().__init__()  # counts, total: forward; events: forward and backward
        self.bytes: Counter[str] = Counter()
        self.log: list[tuple[str, int, Any]] = []
        self.backward_counts: Counter[str] = Counter()
        self.backward_bytes: Counter[str] = Counter()

    @property
    def backward_total(self) -> int:
        return sum(self.backward_counts.values())

    def _record(self, event: Any) -> None:
        self.events.append(event)
        if event.phase == "backward":
            self.backward_counts[event.kind] += 1
            self.backward_bytes[event.kind] += event.nbytes
            return
        self.counts[event.kind] += 1
        self.bytes[event.kind] += event.nbytes
        self.log.append((event.kind, event.nbytes, event.step))

    def by_line(self, phase: str | None = None) -> list[LineCount]:
        """Counts and bytes per (source line, phase, kind), in order of first
        occurrence; ``phase`` ``"forward"``/``"backward"`` keeps one phase."""
        rows: dict[tuple[str, str, str], list[int]] = {}
        for e in self.events:
            if phase is None or e.phase == phase:
                row = rows.setdefault((e.where, e.phase, e.kind), [0, 0])
                row[0] += 1
                row[1] += e.nbytes
        return [LineCount(*key, n, b) for key, (n, b) in rows.items()]

    def table(self) -> str:
        """A readable table: one row per source line, phase and kind, with the code."""
        from shardwise.planner.steps import fmt_bytes

        rows = self.by_line()
        if not rows:
            return "no collectives"
        code = {e.where: e.code for e in self.events}
        width = max(len(r.where) for r in rows)
        lines = [f"{'line':<{width}}  {'phase':<8} {'collective':<15} {'n':>4} "
                 f"{'bytes/device':>12}  code"]
        for r in rows:
            lines.append(f"{r.where:<{width}}  {r.phase:<8} {r.kind:<15} {r.n:>4} "
                         f"{fmt_bytes(r.nbytes):>12}  {code[r.where][:60]}")
        return "\n".join(lines)

    def _listeners(self) -> tuple[Callable[[Listener], None], Callable[[Listener], None]]:
        # imported here: ``import shardwise.debug`` stays torch-free (the runtime is torch)
        from shardwise.runtime import observe

        return observe.add, observe.remove

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {v} ({self.bytes[k]} B)" for k, v in sorted(self.counts.items()))
        back = ", ".join(f"{k}: {v} ({self.backward_bytes[k]} B)"
                         for k, v in sorted(self.backward_counts.items()))
        return f"CommCounter({parts or 'no collectives'}" + (
            f"; backward {back})" if back else ")")
