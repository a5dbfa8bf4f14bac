"""What the debug counters share: counts by name, the events in order, and a listener
registered for the ``with`` block.

Invariants:
- ``total`` is the sum of ``counts`` (what each counter counts by name: a
  ``CommCounter``'s forward collectives, a ``FallbackCounter``'s fallback runs).
- The listener is added on enter and removed on exit, errors or not; the module it
  listens to is imported then (``import shardwise.debug`` stays torch-free).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Counting"]

Listener = Callable[[Any], None]
SelfCounting = TypeVar("SelfCounting", bound="Counting")


class Counting:
    """The base of the debug counters: ``counts``, ``events``, ``total`` and the ``with``
    block. A subclass records an event (``_record``) and names where it listens
    (``_listeners``: the add and remove functions of the module that reports)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.events: list[Any] = []

    @property
    def total(self) -> int:
        """Everything ``counts`` holds."""
        return sum(self.counts.values())

    def _record(self, event: Any) -> None:
        raise NotImplementedError

    def _listeners(self) -> tuple[Callable[[Listener], None], Callable[[Listener], None]]:
        raise NotImplementedError

    def __enter__(self: SelfCounting) -> SelfCounting:
        add, _ = self._listeners()
        add(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        _, remove = self._listeners()
        remove(self._record)
