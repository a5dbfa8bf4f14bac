"""Observers of the collectives shardwise runs: debug tools register here.

Invariants:
- The core and the runtimes call :func:`record` for every collective they run
  (kind, bytes per device, the plan step or None); observers never change what runs.
- Every :class:`Event` names its phase (``"forward"``, or ``"backward"`` for the
  gradient's collectives, recorded when autograd reaches them, and for any collective
  that runs while autograd's engine runs a backward) and the user source line that
  caused it: the first stack frame outside shardwise and torch (for a backward event
  announced at forward time, the line of the forward op it is the gradient of).
- Inside :func:`counted_as`, events count under that kind (the gathered fallback's
  collectives are ``"fallback_gather"``); their step still names the collective.
- Backward events are announced at forward time (:func:`on_backward`) only while
  an observer is registered: nothing is hooked, and recording costs nothing, when
  no one observes.
- Observers are registered by the debug floor (``CommCounter``), which the core
  never imports: the dependency points from the observer down to this module.
- Holders (``MemoryTracker``) hear of the buffers the simulated runtime leaves out
  (:func:`hold`): a layout change of a value held whole is metadata here, where a
  runtime of one process per device allocates the moved blocks; nothing is called,
  and nothing extra is made, while no holder is registered.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Event", "Holder", "Observer", "active", "add", "add_holder", "counted_as", "hold",
           "holding", "in_library", "on_backward", "record", "remove", "remove_holder",
           "remove_last", "source_line"]


@dataclass(frozen=True, slots=True)
class Event:
    """One collective: its kind (``"all_reduce"``...), bytes each device sends, the
    plan step (or None), ``"forward"``/``"backward"``, and the user line (``file:line``)."""

    kind: str
    nbytes: int
    step: Any = None
    phase: str = "forward"
    where: str = "?"

    @property
    def code(self) -> str:
        """The text of the source line :attr:`where` names ('' when unknown)."""
        path, _, line = self.where.rpartition(":")
        return linecache.getline(path, int(line)).strip() if line.isdigit() else ""


Observer = Callable[[Event], None]
"""Called as ``observer(event)`` for every collective."""

_OBSERVERS: list[Observer] = []
_KINDS: list[str] = []  # the innermost counted_as kind, if any


def add(observer: Observer) -> None:
    """Start calling ``observer`` for every collective.

    >>> seen = []
    >>> def watch(event):
    ...     seen.append((event.kind, event.nbytes, event.phase))
    >>> add(watch); record("all_gather", 32); remove(watch); record("all_gather", 32)
    >>> seen
    [('all_gather', 32, 'forward')]
    """
    _OBSERVERS.append(observer)


def remove(observer: Observer) -> None:
    """Stop calling ``observer`` (the last registration of it)."""
    remove_last(_OBSERVERS, observer)


def active() -> bool:
    return bool(_OBSERVERS)


Holder = Callable[[torch.Tensor, Any, tuple[int, ...]], None]
"""Called as ``holder(buffer, layout, shape)`` by :func:`hold`."""

_HOLDERS: list[Holder] = []


def add_holder(holder: Holder) -> None:
    """Start telling ``holder`` of the buffers :func:`hold` announces."""
    _HOLDERS.append(holder)


def remove_holder(holder: Holder) -> None:
    """Stop telling ``holder`` (the last registration of it)."""
    remove_last(_HOLDERS, holder)


def remove_last(registered: list[Any], item: Any) -> None:
    """Remove the last registration of ``item`` from ``registered`` (none: no-op), so
    nested registrations of one listener end in reverse order. Compared with ``==``:
    a bound method is a new object at each access.

    >>> seen = [print, len, print]
    >>> remove_last(seen, print); seen == [print, len]
    True
    """
    for i in range(len(registered) - 1, -1, -1):
        if registered[i] == item:
            del registered[i]
            return


def holding() -> bool:
    """Whether a holder listens (the runtime then makes the buffers it announces)."""
    return bool(_HOLDERS)


def hold(buffer: torch.Tensor, layout: Any, shape: tuple[int, ...]) -> None:
    """Tell every holder that ``buffer`` (a torch tensor here, perhaps sharing its
    storage with another value) stands for the blocks of a value of global ``shape``
    laid out as ``layout``: what each device would hold while ``buffer`` lives.

    >>> seen = []
    >>> add_holder(lambda b, layout, shape: seen.append(shape))
    >>> hold(torch.zeros(2), None, (2,)); _HOLDERS.clear(); seen
    [(2,)]
    """
    for holder in list(_HOLDERS):
        holder(buffer, layout, shape)


def record(kind: Any, nbytes: int, step: Any = None, *, phase: str | None = None,
           where: str | None = None) -> None:
    """Tell every observer about one collective (``kind`` counts under its plain name,
    or under the innermost :func:`counted_as` kind); ``phase`` defaults to
    ``"backward"`` while autograd's engine runs (a collective of a gradient computed
    there, e.g. FSDP's reduce_scatter on the process runtime), else ``"forward"``;
    ``where`` defaults to the calling user line (:func:`source_line`)."""
    if not _OBSERVERS:
        return
    if phase is None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    event = Event(_KINDS[-1] if _KINDS else str(kind), nbytes, step, phase,
                  source_line() if where is None else where)
    for observer in list(_OBSERVERS):
        observer(event)


@contextlib.contextmanager
def counted_as(kind: str) -> Iterator[None]:
    """Count every collective recorded inside under ``kind`` (its step keeps the
    collective it is).

    >>> seen = []
    >>> add(seen.append)
    >>> with counted_as("fallback_gather"):
    ...     record("all_gather", 32)
    >>> remove(seen.append); [(e.kind, e.nbytes) for e in seen]
    [('fallback_gather', 32)]
    """
    _KINDS.append(kind)
    try:
        yield
    finally:
        _KINDS.pop()


# Frames in these directories are library frames: the user line is the first other one.
_SKIP = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
              for m in (torch, sys.modules[__name__.rpartition(".runtime")[0]]))


def in_library(path: str) -> bool:
    """Whether source file ``path`` is part of shardwise or torch (not the user's)."""
    return path.startswith(_SKIP) or path.startswith("<frozen")


def source_line() -> str:
    """``file:line`` of the innermost stack frame outside shardwise and torch (the
    user's line that caused a collective); the file is relative to the working
    directory when under it.

    >>> source_line().endswith(">:1")   # a doctest's own line
    True
    """
    frame = sys._getframe(1)
    while frame is not None:
        if not in_library(frame.f_code.co_filename):
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    if os.path.isabs(path):
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
    return f"{path}:{frame.f_lineno}"


def on_backward(shards: Sequence[torch.Tensor | None], steps: Sequence[Any],
                where: str) -> None:
    """Record ``steps`` (collectives with ``kind`` and ``bytes_per_device``) as backward
    events of line ``where`` when autograd computes the gradient of ``shards``: a hook
    on the first local shard that is an autograd non-leaf (a leaf's hook would outlive
    the step). Call only while :func:`active`."""
    if not steps or not torch.is_grad_enabled():
        return
    for s in shards:
        if s is not None:
            if s.requires_grad and s.grad_fn is not None:
                s.register_hook(_BackwardHook(tuple(steps), where))
            return


class _BackwardHook:
    """A tensor hook that records its steps once per gradient it sees."""

    __slots__ = ("steps", "where")

    def __init__(self, steps: tuple[Any, ...], where: str) -> None:
        self.steps, self.where = steps, where

    def __call__(self, grad: torch.Tensor) -> None:
        for step in self.steps:
            record(step.kind, step.bytes_per_device, step, phase="backward", where=self.where)
