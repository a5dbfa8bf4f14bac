"""``torch.compile`` of code on shardwise Tensors: the backend that lowers Dynamo's
graph to one graph of local torch ops and functional collectives.

Dynamo records each torch function on a shardwise Tensor as one node (the Tensor is a
traceable wrapper subclass; :mod:`shardwise.tensors.compiled`). torch's own
AOTAutograd would then differentiate the wrapper, but a shardwise Tensor keeps no
autograd state of its own: autograd runs on the buffers it holds. So this backend
desugars first: the graph becomes a function of the buffers (each Tensor input
rebuilt around its buffers, each Tensor output taken apart into them), which
AOTAutograd traces, differentiates and partitions like any torch function, and the
inner compiler (inductor, or none) compiles.

Invariants:
- Inputs and outputs cross the compiled function as the buffers of
  ``Tensor.__tensor_flatten__``, rebuilt by ``__tensor_unflatten__`` with the
  context seen while tracing (Dynamo's guards keep it the same for every call).
- The compiled graph runs no shardwise Python: relayouts are local ops and torch's
  functional collectives (process runtime), recorded once while tracing.
- Gradients reach the leaves' buffers, where shardwise's eager autograd puts them.
- Under ``shardwise.strict()`` a frame whose graph broke in a shardwise program compiles
  to a function that raises the break (:mod:`shardwise.ops.graph_breaks`).
- ``torch.compile(model)`` (inductor, any mode or options) and ``backend="aot_eager"``
  compile a graph with shardwise Tensor inputs as this backend does; other graphs go
  to torch's backends untouched (:func:`_route_torch_backends`, installed when the op
  registry loads, which every Tensor's first torch call does).

Floor 3 (the public face is :mod:`shardwise.api.compiling`), so that the op registry
can route torch's backends here whichever API a program used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops import graph_breaks
from shardwise.ops.fallbacks import is_strict
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.symbolic import is_symbolic, static
from shardwise.tensors.tensor import Tensor
from shardwise.tensors.traced import ON_COMPILE

__all__ = ["compile_backend"]

#: the inner compilers :func:`compile_backend` takes
INNER = ("inductor", "aot_eager")

Spec = tuple[int, Any, torch.Size] | None  # buffers, flatten context, size; None: plain


def _take_apart(values: Sequence[Any]) -> tuple[list[Any], list[Spec]]:
    """The values with each Tensor replaced by its buffers, and how to rebuild them."""
    flat: list[Any] = []
    specs: list[Spec] = []
    for v in values:
        if isinstance(v, Tensor):
            names, context = v.__tensor_flatten__()
            flat.extend(getattr(v, n) for n in names)
            specs.append((len(names), context, v.shape))
        else:
            flat.append(v)
            specs.append(None)
    return flat, specs


def _rebuild(flat: Sequence[Any], specs: Sequence[Spec], sized: bool = False) -> list[Any]:
    """The values of ``flat`` (buffers) rebuilt as ``specs`` say; ``sized``: specs of
    :func:`_sized`, whose size ``-k`` along a dim (a symbolic size) is ``k`` times the
    first buffer's size there."""
    out: list[Any] = []
    i = 0
    for spec in specs:
        if spec is None:
            out.append(flat[i])
            i += 1
            continue
        n, context, size = spec
        if sized and min(size, default=0) < 0:
            first = flat[i].shape
            size = torch.Size([-s * first[d] if s < 0 else s for d, s in enumerate(size)])
        out.append(Tensor.from_buffers(flat[i:i + n], context, size))
        i += n
    return out


def _sized(spec: Spec) -> Spec:
    """An output's spec with each symbolic size (dynamic shapes) as ``-k``: ``k``
    times its first buffer's size along that dim, read on each call (:func:`_rebuild`).
    A symbolic dim is unsharded, or split evenly (:mod:`shardwise.tensors.symbolic`):
    ``k`` is its number of pieces (1 where one buffer holds the whole value)."""
    if spec is None:
        return None
    n, context, size = spec
    if not is_symbolic(size):
        return spec
    layout, pattern = context[0], context[1]
    dims = []
    for d, s in enumerate(size):
        s = static(s)
        if type(s) is not int:
            pieces = 1
            for a in layout.dims[d] if pattern is not None else ():
                pieces *= layout.mesh.mesh_shape[a]
            s = -pieces
        dims.append(s)
    return n, context, torch.Size(dims)


def _traced_sizes(gm: torch.fx.GraphModule, specs: list[Spec]) -> list[Spec]:
    """``specs`` of Dynamo's example inputs with the sizes Dynamo traced them with:
    its example inputs are the call's own values (AOTAutograd fakes their buffers
    again, with the same symbols), whose sizes are concrete where Dynamo's are
    symbolic (dynamic shapes)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(specs):
        return specs
    out: list[Spec] = []
    for node, spec in zip(inputs, specs):
        traced = node.meta.get("example_value")
        if spec is not None and isinstance(traced, Tensor):
            spec = (spec[0], spec[1], torch.Size([static(d) for d in traced.shape]))
        out.append(spec)
    return out


class _Module(torch.nn.Module):
    """A function as the module AOTAutograd compiles (it takes modules)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *flat: Any) -> Any:
        return self.fn(*flat)


def _buffers_of(values: Sequence[Any]) -> list[Any]:
    """The values with each Tensor replaced by its buffers (``__tensor_flatten__``'s,
    in its order), read straight from what the Tensor holds: a compiled function's
    inputs on every call, whose layouts Dynamo's guards have checked already."""
    flat: list[Any] = []
    for v in values:
        if isinstance(v, Tensor):
            flat.extend(v.held.buffers())
        else:
            flat.append(v)
    return flat


def _compilers(inner: str | Callable[..., Any], patches: dict[str, Any] | None = None
               ) -> tuple[Callable[..., Any], Callable[..., Any], Any]:
    """Forward compiler, backward compiler and decompositions for AOTAutograd;
    ``patches``: inductor config that both compilers run under (``torch.compile``'s
    ``mode`` and ``options``; the backward compiles at the first backward call, after
    this backend has returned)."""
    if inner == "inductor":
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table

        compile_inner: Callable[..., Any] = compile_fx_inner
        if patches:
            compile_inner = config.patch(patches)(compile_fx_inner)
        return (compile_inner, functools.partial(compile_inner, is_backward=True),
                select_decomp_table())
    from functorch.compile import make_boxed_func

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return make_boxed_func(gm if isinstance(inner, str) else inner(gm, example_inputs))

    return keep, keep, None


def _compiling() -> Any:
    """torch's compile-session flag (``torch.compiler.is_compiling()``), set while
    AOTAutograd traces on the first call (after Dynamo's session has ended)."""
    return torch.compiler._compile_session_context()


def compile_backend(inner: str | Callable[..., Any] = "inductor") -> Callable[..., Any]:
    """A ``torch.compile`` backend for code on shardwise Tensors: each Dynamo graph
    becomes one graph of local torch ops and functional collectives, differentiated
    by AOTAutograd on the buffers and compiled by ``inner``: ``"inductor"``,
    ``"aot_eager"`` (traced, not compiled), or a function ``(graph, example_inputs)
    -> callable`` given the forward and the backward graph (e.g. to look at them).

    Each torch function on a shardwise Tensor is a node of Dynamo's graph, and so are
    a parallelized module's input and output hooks; relayouts become torch's
    functional collectives in a process world (all_reduce, even all_gather and
    reduce_scatter so far) and local ops on the simulated mesh. Dynamic shapes
    (``dynamic=True``, or Dynamo's automatic dynamic after new sizes) keep one graph
    over changing sizes of dims that no relayout moves blocks along
    (:mod:`shardwise.tensors.symbolic`; other dims are specialised).
    ``torch.compile(model)`` (inductor) and ``backend="aot_eager"`` come here for a graph
    with shardwise Tensor inputs; other AOTAutograd backends work under
    ``torch.no_grad()`` only: their AOTAutograd would differentiate the wrapper, and
    refuses to.

    >>> relu = torch.compile(torch.nn.ReLU(), backend=compile_backend("aot_eager"),
    ...                      dynamic=False)
    >>> relu(torch.tensor([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """
    if isinstance(inner, str) and inner not in INNER:
        raise ShardingError(
            f"compile_backend(inner={inner!r}): the inner compiler is one of {INNER}. "
            "Got an unknown name; pass 'inductor' to compile, 'aot_eager' to trace only.")
    return _backend(inner)


def _backend(inner: str | Callable[..., Any], patches: dict[str, Any] | None = None
             ) -> Callable[..., Any]:
    """:func:`compile_backend` (``inner`` checked), with inductor ``patches``."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        error = graph_breaks.strict_error()
        if error is not None:  # strict mode: the frame broke; none of it runs

            def refuse(*args: Any) -> Any:
                if is_strict():
                    raise error
                return gm(*args)  # (strict mode ended: the graph runs, uncompiled)

            return refuse
        for check in ON_COMPILE:
            check()
        flat_examples, in_specs = _take_apart(example_inputs)
        in_specs = _traced_sizes(gm, in_specs)
        out_specs: list[tuple[bool, list[Spec]]] = []

        def on_buffers(*flat: Any) -> tuple[Any, ...]:
            outs = gm(*_rebuild(flat, in_specs))
            single = not isinstance(outs, (tuple, list))
            got, specs = _take_apart([outs] if single else list(outs))
            out_specs[:] = [(single, [_sized(spec) for spec in specs])]  # (alike each trace)
            return tuple(got)

        fw, bw, decompositions = _compilers(inner, patches)
        # traced now, on Dynamo's fake inputs: their symbolic sizes (dynamic shapes)
        # stay symbols of the graph, where inputs traced on the first call were concrete
        with _compiling():
            compiled = aot_module_simplified(
                _Module(on_buffers),  # type: ignore[arg-type]  # (any module serves)
                flat_examples, fw_compiler=fw, bw_compiler=bw,
                partition_fn=min_cut_rematerialization_partition,
                decompositions=decompositions)
        single, specs = out_specs[0]
        # (an output of symbolic size: read from its buffers per call; else nothing to read)
        sized = any(spec is not None and min(spec[2], default=0) < 0 for spec in specs)

        def run(*args: Any) -> Any:
            outs = _rebuild(compiled(*_buffers_of(args)), specs, sized)
            return outs[0] if single else type(outs)(outs)

        return run

    return backend


# --- torch.compile(model): torch's own backends, on graphs of shardwise Tensors ------------
def _holds_shardwise(example_inputs: Any) -> bool:
    return any(isinstance(x, Tensor) for x in example_inputs)


def _route_torch_backends() -> None:
    """Make ``torch.compile(model)`` (inductor, any ``mode`` and ``options``) and
    ``backend="aot_eager"`` compile a graph whose inputs include shardwise Tensors as
    :func:`compile_backend` does; every other graph goes to torch's backend untouched.
    Why: torch's backends run AOTAutograd on the wrappers, which hold no autograd state
    (a shardwise Tensor's autograd runs on its buffers), so a training step could not
    compile without naming this module's backend, where DTensor's compiles under
    ``torch.compile(model)``. Installed once, when shardwise is imported."""
    wrapper = torch._TorchCompileInductorWrapper
    if getattr(wrapper.__call__, "_shardwise", False):
        return
    original = wrapper.__call__

    def call(self: Any, model_: Any, inputs_: Any, *, config_patches: Any = None) -> Any:
        if _holds_shardwise(inputs_):
            return _backend("inductor", {**self.config, **(config_patches or {})})(
                model_, inputs_)
        return original(self, model_, inputs_, config_patches=config_patches)

    call._shardwise = True  # type: ignore[attr-defined]
    wrapper.__call__ = call  # type: ignore[method-assign]

    from torch._dynamo.backends import registry

    plain = registry.lookup_backend("aot_eager")
    if getattr(plain, "_shardwise", False):
        return

    def aot_eager(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if _holds_shardwise(example_inputs) and not kwargs:
            return _backend("aot_eager")(gm, example_inputs)
        return plain(gm, example_inputs, **kwargs)

    aot_eager._shardwise = True  # type: ignore[attr-defined]
    registry._COMPILER_FNS["aot_eager"] = aot_eager


_route_torch_backends()
