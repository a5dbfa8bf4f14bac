"""The op registry's shared parts: ``register``, the fallback, operand helpers.

Invariants:
- :func:`register` maps torch functions to handlers in ``shardwise.tensors.tensor.HANDLERS``;
  the installers of :mod:`shardwise.ops.torch_api` call it once at import.
- The fallback never gives a wrong value: an op without a rule runs on the gathered
  global operands and returns a Replicated result, warning once per op by name
  (:class:`ShardwiseFallbackWarning`); an in-place op or ``out=`` call without a rule
  raises, naming the op. Readers gather silently; metadata comes from the wrapper.
- Plain torch tensors mixed with shardwise Tensors are Replicated on their mesh.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import HANDLERS, Tensor, place

__all__ = ["ShardwiseFallbackWarning", "TensorMethod", "register"]

TensorMethod = torch.Tensor


class ShardwiseFallbackWarning(UserWarning):
    """A torch op without a sharding rule ran on gathered (replicated) operands."""


def register(*funcs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Route the torch functions ``funcs`` to the decorated handler.

    >>> @register(torch.special.entr)          # elementwise: no communication
    ... def entr(x):
    ...     return x._map_unique(torch.special.entr)
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


def _aliases(name: str) -> list[Any]:
    """``torch.name``, ``Tensor.name``, ``F.name``, ``torch.special.name`` that exist."""
    return [getattr(mod, name, None) for mod in (torch, TensorMethod, F, torch.special)]


def _is_operand(a: Any) -> bool:
    return isinstance(a, torch.Tensor) or (
        isinstance(a, numbers.Number) and not isinstance(a, bool))


def _shape_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return tuple(int(s) for s in args[0])
    return tuple(int(s) for s in args)


def _zeros(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    z = torch.zeros((), dtype=like.dtype, device=like.device).expand(shape)
    return place(z, Layout.replicated(like.mesh, len(shape)))


def _on_mesh(tensors: Sequence[Any]) -> list[Tensor]:
    """Tensors of one op on the first one's mesh (plain tensors become Replicated)."""
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
_WARNED: set[str] = set()
# x += y and friends (not __int__, __index__, __invert__: they only share the prefix)
_INPLACE_DUNDERS = {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "mod", "pow", "and", "or",
    "xor", "lshift", "rshift")}


def _describe(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, Tensor):
            parts.append(f"shape {list(a.shape)} {a.dist_layout}")
        elif isinstance(a, torch.Tensor):
            parts.append(f"torch shape {list(a.shape)}")
    return "; ".join(parts)


def _name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and module not in ("torch._C", None) else str(name)


def _gather(a: Any) -> Any:
    if isinstance(a, Tensor):
        return a.to_torch()
    if isinstance(a, (list, tuple)):
        return type(a)(_gather(v) for v in a)
    if isinstance(a, dict):
        return {k: _gather(v) for k, v in a.items()}
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


def _fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """No rule: metadata from the wrapper, readers on gathered values, otherwise run on
    gathered operands and return Replicated results (warning once per op)."""
    if func in _META and func not in _READ:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    name = _name(func)
    short = getattr(func, "__name__", "")
    if (short.endswith("_") and not short.endswith("__")) or short in _INPLACE_DUNDERS or (
            "out" in kwargs) or short == "__setitem__":
        raise ShardingError(
            f"{name} writes in place and has no sharding rule for a shardwise.Tensor "
            f"({_describe(args)}). Use the out-of-place op (x = op(x, ...)), or gather "
            "with x.to_torch() and re-shard the result."
        )
    like = _mesh_of(list(args) + list(kwargs.values()))
    plain_args, plain_kwargs = _gather(args), _gather(kwargs)
    if func not in _READ and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(ShardwiseFallbackWarning(
            f"{name} has no sharding rule: it ran on the gathered global operands "
            f"({_describe(args)}) and its result is Replicated. Values are exact; the "
            "communication and memory are not sharded."), stacklevel=3)
    result = func(*plain_args, **plain_kwargs)
    if func in _READ or like is None:
        return result
    return _replicate(result, like)


def _replicate(result: Any, like: Tensor) -> Any:
    if isinstance(result, torch.Tensor) and not isinstance(result, Tensor):
        return place(result, Layout.replicated(like.mesh, result.ndim))
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        return type(result)(tuple(_replicate(r, like) for r in result))
    if isinstance(result, (list, tuple)):
        return type(result)(_replicate(r, like) for r in result)
    return result
