"""A pipeline schedule's actions, in torch.distributed.pipelining's notation.

An action is ``<stage><kind><microbatch>``: ``0F1`` runs stage 0's forward on
microbatch 1, ``1B0`` stage 1's full backward on microbatch 0, ``2I3``/``2W3`` the
input-gradient and weight-gradient halves of a split backward (zero-bubble),
``3SEND_F1`` sends stage 3's forward output of microbatch 1 on, ``0UNSHARD`` gathers
stage 0's FSDP parameters (no microbatch). A schedule is a table: one list of actions
per pipeline rank, each run in order; ``None`` is an idle slot.

Invariants:
- ``str(Action.parse(s)) == s`` for every action string (the round trip CSV relies on).
- Pure: no torch, no runtime; the simulator and both runtimes read the same table.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import NamedTuple

from shardwise.sharding.errors import ShardingError

__all__ = ["Action", "Kind", "Table", "format_table", "parse_table", "read_csv", "write_csv"]


class Kind(str, Enum):
    """What an action does (torch's ``_ComputationType`` values)."""

    FORWARD = "F"
    BACKWARD = "B"          # full backward: input and weight gradients
    BACKWARD_INPUT = "I"    # zero-bubble: the input gradient only
    BACKWARD_WEIGHT = "W"   # zero-bubble: the weight gradient, later
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self in _COMM


_COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
_COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# Longest names first, so "SEND_F" is not read as "S" + ...; F/B/I/W last.
_ACTION = re.compile(r"^(\d+)(UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)$")


class Action(NamedTuple):
    """One step of a schedule: ``stage`` (global stage index), ``kind``,
    ``microbatch`` (None for UNSHARD/RESHARD).

    >>> a = Action.parse("1B0")
    >>> a.stage, a.kind.name, a.microbatch, str(a)
    (1, 'BACKWARD', 0, '1B0')
    """

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"0F1"`` -> ``Action(0, Kind.FORWARD, 1)``; a clear error on anything else."""
        m = _ACTION.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ShardingError(
                f"Cannot read pipeline action {text!r}: write <stage><kind><microbatch>, e.g. "
                "'0F1', '1B0', '2I3', '2W3', '3SEND_F1', '0RECV_B2', or '0UNSHARD' / "
                "'0RESHARD' (no microbatch).")
        stage, kind_s, mb = m.groups()
        kind = Kind(kind_s)
        if kind in (Kind.UNSHARD, Kind.RESHARD):
            if mb:
                raise ShardingError(
                    f"Pipeline action {text!r}: {kind.value} takes no microbatch; write "
                    f"'{stage}{kind.value}'.")
            return cls(int(stage), kind, None)
        if not mb:
            raise ShardingError(
                f"Pipeline action {text!r}: {kind.value} needs a microbatch index, e.g. "
                f"'{stage}{kind.value}0'.")
        return cls(int(stage), kind, int(mb))


Table = dict[int, list[Action | None]]
"""A schedule: pipeline rank -> its actions in order (None: an idle slot)."""


def parse_table(rows: Iterable[Sequence[str]]) -> Table:
    """Rows of action strings (row ``r`` is rank ``r``; ``""`` is idle) -> a Table.

    >>> parse_table([["0F0", "0F1", "", "0B0"], ["1F0", "1B0"]])[0]
    [0F0, 0F1, None, 0B0]
    """
    table: Table = {}
    for r, row in enumerate(rows):
        table[r] = [Action.parse(c) if c.strip() else None for c in row]
    return table


def format_table(table: Table) -> list[list[str]]:
    """A Table -> rows of strings (``""`` for idle slots), as ``parse_table`` reads."""
    return [["" if a is None else str(a) for a in table[r]] for r in sorted(table)]


def write_csv(table: Table) -> str:
    """The table as CSV text: one row per rank, as torch's ``_dump_csv`` writes.

    >>> t = parse_table([["0F0", "0B0"], ["1F0", "1B0"]])
    >>> parse_table(csv.reader(io.StringIO(write_csv(t)))) == t
    True
    """
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(format_table(table))
    return out.getvalue()


def read_csv(text_or_path: str) -> Table:
    """A Table from CSV text, or from a file path (a string without a newline or comma)."""
    text = text_or_path
    if "\n" not in text and "," not in text:
        with open(text, newline="") as f:
            text = f.read()
    return parse_table(list(csv.reader(io.StringIO(text))))
