"""Draw which device holds which block of a Tensor.

Invariants:
- Pure read: nothing is computed on the tensor's data; only its layout and shape.
- Every device appears in exactly one cell; cells are the distinct blocks.
- rich (the ``viz`` extra) is imported only when drawing; without it the same grid
  is drawn in plain ASCII, so importing this module never needs it.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from shardwise.sharding.errors import ShardingTypeError
from shardwise.sharding.shapes import local_bounds

if TYPE_CHECKING:
    from rich.console import Console

    from shardwise.tensors.tensor import Tensor

__all__ = ["visualize"]

_COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]


def _cells(t: Tensor) -> dict[tuple[tuple[int, int], ...], list[int]]:
    mesh, layout = t.mesh, t.dist_layout
    cells: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for k in range(mesh.num_devices):
        cells.setdefault(local_bounds(t.shape, layout, mesh.coord_of(k)), []).append(k)
    return cells


def _label(t: Tensor, devices: list[int]) -> str:
    mesh = t.mesh
    names = ", ".join(str(getattr(mesh.devices[k], "id", k)) for k in devices)
    kind = getattr(mesh.devices[devices[0]], "kind", "dev")
    text = f"{kind.upper()} {names}"
    partial = [f"{mesh.axis_names[a]}:{op.value}"
               for a, op in enumerate(t.dist_layout.partial) if op]
    if partial:
        text += "\npartial " + ",".join(partial)
    return text


def _grid(t: Tensor) -> tuple[list[str] | None, list[list[tuple[str, int]]]]:
    """Column headers (None: a grid without headers) and rows of (text, colour index)."""
    cells = _cells(t)
    rows_out: list[list[tuple[str, int]]] = []
    if t.ndim in (1, 2):
        rows = sorted({b[0] for b in cells}) if t.ndim == 2 else [(0, 1)]
        cols = sorted({b[-1] for b in cells})
        for i, r in enumerate(rows):
            row: list[tuple[str, int]] = []
            for j, c in enumerate(cols):
                devs = cells.get((r, c) if t.ndim == 2 else (c,))
                if devs is None:  # blocks of different shapes: render gaps plainly
                    row.append(("-", -1))
                    continue
                span = f"[{c[0]}:{c[1]}]" if t.ndim == 1 else f"[{r[0]}:{r[1]}, {c[0]}:{c[1]}]"
                row.append((_label(t, devs) + "\n" + span, i * len(cols) + j))
            rows_out.append(row)
        return None, rows_out
    for bounds, devs in cells.items():
        span = "[" + ", ".join(f"{a}:{b}" for a, b in bounds) + "]"
        rows_out.append([(span, -1), (_label(t, devs), -1)])
    return ["block", "devices"], rows_out


def _plain(title: str, headers: list[str] | None, rows: list[list[tuple[str, int]]]) -> str:
    # The same grid as rich draws, in ASCII, for installs without the viz extra.
    body = [[text.split("\n") for text, _ in row] for row in rows]
    if headers is not None:
        body.insert(0, [[h] for h in headers])
    ncols = max(len(row) for row in body)
    widths = [max(len(line) for row in body if j < len(row) for line in row[j])
              for j in range(ncols)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [title, rule]
    for row in body:
        for k in range(max(len(cell) for cell in row)):
            out.append("|" + "|".join(
                f" {(cell[k] if k < len(cell) else ''):^{w}} " for cell, w in zip(row, widths))
                + "|")
        out.append(rule)
    return "\n".join(out)


def visualize(t: Tensor, *, console: Console | None = None, color: bool = True) -> str:
    """Print (and return as text) a grid of ``t``'s blocks and the devices holding them.

    1-D tensors draw one row of blocks, 2-D tensors a grid; higher ranks list
    each block's index ranges. With rich installed (``pip install shardwise[viz]``)
    the grid is a coloured table printed on ``console``; without it, plain ASCII.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> text = visualize(shardwise.zeros((4,), sharding=PlacementMapping(mesh, [Sharded(0)])),
    ...                  color=False)
    [4]...CPU 0...CPU 1...[0:2]...[2:4]...
    """
    from shardwise.tensors.tensor import Tensor

    if not isinstance(t, Tensor):
        raise ShardingTypeError(f"visualize needs a shardwise.Tensor. Got {type(t).__name__}; "
                                "make one with shardwise.tensor(data, sharding=...).")
    headers, rows = _grid(t)
    title = f"{list(t.shape)} {t.dist_layout}"
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # the viz extra is not installed
        text = _plain(title, headers, rows)
        print(text)
        return text
    table = Table(title=title, show_header=headers is not None, show_lines=True, expand=False)
    if headers is None:
        for _ in rows[0]:
            table.add_column(justify="center", vertical="middle")
    else:
        for h in headers:
            table.add_column(h)
    for row in rows:
        table.add_row(*(Text(text, style=_COLORS[k % len(_COLORS)] if color and k >= 0 else "")
                        for text, k in row))
    out = Console(record=True, width=120, color_system="truecolor" if color else None,
                  force_terminal=color, file=io.StringIO())
    out.print(table)
    text = out.export_text()
    (console or Console()).print(table)
    return text
