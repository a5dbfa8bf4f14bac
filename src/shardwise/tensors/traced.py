"""Where compiled code enters shardwise functions: each call one node of Dynamo's graph.

Dynamo records torch functions on shardwise Tensors as graph nodes by itself (the
Tensor is a traceable wrapper subclass). A shardwise function that makes Tensors
(placing a plain tensor on a mesh, a relayout) is different: Dynamo cannot trace its
Python (it builds wrappers and reads caches), so :func:`traced` makes it one node,
a ``nonstrict_trace`` call: Dynamo does not trace its Python but runs it for the
node's value, and AOTAutograd runs it again on the graph's tensors, recording the
local ops and functional collectives it issues.

Invariants:
- Dynamo traces this module (``tensors.compiled.TRACED_MODULES``); eagerly a traced
  function costs one ``torch.compiler.is_compiling()`` call more than a direct call.
- :func:`eager_only` hooks are skipped by compiled code: Dynamo folds the test, so
  neither the hook nor a break is in the graph.
- A node's arguments are modules, Tensors, plain tensors and constants (meshes,
  layouts, placements: registered as pytree constants here; strings, numbers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Partial, Replicated, Sharded

__all__ = ["ON_COMPILE", "eager_only", "traced"]

#: called (untraced) by ``shardwise.compile_backend`` each time it compiles a graph:
#: checks of upper floors that warn where compiled code will differ from eager code
ON_COMPILE: list[Callable[[], None]] = []

class _Traced:
    """A shardwise function that enters Dynamo's graph as one node."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.node = torch._dynamo.nonstrict_trace(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # is_compiling(), not torch's flag: Dynamo folds the call to True with no guard
        if torch.compiler.is_compiling():
            return self.node(*args, **kwargs)
        return self.fn(*args, **kwargs)


def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a shardwise function of modules, Tensors, plain tensors and constant
    specs, that returns Tensors or passes values through) as one node of a compiled
    graph (``torch._dynamo.nonstrict_trace``); called directly otherwise.

    >>> double = traced(lambda x: x * 2)
    >>> double(torch.ones(2)).tolist()
    [2.0, 2.0]
    """
    return _Traced(fn)


class _EagerOnly:
    """A module hook that compiled code skips or replaces (see :func:`eager_only`)."""

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any] | None) -> None:
        self.fn = fn
        self.compiled = compiled
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # folded by Dynamo: the hook is not in the graph
            return None if self.compiled is None else self.compiled(*args, **kwargs)
        return self.fn(*args, **kwargs)


def eager_only(fn: Callable[..., Any], compiled: Callable[..., Any] | None = None
               ) -> Callable[..., Any]:
    """``fn`` (a module hook) run eagerly and skipped by compiled code (a hook returning
    None changes nothing), where its Python would break the graph: its work is then
    done by the graph's own ops. ``compiled``: a hook that compiled code runs instead,
    traced by Dynamo (so defined in one of ``tensors.compiled.TRACED_MODULES``).

    >>> hook = eager_only(lambda module, args: print("eager"))
    >>> hook(None, ())
    eager
    """
    return _EagerOnly(fn, compiled)


# the specs a node takes as arguments: constants of the graph (immutable and hashable)
for _spec in (DeviceMesh, Layout, Replicated, Sharded, Partial):
    pytree.register_constant(_spec)
