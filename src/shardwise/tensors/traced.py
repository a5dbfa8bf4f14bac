"""Where compiled code enters shardwise functions: each call one node of Dynamo's graph.

Dynamo records torch functions on shardwise Tensors as graph nodes by itself (the
Tensor is a traceable wrapper subclass). A shardwise function that makes Tensors
(placing a plain tensor on a mesh, a relayout) is different: Dynamo cannot trace its
Python (it builds wrappers and reads caches), so :func:`traced` makes it one node,
a ``nonstrict_trace`` call: Dynamo does not trace its Python but runs it for the
node's value, and AOTAutograd runs it again on the graph's tensors, recording the
local ops and functional collectives it issues.

Invariants:
- Dynamo traces this module (``tensors.tensor.TRACED_MODULES``); eagerly a traced
  function costs one ``torch.compiler.is_compiling()`` call more than a direct call.
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

__all__ = ["traced"]

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


# the specs a node takes as arguments: constants of the graph (immutable and hashable)
for _spec in (DeviceMesh, Layout, Replicated, Sharded, Partial):
    pytree.register_constant(_spec)
