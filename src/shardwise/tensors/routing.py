"""The op registry's table and the one route of a torch function on shardwise Tensors.

Invariants:
- :data:`HANDLERS` maps torch functions to handlers; :mod:`shardwise.ops` fills it
  (and :data:`FALLBACK`, :data:`WRITE_OUT`) when :data:`REGISTRY` is imported, on the
  first torch call: a plugin named here, no static upward import.
- Every torch function routed here runs as the current op of the program position
  (:mod:`shardwise.runtime.position`); the previous op is restored after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from shardwise.runtime.position import HERE

__all__ = ["FALLBACK", "HANDLERS", "REGISTRY", "WRITE_OUT", "route"]

#: torch function -> handler, filled by :mod:`shardwise.ops` (the op registry).
HANDLERS: dict[Any, Callable[..., Any]] = {}
#: the module that fills HANDLERS and FALLBACK, loaded on the first torch call.
REGISTRY = "shardwise.ops.torch_api"
#: called for a torch function without a handler: ``(func, args, kwargs) -> result``
#: (Replicated Tensors; with ``plain=True``, plain torch tensors of the global values).
FALLBACK: list[Callable[..., Any]] = []
#: called for a torch function given ``out=``: runs it without, then writes ``out``.
WRITE_OUT: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = []


def route(func: Any, args: Any, kwargs: Any) -> Any:
    """One torch function on shardwise Tensors: its handler, else the fallback. The
    collectives it runs carry ``func`` in their program position (restored after: a
    rank's extra local op leaves nothing behind)."""
    here = HERE
    before = here.op
    here.op = func
    try:
        handler = HANDLERS.get(func)
        if not kwargs:  # the common call: straight to its handler
            if handler is not None:
                return handler(*args)
        elif WRITE_OUT and kwargs.get("out") is not None:
            return WRITE_OUT[0](func, tuple(args), kwargs)
        elif handler is not None:
            return handler(*args, **kwargs)
        if not FALLBACK:  # the registry is filled by the API floor's ops, named here as
            importlib.import_module(REGISTRY)  # a plugin (no static upward import)
            return route(func, args, kwargs)
        return FALLBACK[0](func, tuple(args), kwargs or {})
    finally:
        here.op = before
