"""Predict a pipeline schedule's step time, bubble and activation memory from its table.

``simulate(sched, forward=1.0, backward=2.0, weight=None, p2p=0.0)`` runs the table on
an idealised machine: each rank runs its actions one at a time in table order; an
action starts when its rank is free and its dependencies (``tables.dependencies``)
are done, ``p2p`` later for a dependency on another rank. Compute actions cost their
stage's time, SEND/RECV/UNSHARD/RESHARD cost nothing (a RECV waits for its SEND plus
``p2p``, so a lowered table predicts the same step as its compute table).

Invariants:
- Accepts every table the runtimes run: generated, lowered (SEND/RECV, UNSHARD/RESHARD;
  torch's dry run rejects UNSHARD), or a user's CSV; it ``validate``s first, so a
  table that would deadlock or misses an action is a clear error, never a hang.
- ``bubble = 1 - busy / (ranks * step_time)``, computed as one division of the idle
  time by the capacity, so equal-cost schedules reproduce the textbook fractions
  exactly (GPipe and 1F1B: ``(p - 1) / (m + p - 1)``).
- ``peak_inflight[r]`` depends on the order alone: the most (stage, microbatch) pairs
  on rank ``r`` whose forward has run and whose backward (B or I) has not.
- Pure: no torch; pictures need no dependency (SVG) or matplotlib (PNG, optional).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from shardwise.pipelining.actions import Action, Kind, Table
from shardwise.pipelining.tables import dependencies, stage_ranks, validate
from shardwise.sharding.errors import ShardingError

__all__ = ["Simulation", "Span", "simulate"]

Cost = float | Sequence[float] | Callable[[Action], float]
"""A cost: one time for every stage, one per stage (indexed by stage), or per action."""

_COLOURS = {Kind.FORWARD: "#4e79a7", Kind.BACKWARD: "#e15759",
            Kind.BACKWARD_INPUT: "#f28e2b", Kind.BACKWARD_WEIGHT: "#59a14f"}
_RICH = {Kind.FORWARD: "white on blue", Kind.BACKWARD: "white on red",
         Kind.BACKWARD_INPUT: "black on yellow", Kind.BACKWARD_WEIGHT: "white on green"}


@dataclass(frozen=True, slots=True)
class Span:
    """One action as simulated: ``rank`` ran ``action`` from ``start`` to ``end``."""

    action: Action
    rank: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """The predicted run of one step (see ``simulate``).

    ``spans[r]`` lists rank ``r``'s actions in run order with their times; ``busy[r]``
    is its compute time; ``peak_inflight[r]`` the most activations it holds at once.
    """

    step_time: float
    bubble: float
    peak_inflight: dict[int, int]
    busy: dict[int, float]
    spans: dict[int, tuple[Span, ...]] = field(repr=False)

    def span(self, action: Action | str) -> Span:
        """The simulated times of one action (``"0F1"`` or an ``Action``)."""
        a = Action.parse(action) if isinstance(action, str) else action
        for row in self.spans.values():
            for s in row:
                if s.action == a:
                    return s
        raise ShardingError(f"Simulation: action {a} is not in the simulated table.")

    def timeline(self, width: int = 72) -> str:
        """The step as text: one row per rank, ``width`` columns for the step time;
        each compute action is a ``[label`` block (clipped to its width), idle is ``.``.

        >>> from shardwise.pipelining import compute_table
        >>> print(simulate(compute_table("1F1B", 2, 2, 2)).timeline(width=27))
        step 9 (bubble 0.333), peak in-flight {0: 2, 1: 1}
        rank 0 |[F0[F1......[0B0  ...[0B1  |
        rank 1 |...[F0[1B0  [F1[1B1  ......|
        """
        if width < 1:
            raise ShardingError(f"timeline(width={width}): width must be >= 1.")
        lines = [f"step {self.step_time:g} (bubble {self.bubble:.3f}), "
                 f"peak in-flight {self.peak_inflight}"]
        for r, cells in self._cells(width).items():
            lines.append(f"rank {r} |" + "".join(c for c, _ in cells) + "|")
        return "\n".join(lines)

    def _cells(self, width: int) -> dict[int, list[tuple[str, Kind | None]]]:
        """Per rank, ``width`` characters with the kind each belongs to (None: idle)."""
        scale = width / self.step_time if self.step_time > 0 else 0.0
        out: dict[int, list[tuple[str, Kind | None]]] = {}
        for r, row in self.spans.items():
            cells: list[tuple[str, Kind | None]] = [(".", None)] * width
            for s in row:
                if not s.action.kind.is_compute or s.end <= s.start:
                    continue
                lo, hi = round(s.start * scale), round(s.end * scale)
                hi = max(hi, lo + 1)   # a short action still shows
                text = _label(s.action, hi - lo)
                for k in range(lo, min(hi, width)):
                    cells[k] = (text[k - lo], s.action.kind)
            out[r] = cells
        return out

    def __rich__(self) -> Any:
        """A coloured rich table (``rich.print(sim)``), when rich is installed."""
        from rich.table import Table as RichTable  # optional: only for rich's printing
        from rich.text import Text

        table = RichTable(title=f"step {self.step_time:g}, bubble {self.bubble:.3f}")
        table.add_column("rank", no_wrap=True, min_width=4)
        table.add_column("timeline", no_wrap=True)
        table.add_column("peak in-flight", justify="right", no_wrap=True, min_width=4)
        for r, cells in self._cells(72).items():
            text = Text()
            for c, kind in cells:
                text.append(c, style=_RICH.get(kind, "dim") if kind else "dim")
            table.add_row(str(r), text, str(self.peak_inflight[r]))
        return table

    def to_svg(self, width: int = 800) -> str:
        """The step as an SVG picture (hand-written, no dependency)."""
        row_h, left, top = 28, 60, 30
        scale = (width - left - 10) / self.step_time if self.step_time > 0 else 0.0
        height = top + row_h * len(self.spans) + 10
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="monospace" font-size="11">',
            f'<text x="{left}" y="18">step {self.step_time:g}, bubble {self.bubble:.3f}, '
            f'peak in-flight {escape(str(self.peak_inflight))}</text>',
        ]
        for i, (r, row) in enumerate(self.spans.items()):
            y = top + i * row_h
            parts.append(f'<text x="4" y="{y + 17}">rank {r}</text>')
            parts.append(f'<rect x="{left}" y="{y}" width="{self.step_time * scale:.2f}" '
                         f'height="{row_h - 4}" fill="#eeeeee"/>')
            for s in row:
                if not s.action.kind.is_compute or s.end <= s.start:
                    continue
                x, w = left + s.start * scale, (s.end - s.start) * scale
                parts.append(
                    f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 4}" '
                    f'fill="{_COLOURS[s.action.kind]}" stroke="white">'
                    f'<title>{s.action} {s.start:g}-{s.end:g}</title></rect>')
                if w >= 7 * len(str(s.action)) + 2:
                    parts.append(f'<text x="{x + 2:.2f}" y="{y + 16}" fill="white">'
                                 f'{s.action}</text>')
        parts.append("</svg>")
        return "\n".join(parts) + "\n"

    def save_svg(self, path: str | Path, width: int = 800) -> None:
        """Write ``to_svg(width)`` to ``path``."""
        Path(path).write_text(self.to_svg(width))

    def save_png(self, path: str | Path, width: float = 10.0) -> None:
        """Write the picture as PNG with matplotlib (``width`` in inches); an
        ImportError naming matplotlib when it is not installed (``save_svg`` needs
        nothing)."""
        try:
            figure_mod: Any = importlib.import_module("matplotlib.figure")
        except ImportError as e:
            raise ImportError(
                "Simulation.save_png needs matplotlib, which is not installed: "
                "`pip install matplotlib`, or write the picture with save_svg(path).") from e
        fig = figure_mod.Figure(figsize=(width, 0.5 * len(self.spans) + 1))
        ax = fig.add_subplot()
        ranks = list(self.spans)
        # points per time unit (the axes take ~80% of the figure): label what fits
        pt = 0.8 * 72 * width / self.step_time if self.step_time > 0 else 0.0
        for i, r in enumerate(ranks):
            for s in self.spans[r]:
                if s.action.kind.is_compute and s.end > s.start:
                    ax.broken_barh([(s.start, s.end - s.start)], (i - 0.4, 0.8),
                                   facecolors=_COLOURS[s.action.kind], edgecolor="white")
                    if (s.end - s.start) * pt >= 4.5 * len(str(s.action)) + 2:
                        ax.text((s.start + s.end) / 2, i, str(s.action), ha="center",
                                va="center", fontsize=7, color="white")
        patches: Any = importlib.import_module("matplotlib.patches")
        kinds = [k for k in _COLOURS if any(s.action.kind is k for row in self.spans.values()
                                            for s in row)]
        ax.legend(handles=[patches.Patch(color=_COLOURS[k], label=k.value) for k in kinds],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(f"step {self.step_time:g}, bubble {self.bubble:.3f}")
        fig.savefig(path, bbox_inches="tight")


def _label(a: Action, n: int) -> str:
    """The longest of ``[0F1``, ``[F1``, ``F1``, ``F`` that fits ``n`` columns, padded."""
    short = f"{a.kind.value}{a.microbatch}"
    for text in (f"[{a}", f"[{short}", short):
        if len(text) <= n:
            return text.ljust(n)
    return a.kind.value * n


def _cost_fn(name: str, cost: Cost, n_stages: int) -> Callable[[Action], float]:
    """A cost argument as a function of the action, checked against the stages."""
    if callable(cost):
        return cost
    if isinstance(cost, (int, float)):
        value = float(cost)
        return lambda a: value
    values = [float(c) for c in cost]
    if len(values) < n_stages:
        raise ShardingError(
            f"simulate: {name} has {len(values)} per-stage costs, but the table has stages "
            f"0..{n_stages - 1}; give one cost per stage, one number, or a callable(action).")
    return lambda a: values[a.stage]


def simulate(sched: Table | Any, forward: Cost = 1.0, backward: Cost = 2.0,
             weight: Cost | None = None, p2p: float = 0.0) -> Simulation:
    """Simulate one step of a schedule.

    Args:
        sched: a Table (``compute_table``, ``lower``, ``read_csv``) or any object with
            an ``.actions`` Table (the runtime's schedules).
        forward, backward: a stage's forward and full-backward time: one number for
            every stage, a sequence indexed by stage, or ``callable(action) -> float``
            (per stage and microbatch).
        weight: the weight-gradient half of a split backward (W); the input half (I)
            costs ``backward - weight``. Default ``backward / 2``.
        p2p: latency added to each dependency that crosses ranks.

    Returns:
        A ``Simulation``: ``step_time``, ``bubble``, ``peak_inflight``, per-action
        ``spans``, ``timeline()``, ``save_svg()``/``save_png()``.

    GPipe on 4 ranks, 4 microbatches: the bubble is (p - 1) / (m + p - 1) = 3/7.

    >>> from shardwise.pipelining import compute_table
    >>> sim = simulate(compute_table("GPipe", 4, 4, 4))
    >>> sim.step_time, sim.bubble == 3 / 7, sim.peak_inflight
    (21.0, True, {0: 4, 1: 4, 2: 4, 3: 4})
    >>> sim.span("3B0")
    Span(action=3B0, rank=3, start=7.0, end=9.0)
    """
    table = getattr(sched, "actions", sched)
    if not isinstance(table, Mapping):
        raise ShardingError(
            f"simulate: expected a pipeline table (rank -> actions) or a schedule with an "
            f".actions table; got {type(sched).__name__}.")
    table = {r: list(row) for r, row in table.items()}
    validate(table)
    where = stage_ranks(table)
    n_stages = max(where, default=-1) + 1
    f_cost = _cost_fn("forward", forward, n_stages)
    b_cost = _cost_fn("backward", backward, n_stages)
    w_cost = (lambda a: b_cost(a) / 2) if weight is None else _cost_fn("weight", weight, n_stages)

    def cost(a: Action) -> float:
        match a.kind:
            case Kind.FORWARD:
                c = f_cost(a)
            case Kind.BACKWARD:
                c = b_cost(a)
            case Kind.BACKWARD_INPUT:
                c = b_cost(a) - w_cost(a)
            case Kind.BACKWARD_WEIGHT:
                c = w_cost(a)
            case _:
                return 0.0
        if not c >= 0:
            raise ShardingError(
                f"simulate: action {a} costs {c}; costs must be >= 0 (for I: backward - "
                "weight, so weight must not exceed backward).")
        return float(c)

    deps = dependencies(table)
    rows = {r: [a for a in table[r] if a is not None] for r in sorted(table)}
    owner = {a: r for r, row in rows.items() for a in row}
    end: dict[Action, float] = {}
    spans: dict[int, list[Span]] = {r: [] for r in rows}
    free = dict.fromkeys(rows, 0.0)
    pos = dict.fromkeys(rows, 0)
    progress = True
    while progress:   # validate() proved every row finishes, so this terminates
        progress = False
        for r, row in rows.items():
            while pos[r] < len(row):
                a = row[pos[r]]
                ds = deps(a)
                if any(d not in end for d in ds):
                    break
                start = max([free[r], *(end[d] + (p2p if owner[d] != r else 0.0) for d in ds)])
                free[r] = end[a] = start + cost(a)
                spans[r].append(Span(a, r, start, end[a]))
                pos[r] += 1
                progress = True
    step = max(free.values(), default=0.0)
    busy = {r: sum(s.end - s.start for s in row if s.action.kind.is_compute)
            for r, row in spans.items()}
    capacity = len(rows) * step
    bubble = (capacity - sum(busy.values())) / capacity if capacity > 0 else 0.0
    return Simulation(step_time=step, bubble=bubble, peak_inflight=_peaks(rows), busy=busy,
                      spans={r: tuple(row) for r, row in spans.items()})


def _peaks(rows: dict[int, list[Action]]) -> dict[int, int]:
    """Per rank, the most forwards whose backward (B or I) has not run yet."""
    out = {}
    for r, row in rows.items():
        held = peak = 0
        for a in row:
            if a.kind is Kind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                held -= 1
        out[r] = peak
    return out
