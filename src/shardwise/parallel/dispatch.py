"""Token routing for expert parallelism: which rows go to which device, and back.

The tokens are ``N`` rows in ``G`` groups of ``R = N / G`` consecutive rows, each group
sorted by expert: ``counts[g][e]`` rows of expert ``e`` (``G = 1``: torchtitan's
``num_tokens_per_expert [E]``). Device ``i`` of the ``ep`` axis holds block ``i`` of
the rows (the split rule over ``N``) and experts ``[i * El, (i + 1) * El)``,
``El = E / ep``.

Invariants:
- Dropless (:func:`dropless_route`): every row travels to its expert's device and back.
  The exchange's sizes are host ints read from the counts (the variable-split
  all_to_all allocates by them), and every device computes the whole matrix from the
  same counts, so no sizes are exchanged.
- Capacity (:func:`capacity_slots`): each (group, expert) keeps its first ``C`` rows in
  fixed slots; the exchange's sizes follow from shapes alone, so the counts are never
  read on the host. A row past its expert's ``C`` is dropped (its output is 0), as
  GShard drops it.
- Rows keep their order within each expert, so the experts see them as a single
  device would.
- Pure index arithmetic on torch tensors; nothing here communicates.

Dropless on ``ep = 2``, one group of 6 rows, 4 experts with counts ``[1, 2, 2, 1]``
(rows ``a b b c c d``; experts 0-1 on device 0, 2-3 on device 1)::

    device  holds    sends to 0   sends to 1   receives (expert-major)
    0       a b b    a b b        -            a b b
    1       c c d    -            c c d        c c d
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.shapes import split_bounds

__all__ = ["Route", "capacity_of", "capacity_slots", "dropless_route", "host_counts"]


@dataclass(frozen=True)
class Route:
    """One device's dropless exchange: ``sizes[i][j]`` rows from device i to j; ``send``
    its rows in sending order and ``arrange`` the received rows in expert-major order
    (None: already in that order); ``counts`` rows per local expert after ``arrange``."""

    sizes: tuple[tuple[int, ...], ...]
    send: torch.Tensor | None
    arrange: torch.Tensor | None
    counts: tuple[int, ...]


def host_counts(counts: torch.Tensor, rows: int, experts: int) -> list[list[int]]:
    """``counts`` (``[E]`` or ``[G, E]``, integer or integral float) as host ints per
    group, checked: non-negative, each group summing to its ``rows / G`` rows.

    >>> host_counts(torch.tensor([[1., 2.], [3., 0.]]), 6, 2)
    [[1, 2], [3, 0]]
    >>> host_counts(torch.tensor([1, 2]), 4, 2)
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: ExpertParallel: num_tokens_per_expert ...
    """
    table = counts.reshape(-1, experts).tolist()  # the one host read of the dropless path
    per_group = rows // len(table)
    out = [[int(v) for v in row] for row in table]
    for g, (row, ints) in enumerate(zip(table, out)):
        if any(v < 0 or v != i for v, i in zip(row, ints)) or sum(ints) != per_group:
            where = f"group {g} " if len(out) > 1 else ""
            raise ShardingError(
                f"ExpertParallel: num_tokens_per_expert {where}is {row}, which does not "
                f"count the {per_group} rows of the tokens{' in its group' if where else ''}"
                f" ({rows} rows, {len(out)} group(s)). The counts are non-negative ints "
                "summing to the rows, and the rows are sorted by expert: count them from "
                "the expert ids the rows were sorted by.")
    return out


def dropless_route(counts: list[list[int]], rows: int, ep: int, me: int) -> Route:
    """Device ``me``'s exchange for ``rows`` tokens routed by ``counts`` (host ints per
    group, each summing to ``rows / G``) over ``ep`` devices.

    >>> r = dropless_route([[1, 2, 2, 1]], 6, 2, 0)
    >>> r.sizes, r.send, r.arrange, r.counts
    (((3, 0), (0, 3)), None, None, (1, 2))
    >>> r = dropless_route([[1, 1, 1, 0], [1, 1, 0, 1]], 6, 2, 0)   # two groups of 3
    >>> r.sizes, r.send, r.arrange.tolist(), r.counts     # experts 0 1 0 1 arrive
    (((2, 1), (2, 1)), None, [0, 2, 1, 3], (2, 2))
    """
    experts = len(counts[0])
    local = experts // ep
    per_group = rows // len(counts)
    bounds = [split_bounds(rows, ep, i) for i in range(ep)]
    starts = [lo for lo, _ in bounds]
    sizes = [[0] * ep for _ in range(ep)]
    sent: list[list[tuple[int, int]]] = [[] for _ in range(ep)]  # (local row, length)
    came: list[tuple[int, int]] = []  # (local expert, length), in arrival order
    for g, row in enumerate(counts):
        start = g * per_group
        for e, n in enumerate(row):
            owner = e // local
            end = start + n
            i = max(bisect.bisect_right(starts, start) - 1, 0)
            while n and i < ep and bounds[i][0] < end:
                lo, hi = max(start, bounds[i][0]), min(end, bounds[i][1])
                if hi > lo:
                    sizes[i][owner] += hi - lo
                    if i == me:
                        sent[owner].append((lo - bounds[me][0], hi - lo))
                    if owner == me:
                        came.append((e - me * local, hi - lo))
                i += 1
            start = end
    send = _ranges([p for pieces in sent for p in pieces])
    offsets, at = [], 0
    for _, n in came:
        offsets.append(at)
        at += n
    by_expert = sorted(range(len(came)), key=lambda k: came[k][0])  # stable: arrival order
    arrange = _ranges([(offsets[k], came[k][1]) for k in by_expert])
    per_expert = [0] * local
    for el, n in came:
        per_expert[el] += n
    return Route(tuple(map(tuple, sizes)), send, arrange, tuple(per_expert))


def _ranges(pieces: list[tuple[int, int]]) -> torch.Tensor | None:
    """The concatenation of ``range(start, start + n)`` for each piece, or None when it
    is ``0, 1, 2, ...`` (no reordering needed)."""
    at = 0
    for start, n in pieces:
        if start != at:
            break
        at += n
    else:
        return None
    # one arange per piece, not repeat_interleave: its parallel kernel stalls on a loaded
    # host (DESIGN's decisions log)
    return torch.cat([torch.arange(start, start + n) for start, n in pieces])


def capacity_of(capacity_factor: float, rows_per_group: int, experts: int) -> int:
    """Slots per (group, expert): ``ceil(capacity_factor * rows_per_group / experts)``,
    at least 1 (GShard's expert capacity, the rows already counting each top-k choice).

    >>> capacity_of(1.0, 16, 4), capacity_of(1.25, 16, 4), capacity_of(0.01, 16, 4)
    (4, 5, 1)
    """
    # rounded first, so that 1.1 * 10 / 1 is 11 slots, not 12
    return max(1, math.ceil(round(capacity_factor * rows_per_group / experts, 9)))


def capacity_slots(counts: torch.Tensor, rows_per_group: int, capacity: int) -> torch.Tensor:
    """The slot of each row of ``counts.shape[0]`` consecutive groups (``counts``:
    ``[groups, E]`` on the rows' device) in a buffer of ``groups * E * capacity`` slots,
    group-major then expert then position; a dropped row (past its expert's capacity,
    or past the rows the counts cover) gets the extra slot ``groups * E * capacity``.
    Device arithmetic on static shapes: the counts are never read on the host.

    >>> capacity_slots(torch.tensor([[3, 1]]), 4, 2).tolist()   # expert 0's 3rd row: dropped
    [0, 1, 4, 2]
    """
    groups, experts = counts.shape
    cum = torch.cumsum(counts.to(torch.int64), 1)
    pos = torch.arange(rows_per_group, device=counts.device).expand(groups, -1).contiguous()
    expert = torch.searchsorted(cum, pos, right=True)
    inside = expert < experts
    expert = expert.clamp(max=experts - 1)
    first = (cum - counts.to(torch.int64)).gather(1, expert)
    rank = pos - first
    group = torch.arange(groups, device=counts.device).unsqueeze(1)
    slot = (group * experts + expert) * capacity + rank
    dump = groups * experts * capacity
    return torch.where(inside & (rank < capacity), slot, dump).reshape(-1)
