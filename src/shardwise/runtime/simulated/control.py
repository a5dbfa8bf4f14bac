"""The simulated backend's world services (the protocol's world block): a world of
this one process, where a barrier has no one to wait for and a gather over the world
is this process's value alone.

Invariants:
- :func:`process_index` is 0 and :func:`process_count` 1, as ``shardwise.distributed``
  reports without ``initialize()``.
- The first failure recorded stays until :func:`end_world` (or :func:`begin_world`).
"""

from __future__ import annotations

import torch

__all__ = ["barrier", "begin_world", "end_world", "first_failure", "gather_world",
           "process_count", "process_index", "record_failure"]

_FIRST: list[str] = []   # the run's first failure, once recorded


def begin_world(*, timeout_s: float, check_collectives: bool | None = None) -> None:
    """Start afresh: nothing to bound (no process waits for another), nothing to check
    (no collective leaves this process).

    >>> begin_world(timeout_s=60.0); first_failure()
    ''
    """
    end_world()


def end_world() -> None:
    """Forget the world's first failure.

    >>> _ = record_failure("a save failed")
    >>> end_world(); first_failure()
    ''
    """
    _FIRST.clear()


def process_index() -> int:
    """0: this process is the world.

    >>> process_index()
    0
    """
    return 0


def process_count() -> int:
    """1: this process is the world.

    >>> process_count()
    1
    """
    return 1


def barrier(label: str) -> None:
    """Nothing to wait for: every process of the world is here.

    >>> barrier("after the save")
    """


def gather_world(x: torch.Tensor, label: str) -> torch.Tensor:
    """``x`` alone, stacked: shape ``(1, *x.shape)`` (it is the only rank's).

    >>> gather_world(torch.tensor([3, 4]), "hashes").tolist()
    [[3, 4]]
    """
    return x.unsqueeze(0)


def record_failure(text: str) -> str:
    """Record ``text`` as the first failure unless one is recorded; returns the first.

    >>> end_world(); record_failure("one"), record_failure("two")
    ('one', 'one')
    """
    if not _FIRST:
        _FIRST.append(text[:400])
    return _FIRST[0]


def first_failure() -> str:
    """The first failure recorded ("" when none).

    >>> end_world(); first_failure()
    ''
    """
    return _FIRST[0] if _FIRST else ""
