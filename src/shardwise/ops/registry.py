"""The op registry's shared parts: ``register``, the fallback, argument helpers.

Invariants:
- :func:`register` maps torch functions to handlers in ``shardwise.tensors.tensor.HANDLERS``;
  each family module (``elementwise``, ``shapes``, ``reductions``...) calls it right above
  each handler, at import, and :mod:`shardwise.ops.torch_api` imports every family.
- The public names here are the helpers the families share; a helper one family uses
  lives in that family.
- The fallback never gives a wrong value: an op without a rule runs on the gathered
  global operands and returns a Replicated result; each run is reported to
  :mod:`shardwise.ops.fallbacks` first (strict mode raises there; listeners; the
  warning once per op by name, :class:`ShardwiseFallbackWarning`) and its gathers
  count as ``"fallback_gather"`` in CommCounter. An in-place op without a rule
  raises, naming the op, unless its target is fully Replicated (then it runs on the
  whole value, reported alike). The running stats that batch and instance norm
  update in place (with no ``_`` ending their name) are copied back into their
  Tensors. Readers gather silently; metadata comes from the wrapper.
- ``out=``: :func:`write_out` runs the op without it and copies each result into its
  ``out`` tensor (the router sends every call with ``out=`` there).
- Plain torch tensors mixed with shardwise Tensors are Replicated on their mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops import fallbacks
from shardwise.ops.fallbacks import ShardwiseFallbackWarning
from shardwise.runtime import observe
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.tensors.tensor import HANDLERS, Tensor, place, route

__all__ = ["ShardwiseFallbackWarning", "TensorMethod", "describe", "fallback", "on_mesh",
           "reduce_dims", "refuse_write", "register", "shape_args", "type_name", "write_out"]

TensorMethod = torch.Tensor


def register(*funcs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Route the torch functions ``funcs`` to the decorated handler.

    >>> @register(torch.special.entr)          # elementwise: no communication
    ... def entr(x):
    ...     return x.map_blocks(torch.special.entr)
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> t = shardwise.tensor([0.5, 1.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> torch.special.entr(t).dist_layout == t.dist_layout
    True
    >>> del HANDLERS[torch.special.entr]
    """
    def deco(handler: Callable[..., Any]) -> Callable[..., Any]:
        for f in funcs:
            if f is not None:
                HANDLERS[f] = handler
        return handler

    return deco


def shape_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    """A size given as ``f(2, 3)`` or ``f((2, 3))``, as a tuple of ints.

    >>> shape_args((2, 3)), shape_args(([2, 3],)), shape_args((torch.Size([4]),))
    ((2, 3), (2, 3), (4,))
    """
    sizes: Sequence[Any] = args
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        sizes = args[0]
    # a symbolic size (torch.compile's dynamic shapes) stays one: int() would guard on it
    return tuple(s if type(s) is int or isinstance(s, torch.SymInt) else int(s)  # type: ignore[misc]
                 for s in sizes)


def reduce_dims(x: Any, dim: Any, what: str = "dim") -> tuple[int, ...]:
    """The dims ``dim`` names (an int, a sequence, or None: all), normalized, sorted;
    ``what`` names the argument in the error of a dim out of range.

    >>> x = torch.zeros(2, 3, 4)
    >>> reduce_dims(x, None), reduce_dims(x, -1), reduce_dims(x, (2, 0), "flip dims")
    ((0, 1, 2), (2,), (0, 2))
    """
    if dim is None:
        return tuple(range(x.ndim))
    ds = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({normalize_dim(d, max(x.ndim, 1), what) for d in ds})) if x.ndim else ()


def on_mesh(tensors: Sequence[Any]) -> list[Tensor]:
    """Tensors of one op on the first one's mesh (plain tensors become Replicated).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> a, b = on_mesh([x, torch.ones(2)])
    >>> a is x, str(b.dist_layout)
    (True, 'DeviceMesh(x=2)[R]')
    """
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    if first is None:
        raise ShardingTypeError("expected at least one shardwise.Tensor among the operands.")
    return [t if isinstance(t, Tensor) else place(torch.as_tensor(t), Layout.replicated(
        first.mesh, torch.as_tensor(t).ndim)) for t in tensors]


# --- metadata and the fallback ------------------------------------------------------------
def _meta_funcs() -> set[Any]:
    methods = ("is_floating_point", "is_complex", "element_size", "is_contiguous", "stride",
               "get_device", "is_signed", "storage_offset", "__len__", "is_inference",
               "is_set_to", "dim_order", "__format__")
    getters = ("is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_nested",
               "is_mkldnn", "itemsize", "nbytes", "is_sparse_csr", "output_nr", "_version",
               "_base", "is_xpu", "is_mps")
    out = {getattr(TensorMethod, m) for m in methods if hasattr(TensorMethod, m)}
    out |= {getattr(TensorMethod, g).__get__ for g in getters if hasattr(TensorMethod, g)}
    out |= {torch.is_floating_point, torch.is_complex, torch.is_tensor, torch.is_inference}
    return out


_META = _meta_funcs()
_READ = {TensorMethod.__format__, TensorMethod.__array__, torch.equal, TensorMethod.equal,
         torch.allclose, TensorMethod.allclose, TensorMethod.__float__, TensorMethod.__int__,
         TensorMethod.__index__, TensorMethod.__complex__}
_WARNED = fallbacks._WARNED  # the ops warned about (one set; fallbacks.forget_warnings)
#: ops that update operands in place (running stats) with no ``_`` ending their name
_WRITES_STATS = {f for f in (
    torch.nn.functional.batch_norm, torch.nn.functional.instance_norm, torch.batch_norm,
    torch.instance_norm, torch.native_batch_norm,
    getattr(torch, "_native_batch_norm_legit", None),
    torch.ops.aten._batch_norm_with_update, torch.ops.aten._batch_norm_with_update.default)
    if f is not None}
# x += y and friends (not __int__, __index__, __invert__: they only share the prefix)
_INPLACE_DUNDERS = {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "mod", "pow", "and", "or",
    "xor", "lshift", "rshift")}


def describe(args: Sequence[Any]) -> str:
    """The shardwise and torch tensors among ``args``, for an error message.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> describe((x, torch.ones(3), 2.0))
    'shape [2] DeviceMesh(x=2)[S(x)]; torch shape [3]'
    """
    parts = []
    for a in args:
        if isinstance(a, Tensor):
            parts.append(f"shape {list(a.shape)} {a.dist_layout}")
        elif isinstance(a, torch.Tensor):
            parts.append(f"torch shape {list(a.shape)}")
    return "; ".join(parts)


# torch's C namespaces, spelled as users call them (torch._C._special.special_i0e is
# torch.special.i0e)
_NAMESPACES = {"torch._C._special": "torch.special", "torch._C._linalg": "torch.linalg",
               "torch._C._fft": "torch.fft", "torch._C._nn": "torch._C._nn"}


def _name(func: Any) -> str:
    """The op as users spell it, for messages: ``torch.cummax``, ``torch.Tensor.rot90``,
    ``torch.special.i0e``, ``torch.nn.functional.cross_entropy``.

    >>> _name(torch.cummax), _name(torch.Tensor.rot90), _name(torch.special.i0e)
    ('torch.cummax', 'torch.Tensor.rot90', 'torch.special.i0e')
    >>> _name(torch.unique)  # a wrapper made by torch's boolean_dispatch
    'torch.unique'
    >>> _name(torch.ops.aten.mul.Tensor)
    'aten.mul.Tensor'
    """
    if isinstance(func, torch._ops.OpOverload):  # an aten op (under torch.func transforms)
        return str(func)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if "<locals>" in str(name):  # a made function (boolean_dispatch): its given name
        name = getattr(func, "__name__", name)
    module = getattr(func, "__module__", None)
    if module == "torch.functional":  # torch.unique, torch.stft...: torch's own names
        module = "torch"
    cls, _, short = str(name).rpartition(".")
    if cls == "_VariableFunctionsClass":
        return f"torch.{short}"
    if cls == "TensorBase":
        return f"torch.Tensor.{short}"
    space = _NAMESPACES.get(module or "")
    if space is not None:
        prefix = space.rpartition(".")[2] + "_"
        return f"{space}.{name[len(prefix):] if name.startswith(prefix) else name}"
    return f"{module}.{name}" if module and module not in ("torch._C", None) else str(name)


def _gather(a: Any, seen: list[tuple[Tensor, torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """``a`` with every Tensor gathered; with ``seen``, each Tensor that needs no grad
    is listed with its gathered value and a copy of it (to find what the op wrote)."""
    if isinstance(a, Tensor):
        g = a.to_torch()
        if seen is not None and not a.requires_grad:
            seen.append((a, g, g.clone()))
        return g
    if isinstance(a, (list, tuple)):
        return type(a)(_gather(v, seen) for v in a)
    if isinstance(a, dict):
        return {k: _gather(v, seen) for k, v in a.items()}
    return a


def _mesh_of(args: Any) -> Tensor | None:
    for a in args:
        if isinstance(a, Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _mesh_of(a)
            if t is not None:
                return t
    return None


def refuse_write(name: str, args: Sequence[Any]) -> ShardingError:
    """The error for an in-place write or ``out=`` without a sharding rule (writing into
    a gathered copy would be lost silently).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> print(refuse_write("cat(..., out=)", [x]))  # doctest: +ELLIPSIS
    cat(..., out=) writes in place and has no sharding rule ... (shape [2] DeviceMesh(x=2)[S(x)])...
    """
    return ShardingError(
        f"{name} writes in place and has no sharding rule for a shardwise.Tensor "
        f"({describe(args)}). Use the out-of-place op (x = op(x, ...)), or gather "
        "with x.to_torch() and re-shard the result."
    )


def fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
             plain: bool = False) -> Any:
    """No rule: metadata from the wrapper, readers on gathered values, otherwise run on
    gathered operands and return Replicated results (warning once per op); with
    ``plain``, the plain torch results themselves (the global values). An in-place
    op or ``out=`` call raises: writing into a gathered copy would be lost silently.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> fallback(torch.equal, (x, x), {})  # a reader: gathers silently
    True
    >>> fallback(torch.Tensor.exp_, (x,), {})
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: torch.Tensor.exp_ writes in place and has no ...
    """
    if func in _META and func not in _READ:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    name = _name(func)
    short = getattr(func, "__name__", "")
    if (short.endswith("_") and not short.endswith("__")) or short in _INPLACE_DUNDERS or (
            kwargs.get("out") is not None) or short == "__setitem__":
        target = args[0] if args else None
        if (isinstance(target, Tensor) and target.dist_layout.is_fully_replicated
                and kwargs.get("out") is None):
            return _write_replicated(func, name, target, args, kwargs)
        raise refuse_write(name, args)
    like = _mesh_of(list(args) + list(kwargs.values()))
    # batch norm writes its running stats in place with no _ ending its name, and bumps
    # no version counter: the operands are compared with copies after the call
    seen: list[tuple[Tensor, torch.Tensor, torch.Tensor]] | None = (
        [] if func in _WRITES_STATS else None)
    if func in _READ:
        plain_args, plain_kwargs = _gather(args, seen), _gather(kwargs, seen)
    else:
        fallbacks.report(name, (args, kwargs), lambda: describe(list(args) + list(
            kwargs.values())))
        with observe.counted_as("fallback_gather"):
            plain_args, plain_kwargs = _gather(args, seen), _gather(kwargs, seen)
    result = func(*plain_args, **plain_kwargs)
    for t, g, before in seen or ():  # the running stats it updated land in the Tensors
        if not torch.equal(g, before):
            t.copy_(g)
    if func in _READ or like is None or plain:
        return result
    return _replicate(result, like)


def _write_replicated(func: Any, name: str, target: Tensor, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """An in-place write without a rule into a fully Replicated target (``x[idx] = v``,
    ``index_add_``...): every device holds the whole value, so the write runs on it (the
    whole, else each distinct block once) with the other operands gathered; the target
    stays the same Tensor, as torch's in-place ops return it."""
    fallbacks.report(name, (args[1:], kwargs), lambda: describe(args))
    with observe.counted_as("fallback_gather"):
        rest_args, plain_kwargs = _gather(args[1:]), _gather(kwargs)
    for buffer in target.held.buffers():
        func(buffer, *rest_args, **plain_kwargs)
    return target if func is not TensorMethod.__setitem__ else None


def _replicate(result: Any, like: Tensor) -> Any:
    if isinstance(result, torch.Tensor) and not isinstance(result, Tensor):
        return place(result, Layout.replicated(like.mesh, result.ndim))
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        return type(result)(tuple(_replicate(r, like) for r in result))
    if isinstance(result, (list, tuple)):
        return type(result)(_replicate(r, like) for r in result)
    return result


def write_out(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` given ``out=``: the op runs without it (on its rule, or
    the fallback), then each result is cast and copied into its ``out`` tensor, relaid
    out to that tensor's layout. A plain torch ``out`` receives the global value and is
    resized as torch would; a shardwise ``out`` keeps its shape, so it must have the
    result's. Autograd is refused, as torch refuses it.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> out = shardwise.tensor([0.0, 0.0], sharding=PlacementMapping(mesh, [Replicated()]))
    >>> torch.add(x, x, out=out) is out, out.to_torch().tolist()
    (True, [2.0, 4.0])
    """
    rest = {k: v for k, v in kwargs.items() if k != "out"}
    out = kwargs["out"]
    name = _name(func)
    if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (*args, *rest.values(), *(out if isinstance(out, (list, tuple)) else [out]))):
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support "
                           "automatic differentiation, but one of the arguments requires grad.")
    result = route(func, args, rest)
    outs = tuple(out) if isinstance(out, (list, tuple)) else (out,)
    results = tuple(result) if isinstance(result, (list, tuple)) else (result,)
    if len(outs) != len(results):
        raise ShardingError(f"{name}: out= gives {len(outs)} tensors for {len(results)} "
                            "results; give one per result.")
    for o, r in zip(outs, results):
        _write_one(name, o, r)
    if isinstance(result, tuple) and type(result) is not tuple:  # torch.return_types.max
        return type(result)(outs)
    return out


def _write_one(name: str, out: Any, result: Any) -> None:
    if not torch.can_cast(result.dtype, out.dtype):  # torch's check and message
        raise RuntimeError(f"result type {type_name(result.dtype)} can't be cast to the "
                           f"desired output type {type_name(out.dtype)}")
    if isinstance(out, Tensor):
        if out.shape != result.shape:
            raise ShardingError(
                f"{name}: out= has shape {list(out.shape)} but the result has shape "
                f"{list(result.shape)}; torch would resize out, and a shardwise.Tensor keeps "
                "its shape and layout. Give an out of the result's shape, or use the "
                "returned value.")
        out.copy_(result)
        return
    value = result.to_torch() if isinstance(result, Tensor) else result
    if out.shape != value.shape:
        out.resize_(value.shape)
    out.copy_(value)


def type_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype in its casting errors (``Float``, ``Long``, ``Bool``)."""
    return torch.empty((), dtype=dtype).type().rpartition(".")[2].removesuffix("Tensor")
