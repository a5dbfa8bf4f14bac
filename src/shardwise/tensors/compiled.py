"""The Tensor under ``torch.compile``: a traceable wrapper subclass, and its routing while
Dynamo and AOTAutograd trace.

Invariants:
- ``__tensor_flatten__`` names the distinct buffers this process holds (``_held<j>``,
  properties added to the class on first need) and a context (layout, replica pattern
  or a whole value, dtype, open dims); equal contexts mean equal layouts, so Dynamo's
  guards on it recompile only for another layout. ``__tensor_unflatten__`` rebuilds
  the Tensor around the buffers.
- Dynamo records torch functions on a Tensor as graph nodes, their example values
  computed by :meth:`CompiledMixin.compiled_route` on fake buffers; AOTAutograd, given
  the graph on the buffers (:mod:`shardwise.ops.compiling`), runs the same routing on
  them, so the compiled graph holds the local ops and functional collectives.
- A Tensor that is an op's result enters a compiled frame with its autograd history on
  its faked buffers, where torch's fake conversion puts it on the wrapper
  (``__tensor_unflatten__`` and :meth:`CompiledMixin._shallow_copy`, asked by it).
- Dynamo traces no frame of shardwise but :data:`TRACED_MODULES`
  (:func:`_skip_in_dynamo`), so no guard reads shardwise's Python state.
- Eager ops pay one attribute read (:data:`COMPILER`) for all of this; what runs under
  compile sets :data:`ROUTED` (read by :mod:`shardwise.ops.graph_breaks`).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.runtime.local import Blocks, Local, Whole
from shardwise.sharding.errors import ShardingError
from shardwise.tensors import ordering
from shardwise.tensors.relayout import RelayoutMixin
from shardwise.tensors.routing import FALLBACK, HANDLERS, REGISTRY, route

__all__ = ["COMPILER", "ROUTED", "TRACED_MODULES", "WATCH", "CompiledMixin"]


class _CompilingFlag:
    """``torch.compiler.is_compiling()`` read as an attribute, where torch has no
    ``_is_compiling_flag`` (the flag it returns; TorchScript never runs this code)."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


#: read as ``COMPILER._is_compiling_flag`` on every op: a module attribute, where
#: calling ``is_compiling()`` costs two Python frames (~0.1 us an op)
COMPILER: Any = (torch.compiler if hasattr(torch.compiler, "_is_compiling_flag")
                 else _CompilingFlag())

#: whether a torch function on a shardwise Tensor was routed since the compile of the
#: current frame began (reset by ops/graph_breaks.py when Dynamo starts or ends one)
ROUTED = [False]
#: called on each routed function and input taken apart while tracing: the graph-break
#: watch makes sure it is installed (``torch._dynamo.reset()`` drops Dynamo's compile callbacks)
WATCH: list[Callable[[], None]] = []

#: the module where torch's AOTAutograd rebuilds subclass instances to differentiate them
_AOT_SUBCLASSES = "torch._functorch._aot_autograd.schemas"

#: the module where torch's fake conversion builds a subclass input around fake buffers
_META_CONVERTER = "torch._subclasses.meta_utils"

#: the modules Dynamo traces: where compiled code enters shardwise functions (the
#: parallel styles' hooks, each one graph node: tensors/traced.py), and fully_shard's
#: compiled hooks for mixed precision (torch functions and module attributes only)
TRACED_MODULES = ("tensors/traced.py", "parallel/style.py", "parallel/precision.py")


def _skip_in_dynamo() -> None:
    """Dynamo traces no frame of shardwise's own code but the entry points of
    :data:`TRACED_MODULES`: the rest branches on Python state (caches, plan counters,
    the ids of shared blocks) that Dynamo would guard on and recompile for whenever it
    changes (a parallelized model hit recompile_limit in the simulated backend's
    run_step, its hooks and the planner, ~2x slower than eager once warm). A call into
    a skipped module from compiled code is a graph break that runs eagerly. Dynamo's
    skip list is torch-internal (a torch without it would trace every frame)."""
    rules = getattr(torch._dynamo, "trace_rules", None)  # imported by compiler.disable
    skip = getattr(rules, "SKIP_DIRS", None)
    recompile = getattr(rules, "_recompile_re", None)
    if skip is None or recompile is None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spared = {os.path.join(root, *m.split("/")) for m in TRACED_MODULES}
    for folder, _, files in os.walk(root):
        skip.extend(path for path in (os.path.join(folder, f) for f in files
                                      if f.endswith(".py")) if path not in spared)
    recompile()


_skip_in_dynamo()


class CompiledMixin(RelayoutMixin):
    """What makes the Tensor traceable by ``torch.compile`` (see the module doc)."""

    @classmethod
    def compiled_route(cls, func: Any, args: Any, kwargs: Any) -> Any:
        """A torch function on shardwise Tensors while torch.compile runs: Dynamo
        computing a graph node's example value on fake buffers, or AOTAutograd tracing
        the node on the graph's tensors. A function with a handler runs it, as eagerly;
        any other (torch reading a fake Tensor's metadata: ``_is_view``,
        ``untyped_storage``, ...) runs on the wrapper itself, and an op without a rule
        is refused by ``Tensor.__torch_dispatch__`` (the gathered fallback is eager
        only)."""
        if not FALLBACK:  # a compiled function may be the first torch call: fill the registry
            importlib.import_module(REGISTRY)
        ROUTED[0] = True
        for watch in WATCH:  # (tracing only: compiled code never runs this)
            watch()
        if func in HANDLERS:
            if ordering.ORDERS:  # some value is held in a sequence order: kept only where exact
                return ordering.ORDERS[0](func, tuple(args), kwargs or {})
            return route(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        """The distinct buffers this process holds, as attribute names (``_held<j>``),
        and what rebuilds the Tensor around them: layout, each device's buffer index
        (None: another process's; the whole pattern None: one buffer holding the global
        value), dtype, open dims. Equal contexts mean equal layouts, so Dynamo's guards
        on it recompile only for another layout."""
        if COMPILER._is_compiling_flag:  # Dynamo taking an input apart: a compile began
            for watch in WATCH:
                watch()
        local = self._local
        if isinstance(local, Blocks):
            pattern: tuple[int | None, ...] | None = local.pattern()
            names = _held_names(len(local.unique()))
        else:
            pattern, names = None, _held_names(1)
        return names, (self._layout, pattern, self._dtype, self._open)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], context: tuple[Any, ...],
                             outer_size: Any, outer_stride: Any) -> Any:
        layout = context[0]
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller == _META_CONVERTER and not all(t.is_leaf for t in inner.values()):
            # Dynamo faking an input that is the result of an op (a compiled block's
            # input): torch fakes the autograd history of the wrapper itself (a leaf it
            # builds, then gives history through :meth:`CompiledMixin._shallow_copy`),
            # where a shardwise Tensor's history is its buffers'. Built around leaves of
            # the faked buffers, the wrapper passes; the compiled graph meets the real
            # buffers' history at run time (compile_backend hands them to AOTAutograd).
            inner = {n: t.detach().requires_grad_(t.requires_grad) for n, t in inner.items()}
        if (torch.is_grad_enabled() and any(t.requires_grad for t in inner.values())
                and caller == _AOT_SUBCLASSES):
            raise ShardingError(
                f"torch.compile's AOTAutograd is differentiating a shardwise.Tensor laid "
                f"out as {layout}: it would record gradients on the wrapper, which holds "
                "no autograd state (a shardwise Tensor's autograd runs on its buffers), "
                "so backward would find nothing to differentiate. Compile with "
                "backend=shardwise.compile_backend() (or compile_backend('aot_eager')), "
                "or run the compiled function under torch.no_grad().")
        return cls.from_buffers([inner[n] for n in _held_names(len(inner))], context,
                                torch.Size(outer_size))

    def _shallow_copy(self) -> Any:
        """torch's C++ shallow copy of the wrapper (``aten.detach`` at the dispatcher,
        under compile): a new wrapper around the same buffers, as the wrapper holds no
        autograd state of its own. Asked by the fake conversion (faking the autograd
        history of an input that is an op's result), the buffers get that history
        instead, as they carry the Tensor's autograd."""
        if sys._getframe(2).f_globals.get("__name__") != _META_CONVERTER:
            return self.map_buffers(lambda b: b)

        def faked(b: torch.Tensor) -> torch.Tensor:
            if not b.requires_grad:
                return b
            # (as torch's meta converter fakes a plain tensor's history: a backward
            # reaching it raises)
            return torch._C._functions.DelayedError(
                "Internal error: Tried to backward() through example input", 1)(b)

        return self.map_buffers(faked)

    @classmethod
    def from_buffers(cls, buffers: Sequence[torch.Tensor], context: tuple[Any, ...],
                     size: torch.Size) -> Any:
        """The Tensor around ``buffers`` (in ``__tensor_flatten__``'s order) with the
        flatten ``context``, of global ``size``: what ``__tensor_unflatten__`` builds,
        for a caller that has the buffers in a list (``shardwise.compile_backend``)."""
        layout, pattern, dtype, open_dims = context
        if pattern is None:
            first = buffers[0]
            held: Local = Whole(first, layout)
        else:
            blocks = tuple(None if j is None else buffers[j] for j in pattern)
            held = Blocks(blocks)
            first = next(b for b in blocks if b is not None)
        return cls.from_held(held, layout, size, dtype, first.device, open_dims)


#: the names of the first n buffers, by n (each a property of the class)
_NAMES: dict[int, list[str]] = {}


def _held_names(n: int) -> list[str]:
    """The attribute names of a Tensor's first ``n`` buffers (``_held0``...), each a
    property of :class:`CompiledMixin` (so of every Tensor class) added on first need: a
    ``__getattr__`` would slow every attribute read of every Tensor."""
    names = _NAMES.get(n)
    if names is None:
        names = [f"_held{j}" for j in range(n)]
        for j, name in enumerate(names):
            if name not in CompiledMixin.__dict__:
                setattr(CompiledMixin, name, property(functools.partial(_buffer, j)))
        _NAMES[n] = names
    return list(names)  # (torch may keep and change the list it is given)


def _buffer(j: int, t: Any) -> torch.Tensor:
    return t._local.buffers()[j]
