"""Reports of estimates: one estimate as text, plans side by side, where the time goes.

Invariants:
- Text only (plain characters), so reports print anywhere and compare in tests.
"""

from __future__ import annotations

from typing import Any

from shardwise.planner.steps import fmt_bytes

__all__ = ["describe"]


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
