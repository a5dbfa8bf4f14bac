"""Observers of the collectives shardwise runs: debug tools register here.

Invariants:
- The core and the runtimes call :func:`record` for every collective they run
  (kind, bytes per device, the plan step or None); observers never change what runs.
- Observers are registered by the debug floor (``CommCounter``), which the core
  never imports: the dependency points from the observer down to this module.
- With no observer registered, :func:`active` is False and recording costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Observer", "active", "add", "record", "remove"]

Observer = Callable[[str, int, Any], None]
"""Called as ``observer(kind, bytes_per_device, step_or_None)``."""

_OBSERVERS: list[Observer] = []


def add(observer: Observer) -> None:
    """Start calling ``observer`` for every collective.

    >>> seen = []
    >>> def watch(kind, nbytes, step):
    ...     seen.append((kind, nbytes))
    >>> add(watch); record("all_gather", 32); remove(watch); record("all_gather", 32)
    >>> seen
    [('all_gather', 32)]
    """
    _OBSERVERS.append(observer)


def remove(observer: Observer) -> None:
    """Stop calling ``observer`` (the last registration of it)."""
    for i in range(len(_OBSERVERS) - 1, -1, -1):
        if _OBSERVERS[i] == observer:  # == : a bound method is a new object per access
            del _OBSERVERS[i]
            return


def active() -> bool:
    return bool(_OBSERVERS)


def record(kind: Any, nbytes: int, step: Any = None) -> None:
    """Tell every observer about one collective (``kind`` counts under its plain name)."""
    if not _OBSERVERS:
        return
    name = str(kind)
    for observer in list(_OBSERVERS):
        observer(name, nbytes, step)
