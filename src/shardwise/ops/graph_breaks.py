"""Seeing torch.compile's graph breaks in shardwise programs: strict mode and listeners.

A graph break splits a compiled function: the part after it runs as another graph (or
eagerly), so the collectives on either side cannot be scheduled together and each
call pays Dynamo's frame switch. Dynamo only logs a break; this module makes the
breaks of shardwise programs visible, as :mod:`shardwise.ops.fallbacks` does the
gathered fallback.

Invariants:
- A break here is a graph break or a frame Dynamo gave up on (``unimplemented``: it
  then runs eagerly whole, as silently). It is shardwise's when its reason names a
  file of the shardwise package (a call into shardwise code that Dynamo does not
  trace, ``tensors.compiled._skip_in_dynamo``) or when the frame being compiled ran a
  torch function on a shardwise Tensor (:data:`shardwise.tensors.compiled.ROUTED`):
  either way a graph of shardwise ops is split.
- Each such break is seen once, when Dynamo finishes compiling the frame (its end
  callback, :func:`_end`): listeners (:func:`add_listener`,
  ``shardwise.debug.GraphBreakCounter``) get a :class:`GraphBreak`.
  ``torch._dynamo.reset()`` drops Dynamo's callbacks: they come back when a compile
  first traces a shardwise Tensor (an op on it, or taking it apart), and that compile
  is watched from there on.
- In strict mode (``shardwise.strict()``) a :class:`GraphBreakError` (a ShardingError)
  names the reason and the fix: raised by the frame's compiled graph before any of it
  runs (``shardwise.compile_backend`` asks :func:`strict_error`), else (torch's own
  backends, a break before any graph) by the next compile Dynamo starts.
- Eager code pays nothing: Dynamo calls the callbacks only while it compiles a frame.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._dynamo.exc import TorchRuntimeError
from torch._dynamo.utils import counters

from shardwise.ops.fallbacks import ENV, is_strict
from shardwise.runtime import observe
from shardwise.sharding.errors import ShardingError
from shardwise.tensors import compiled

__all__ = ["GraphBreak", "GraphBreakError", "add_listener", "explain", "remove_listener",
           "strict_error"]

#: the shardwise package's folder, as Dynamo's reasons name the files they skip
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class GraphBreakError(ShardingError, TorchRuntimeError):
    """A graph break in a shardwise program under ``shardwise.strict()``: a ShardingError
    that ``torch.compile`` passes through as it is (a ``TorchRuntimeError`` too)."""


class GraphBreak(NamedTuple):
    """One graph break of a shardwise program: Dynamo's reason (its first line names
    the cause), the compile id (``frame/recompile``), and whether the break is in
    shardwise's own code (else on a shardwise Tensor in the user's code)."""

    reason: str
    compile_id: str
    in_shardwise: bool

    @property
    def cause(self) -> str:
        """The reason's first line, with the function it names, if any."""
        first = self.reason.split("\n", 1)[0]
        named = re.search(r"the function `([^`]+)`", self.reason)
        if not named:
            return first
        why = _WHY.get(named.group(1))
        return f"{first} ({named.group(1)}{': ' + why if why else ''})"


Listener = Callable[[GraphBreak], None]

_LISTENERS: list[Listener] = []
_BEFORE: list[Counter[str]] = [Counter()]  # Dynamo's break counts when the compile began
_PENDING: list[GraphBreakError] = []  # strict mode's error for the next compile to raise


#: why a shardwise function that Dynamo skips breaks the graph, and the fix, by name
_WHY: dict[str, str] = {}


def explain(function: str, why: str) -> None:
    """Name why a call into shardwise ``function`` (a function Dynamo does not trace)
    breaks the graph, and the fix: the break's cause (listed by
    ``shardwise.debug.GraphBreakCounter``, raised under strict mode) says it.

    >>> explain("_example", "it reads a value on the host; pass sizes instead")
    >>> GraphBreak("Skipped the function `_example`", "0/0", True).cause
    'Skipped the function `_example` (_example: it reads a value on the host; pass sizes instead)'
    """
    _WHY[function] = why


def add_listener(listener: Listener) -> None:
    """Call ``listener(GraphBreak(...))`` for every graph break of a shardwise program."""
    _LISTENERS.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener`` (its last registration)."""
    observe.remove_last(_LISTENERS, listener)


def _start(args: Any) -> None:
    # a strict-mode break that no compiled graph could raise: Dynamo's callbacks may
    # raise only here (an error in the end callback leaves Dynamo's count of pending
    # compiles behind)
    error, _PENDING[:] = _PENDING[:1], []
    _BEFORE[0] = _counts()
    compiled.ROUTED[0] = False
    if error:
        raise error[0]


def _counts() -> Counter[str]:
    """Dynamo's counts of graph breaks and of frames it gave up on (``unimplemented``:
    the frame runs eagerly, as after a break), by reason."""
    return counters["graph_break"] + counters["unimplemented"]


def _breaks(compile_id: str) -> list[GraphBreak]:
    """The breaks of a shardwise program since the compile of this frame began."""
    before = _BEFORE[0]
    routed = compiled.ROUTED[0]
    return [GraphBreak(r, compile_id, _ROOT in r) for r, n in _counts().items()
            if n > before.get(r, 0) and (routed or _ROOT in r)]


def strict_error() -> GraphBreakError | None:
    """In strict mode, the error for the first break of a shardwise program in the
    frame being compiled (None: no such break, or strict mode is off). A backend that
    compiles the frame's graph returns a function raising it, so no part of the frame
    runs (``shardwise.compile_backend`` does)."""
    if not is_strict():
        return None
    from torch._guards import CompileContext

    breaks = _breaks(str(CompileContext.current_compile_id()))
    if not breaks:
        return None
    _BEFORE[0] = _counts()  # raised once, by the graph
    compiled.ROUTED[0] = False
    return _error(breaks[0])


def _error(b: GraphBreak) -> GraphBreakError:
    where = "in shardwise's code" if b.in_shardwise else "on a shardwise Tensor"
    return GraphBreakError(
        f"torch.compile broke the graph {where} (compile {b.compile_id}) and strict mode "
        f"is on (shardwise.strict() or {ENV}=1): {b.cause}. The rest of the function "
        "would run as another graph. Move the call out of the compiled function "
        "(shardwise's placing and gathering functions run eagerly, before or after it), "
        "use torch ops on the Tensors inside it, or allow the break with "
        f"`with shardwise.strict(False):`. Dynamo's reason in full:\n{b.reason}")


def _end(args: Any) -> None:
    breaks = _breaks(str(getattr(args, "compile_id", "?")))
    compiled.ROUTED[0] = False
    for b in breaks:
        for listener in list(_LISTENERS):
            listener(b)
    if breaks and is_strict():  # no graph of this frame raised it: the next compile does
        _PENDING[:] = [_error(breaks[0])]


def _install() -> None:
    """Register the watch with Dynamo, unless it is: at import, and again on the first
    shardwise op of a compile after ``torch._dynamo.reset()`` dropped it (that compile
    is then watched from that op on)."""
    handler = torch._dynamo.callback_handler
    if _start not in handler.start_callbacks:
        _BEFORE[0] = _counts()
        handler.register_start_callback(_start)
        handler.register_end_callback(_end)


_install()
compiled.WATCH.append(_install)
