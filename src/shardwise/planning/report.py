"""Reports of estimates: one estimate as text, plans side by side, where the time goes.

Invariants:
- Text only (plain characters), so reports print anywhere and compare in tests.
- Plans side by side read what :class:`~shardwise.planning.search.Candidate` holds
  (peak and its parts, bytes per axis, predicted time and its shares), nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.planner.steps import fmt_bytes

__all__ = ["bar", "describe", "fmt_seconds", "side_by_side"]

_MARKS = (("compute", "#"), ("communication", "~"), ("bubble", "."))


def fmt_seconds(s: float) -> str:
    """A duration with a unit that keeps it readable.

    >>> fmt_seconds(0.0123), fmt_seconds(4.5), fmt_seconds(2.5e-5)
    ('12.3 ms', '4.50 s', '25.0 us')
    """
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def bar(shares: dict[str, float], width: int = 40) -> str:
    """Where a step's time goes as a bar: ``#`` compute, ``~`` exposed communication,
    ``.`` pipeline bubble (``shares``: fractions, as ``Timing.shares()``).

    >>> bar({"compute": 0.5, "communication": 0.25, "bubble": 0.25}, width=8)
    '####~~..'
    """
    cells = [(mark, shares.get(name, 0.0) * width) for name, mark in _MARKS]
    counts = [int(w) for _, w in cells]
    # hand the cells rounding dropped to the largest remainders, so the bar is full
    order = sorted(range(len(cells)), key=lambda i: cells[i][1] - counts[i], reverse=True)
    for i in order[:max(0, width - sum(counts))]:
        counts[i] += 1
    return "".join(mark * n for (mark, _), n in zip(cells, counts))


def describe(est: Any) -> str:
    """One estimate: memory on the most loaded device, collectives, predicted time."""
    m, t = est.memory, est.timing
    lines = [f"memory on {m.device}: peak {fmt_bytes(m.peak)} (params {fmt_bytes(m.params)}, "
             f"grads {fmt_bytes(m.grads)}, optimizer {fmt_bytes(m.optimizer)}, activations "
             f"{fmt_bytes(m.activations)})"]
    for (axes, phase, kind), row in sorted(est.comm.items()):
        lines.append(f"  {phase:<9} {kind:<15} over {axes:<8} x{row.n:<4} "
                     f"{fmt_bytes(row.nbytes)}/device")
    lines.append(f"time on {est.profile.name}: {t.step * 1e3:.3f} ms/step (compute "
                 f"{t.compute * 1e3:.3f}, exposed communication {t.exposed * 1e3:.3f}, "
                 f"bubble {t.bubble * 1e3:.3f})")
    return "\n".join(lines)


def side_by_side(candidates: Sequence[Any], width: int = 40) -> str:
    """Plans side by side (``auto_plan``'s candidates): memory per device and its
    parts, bytes each device sends per step per mesh axis, predicted step time; then
    where each plan's time goes (:func:`bar`) and the plans themselves."""
    if not candidates:
        return "(no plan fits)"
    cols = [f"#{i + 1}" for i in range(len(candidates))]
    rows: list[tuple[str, list[str]]] = [
        ("step time", [fmt_seconds(c.time_s) for c in candidates]),
        ("memory/device", [fmt_bytes(c.peak) for c in candidates])]
    for part in ("params", "grads", "optimizer", "activations"):
        rows.append((f"  {part}", [fmt_bytes(c.memory.get(part, 0)) for c in candidates]))
    axes = sorted({a for c in candidates for a in c.comm})
    for a in axes:
        rows.append((f"sent/step over {a}", [fmt_bytes(c.comm.get(a, 0)) for c in candidates]))
    label = max(len(r[0]) for r in rows)
    cell = max(12, *(len(v) for _, vals in rows for v in vals))
    lines = [" " * label + "".join(f"{c:>{cell + 2}}" for c in cols)]
    lines += [f"{name:<{label}}" + "".join(f"{v:>{cell + 2}}" for v in vals)
              for name, vals in rows]
    lines.append("where the time goes (# compute, ~ communication, . pipeline bubble):")
    lines += [f"  {col:<3} |{bar(c.shares, width)}|" for col, c in zip(cols, candidates)]
    lines.append("plans:")
    lines += [f"  {col:<3} {c.plan}" for col, c in zip(cols, candidates)]
    return "\n".join(lines)
