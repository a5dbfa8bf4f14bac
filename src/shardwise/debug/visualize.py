"""Draw which device holds which block of a Tensor.

Invariants:
- Pure read: nothing is computed on the tensor's data; only its layout and shape.
- Every device appears in exactly one cell; cells are the distinct blocks.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardwise.sharding.errors import ShardingTypeError
from shardwise.sharding.shapes import local_bounds

if TYPE_CHECKING:
    from shardwise.tensors import Tensor

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


def visualize(t: Tensor, *, console: Console | None = None, color: bool = True) -> str:
    """Print (and return as text) a grid of ``t``'s blocks and the devices holding them.

    1-D tensors draw one row of blocks, 2-D tensors a grid; higher ranks list
    each block's index ranges.

    >>> visualize(shardwise.zeros((4, 4), sharding=PlacementMapping(mesh, [Sharded(0)])))
    ... # doctest: +SKIP
    """
    from shardwise.tensors import Tensor

    if not isinstance(t, Tensor):
        raise ShardingTypeError(f"visualize needs a shardwise.Tensor. Got {type(t).__name__}; "
                                "make one with shardwise.tensor(data, sharding=...).")
    cells = _cells(t)
    title = f"{list(t.shape)} {t.dist_layout}"
    table = Table(title=title, show_header=False, show_lines=True, expand=False)
    if t.ndim in (1, 2):
        rows = sorted({b[0] for b in cells}) if t.ndim == 2 else [(0, 1)]
        cols = sorted({b[-1] for b in cells})
        for _ in cols:
            table.add_column(justify="center", vertical="middle")
        for i, r in enumerate(rows):
            row = []
            for j, c in enumerate(cols):
                key = (r, c) if t.ndim == 2 else (c,)
                devs = cells.get(key)
                if devs is None:  # blocks of different shapes: render gaps plainly
                    row.append(Text("-"))
                    continue
                span = f"[{c[0]}:{c[1]}]" if t.ndim == 1 else f"[{r[0]}:{r[1]}, {c[0]}:{c[1]}]"
                style = _COLORS[(i * len(cols) + j) % len(_COLORS)] if color else ""
                row.append(Text(_label(t, devs) + "\n" + span, style=style))
            table.add_row(*row)
    else:
        table.add_column("block")
        table.add_column("devices")
        for bounds, devs in cells.items():
            span = "[" + ", ".join(f"{a}:{b}" for a, b in bounds) + "]"
            table.add_row(span, _label(t, devs))
    out = Console(record=True, width=120, color_system="truecolor" if color else None,
                  force_terminal=color, file=io.StringIO())
    out.print(table)
    text = out.export_text()
    (console or Console()).print(table)
    return text
