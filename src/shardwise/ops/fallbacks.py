"""Seeing the gathered fallback: its warning, strict mode, and listeners.

The fallback (:func:`shardwise.ops.registry.fallback`) runs an op without a sharding
rule on the gathered global operands: exact, but neither its communication nor its
memory is sharded. This module makes each such run visible.

Invariants:
- :func:`report` is called once per fallback run of an op (not for metadata queries
  nor for readers such as ``float(x)``), before anything is gathered.
- Strict mode (:class:`strict`, or ``SHARDWISE_STRICT=1`` in the environment while no
  :class:`strict` call has set it) makes :func:`report` raise a ShardingError naming
  the op: nothing is gathered and nothing runs.
- Listeners (:func:`add_listener`; ``shardwise.debug.FallbackCounter``) see every
  fallback run as a :class:`Fallback` (op, bytes gathered per device, user line),
  strict or not, warned or not.
- The warning (:class:`ShardwiseFallbackWarning`) is issued once per op name per
  process (:func:`forget_warnings` forgets which were issued) and points at the first
  stack frame outside shardwise and torch, the user's line, whatever the depth of
  the handler that fell back.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from shardwise.planner.steps import fmt_bytes
from shardwise.runtime import observe
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor

__all__ = ["ENV", "Fallback", "ShardwiseFallbackWarning", "add_listener", "forget_warnings",
           "gathered_bytes", "is_strict", "remove_listener", "report", "strict"]

ENV = "SHARDWISE_STRICT"


class ShardwiseFallbackWarning(UserWarning):
    """A torch op without a sharding rule ran on gathered (replicated) operands."""


class Fallback(NamedTuple):
    """One fallback run: the op's name, the bytes each device received to gather its
    operands, and the user line (``file:line``) that called it."""

    op: str
    nbytes: int
    where: str


Listener = Callable[[Fallback], None]

_LISTENERS: list[Listener] = []
_WARNED: set[str] = set()
_STRICT: list[bool] = []  # the mode strict() set last; empty: the environment decides


class strict:
    """Strict mode: every fallback raises a ShardingError naming the op (for CI).

    ``shardwise.strict()`` turns it on for the process, ``shardwise.strict(False)``
    off; ``with shardwise.strict():`` for a block only (the mode before is restored on
    exit). Without any call, ``SHARDWISE_STRICT=1`` in the environment turns it on.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> with shardwise.strict():
    ...     torch.nonzero(x)
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: torch.nonzero has no sharding rule and strict ...
    >>> is_strict()
    False
    """

    def __init__(self, enabled: bool = True) -> None:
        self._before = list(_STRICT)
        _STRICT[:] = [bool(enabled)]

    def __enter__(self) -> strict:
        return self

    def __exit__(self, *exc: object) -> None:
        _STRICT[:] = self._before


def is_strict() -> bool:
    """Whether a fallback raises now (:class:`strict`, else ``SHARDWISE_STRICT``)."""
    if _STRICT:
        return _STRICT[0]
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def add_listener(listener: Listener) -> None:
    """Call ``listener(Fallback(...))`` for every fallback run from now on."""
    _LISTENERS.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener`` (its last registration)."""
    observe.remove_last(_LISTENERS, listener)


def forget_warnings() -> None:
    """Warn again for ops already warned about (the warning is once per op name)."""
    _WARNED.clear()


def _tensors(a: Any) -> Iterator[Tensor]:
    if isinstance(a, Tensor):
        yield a
    elif isinstance(a, (list, tuple)):
        for v in a:
            yield from _tensors(v)
    elif isinstance(a, dict):
        for v in a.values():
            yield from _tensors(v)


def gathered_bytes(args: Sequence[Any]) -> int:
    """The bytes each device receives to gather the shardwise Tensors in ``args`` (the
    collectives of their plans to Replicated).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> gathered_bytes([x, [x], 2.0])   # twice the other device's 2x2 float block
    32
    """
    total = 0
    for t in _tensors(list(args)):
        plan = t.plan_to(Layout.replicated(t.mesh, t.ndim))
        total += sum(step.bytes_per_device for step in plan.collectives)
    return total


def report(name: str, args: Sequence[Any], operands: Callable[[], str]) -> None:
    """One fallback run of op ``name`` on ``args`` (``operands()`` describes them):
    raise in strict mode, tell the listeners, warn once per op name."""
    strict_now = is_strict()
    if not (strict_now or _LISTENERS or name not in _WARNED):
        return
    nbytes = gathered_bytes(args)
    if _LISTENERS:
        event = Fallback(name, nbytes, observe.source_line())
        for listener in list(_LISTENERS):
            listener(event)
    if strict_now:
        raise ShardingError(
            f"{name} has no sharding rule and strict mode is on (shardwise.strict() or "
            f"{ENV}=1): it would run on the gathered operands ({operands()}; "
            f"{fmt_bytes(nbytes)} per device). Use ops that have rules, gather explicitly "
            "with x.to_torch() where intended, or allow it with "
            "`with shardwise.strict(False):`.")
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(ShardwiseFallbackWarning(
            f"{name} has no sharding rule: it ran on the gathered global operands "
            f"({operands()}; {fmt_bytes(nbytes)} gathered per device) and its result is "
            "Replicated. Values are exact; the communication and memory are not sharded. "
            "shardwise.debug.FallbackCounter counts these; shardwise.strict() makes them "
            "errors."), stacklevel=_user_level())


def _user_level() -> int:
    """``warnings.warn``'s stacklevel, called from :func:`report`, that names the first
    frame outside shardwise and torch (the user's line); the handlers that fall back
    sit at varying depths."""
    frame: Any = sys._getframe(1)  # report's frame: stacklevel 1
    level = 1
    while frame is not None and observe.in_library(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1
