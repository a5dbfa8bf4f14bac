"""The SPMD environment of a running shard_map body: which device this thread is.

Invariants:
- One :class:`AxisEnv` per thread at most; ``enter`` installs one and returns the
  previous one, which the caller restores (bodies on pooled threads nest cleanly).
- Each runtime provides its own env (simulated: threads meeting at a rendezvous;
  multi-process: torch.distributed groups); ``shardwise.lax`` reads it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from shardwise.sharding.mesh import DeviceMesh

__all__ = ["DEFAULT_TIMEOUT_S", "KIND", "AxisEnv", "current_env", "enter", "sent_bytes"]

DEFAULT_TIMEOUT_S = 60.0
"""How long a simulated shard_map's devices wait for each other at a collective: the
same as ``shardwise.distributed.initialize``'s default (which must not import torch,
so it keeps its own copy; a test checks they agree)."""

KIND = {"psum": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
        "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
        "ppermute": "ppermute", "all_to_all": "all_to_all",
        "ragged_all_to_all": "all_to_all"}
"""The collective each primitive op counts as (for the observers of collectives)."""


class AxisEnv(Protocol):
    """What a runtime provides to the collectives while one device runs ``fn``.

    ``collective`` runs one of the primitive ops "psum", "pmax", "pmin",
    "all_gather" (params ``(axis, even)``), "psum_scatter" (``(dim,)``),
    "ppermute" (``(pairs,)``), "all_to_all" (``(split, concat, even)``),
    "ragged_all_to_all" (``(dim, sizes)``: member i sends ``sizes[i][j]`` to j) over the
    group of mesh ``axes`` (indices, in the order named) holding this device.
    ``even`` says every member holds the same shape. Groups have >= 2 members.
    """

    mesh: DeviceMesh
    index: int
    coord: tuple[int, ...]

    def collective(self, op: str, x: torch.Tensor, axes: tuple[int, ...],
                   params: tuple[Any, ...]) -> torch.Tensor: ...


def sent_bytes(op: str, x: torch.Tensor, params: tuple[Any, ...], pos: int, n: int) -> int:
    """Bytes member ``pos`` of a group of ``n`` sends to the others for one primitive op
    on its block ``x`` (what observers count, as the planner counts its steps): a
    reduction ``2 (n - 1) / n`` blocks (a ring), an all_gather its block to each other
    member, a reduce_scatter or all_to_all ``(n - 1) / n`` of it, a ppermute all of it,
    a ragged_all_to_all its entries for the others.

    >>> sent_bytes("all_to_all", torch.ones(4, 2), (0, 0, True), 0, 4)
    24
    >>> sent_bytes("ragged_all_to_all", torch.ones(3, 2), (0, ((1, 2), (0, 4))), 0, 2)
    16
    """
    block = x.numel() * x.element_size()
    if op == "ragged_all_to_all":
        dim, sizes = params
        row = sizes[pos]
        return block // max(x.shape[dim], 1) * (sum(row) - row[pos])
    if op in ("psum", "pmax", "pmin"):
        return 2 * block * (n - 1) // n
    if op == "all_gather":
        return block * (n - 1)
    if op in ("psum_scatter", "all_to_all"):
        return block * (n - 1) // n
    return block


_STATE = threading.local()


def current_env() -> AxisEnv | None:
    """The axis environment of the shard_map running on this thread, or None."""
    return getattr(_STATE, "env", None)


def enter(env: AxisEnv | None) -> AxisEnv | None:
    """Install ``env`` for this thread; returns the previous one, to restore after."""
    prev = current_env()
    _STATE.env = env
    return prev
