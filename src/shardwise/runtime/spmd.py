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

__all__ = ["KIND", "AxisEnv", "current_env", "enter"]

KIND = {"psum": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
        "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
        "ppermute": "ppermute", "all_to_all": "all_to_all"}
"""The collective each primitive op counts as (for the observers of collectives)."""


class AxisEnv(Protocol):
    """What a runtime provides to the collectives while one device runs ``fn``.

    ``collective`` runs one of the primitive ops "psum", "pmax", "pmin",
    "all_gather" (params ``(axis, even)``), "psum_scatter" (``(dim,)``),
    "ppermute" (``(pairs,)``), "all_to_all" (``(split, concat, even)``) over the
    group of mesh ``axes`` (indices, in the order named) holding this device.
    ``even`` says every member holds the same shape. Groups have >= 2 members.
    """

    mesh: DeviceMesh
    index: int
    coord: tuple[int, ...]

    def collective(self, op: str, x: torch.Tensor, axes: tuple[int, ...],
                   params: tuple[Any, ...]) -> torch.Tensor: ...


_STATE = threading.local()


def current_env() -> AxisEnv | None:
    """The axis environment of the shard_map running on this thread, or None."""
    return getattr(_STATE, "env", None)


def enter(env: AxisEnv | None) -> AxisEnv | None:
    """Install ``env`` for this thread; returns the previous one, to restore after."""
    prev = current_env()
    _STATE.env = env
    return prev
