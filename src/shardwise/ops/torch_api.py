"""torch functions on shardwise Tensors: the registry behind ``Tensor.__torch_function__``.

Every ``torch.*`` function, ``Tensor`` method or operator and ``torch.nn.functional``
op called with a shardwise Tensor arrives here as ``(func, args, kwargs)``.

Invariants:
- Each call resolves to exactly one of: a registered handler (sharding propagation
  through :func:`shardwise.ops.execute.apply`, values equal to torch's on the global
  tensor), a metadata query answered by the wrapper itself, or the fallback.
- The fallback never gives a wrong value: an op without a rule runs on the gathered
  global operands and returns a Replicated result, warning once per op by name
  (:class:`ShardwiseFallbackWarning`); an in-place op or ``out=`` call without a rule
  raises, naming the op (writing into a gathered copy would be lost silently).
- In-place ops write each distinct local buffer once (replicas share one buffer), so
  ``torch.optim`` updates a sharded parameter exactly as it would the global one.
- Plain torch tensors mixed with shardwise Tensors are treated as Replicated on the
  Tensor's mesh (every process must hold the same value), like JAX's numpy arrays.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute as C
from shardwise.ops.execute import apply, apply_elementwise
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout, normalize_dim
from shardwise.tensors import FALLBACK, HANDLERS, Tensor, place

__all__ = ["ShardwiseFallbackWarning", "register"]

TensorMethod = torch.Tensor


class ShardwiseFallbackWarning(UserWarning):
    """A torch op without a sharding rule ran on gathered (replicated) operands."""


def register(*funcs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Route the torch functions ``funcs`` to the decorated handler."""
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


# --- elementwise ------------------------------------------------------------------------
def _elementwise(rule: str, func: Any) -> Callable[..., Any]:
    """A handler running ``func`` per local block; tensors and numbers among the
    positional arguments are its operands, everything else passes through."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        if not kwargs and all(isinstance(a, (torch.Tensor, int, float)) and not isinstance(
                a, bool) for a in args):
            return apply_elementwise(rule, args, func)  # every argument is an operand
        pos = [i for i, a in enumerate(args) if _is_operand(a)]
        kws = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        operands = [args[i] for i in pos] + [kwargs[k] for k in kws]
        npos = len(pos)

        def local(*blocks: Any) -> torch.Tensor:
            call = list(args)
            for i, b in zip(pos, blocks):
                call[i] = b
            kw = dict(kwargs)
            for k, b in zip(kws, blocks[npos:]):
                kw[k] = b
            return func(*call, **kw)

        return apply_elementwise(rule, operands, local)

    return handler


_LINEAR = {"add": "add", "sub": "sub", "subtract": "sub", "neg": "neg", "negative": "neg",
           "positive": "ew_linear", "mul": "mul", "multiply": "mul", "div": "div",
           "divide": "div", "true_divide": "div"}
_NONLINEAR = [
    "abs", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "pow",
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where",
    "rsqrt", "reciprocal", "sin", "cos", "erf", "exp2", "expm1", "log1p", "log2", "log10",
    "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "square", "logical_not",
    "isnan", "isinf", "isfinite", "bitwise_not", "nan_to_num", "clamp", "clip", "clamp_min",
    "clamp_max", "leaky_relu", "elu", "softplus", "hardtanh", "mish", "hardswish",
    "hardsigmoid", "relu6", "logit", "float_power", "fmax", "fmin", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "masked_fill",
    "lerp", "addcmul", "addcdiv", "atan2", "remainder", "fmod", "floor_divide", "copysign",
    "hypot", "xlogy", "threshold", "logsigmoid", "softsign", "tanhshrink", "greater",
    "greater_equal", "less", "less_equal", "not_equal", "absolute", "arctan2",
]
_RULE_OF = {"clip": "clamp", "absolute": "abs", "arctan2": "atan2", "greater": "gt",
            "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
            "logsigmoid": "log_sigmoid", "relu6": "relu6"}

_DUNDERS = {"__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub",
            "__mul__": "mul", "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div",
            "__div__": "div", "__rdiv__": "div", "__pow__": "pow", "__rpow__": "pow",
            "__neg__": "neg", "__abs__": "abs", "__eq__": "eq", "__ne__": "ne",
            "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
            "__and__": "logical_and", "__or__": "logical_or", "__xor__": "logical_xor",
            "__invert__": "bitwise_not", "__floordiv__": "floor_divide",
            "__rfloordiv__": "floor_divide", "__mod__": "remainder"}
_REFLECTED = {"__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__rdiv__", "__rpow__",
              "__rfloordiv__"}


def _install_elementwise() -> None:
    # each alias runs itself on the blocks, so its own keywords (F.relu's inplace=,
    # F.gelu's approximate=) keep torch's meaning
    for name, rule in _LINEAR.items():
        for f in _aliases(name):
            if f is not None:
                register(f)(_elementwise(rule, f))
    for name in _NONLINEAR:
        rule = _RULE_OF.get(name, name)
        for f in _aliases(name):
            if f is not None:
                register(f)(_elementwise(rule, f))
    for dunder, name in _DUNDERS.items():
        base = getattr(torch, name, None) or getattr(TensorMethod, name)
        rule = _LINEAR.get(name) or _RULE_OF.get(name, name)
        if dunder in _REFLECTED:
            def reflected(a: Any, b: Any, _base: Any = base, _rule: str = rule) -> Any:
                if not _is_operand(b):
                    return NotImplemented
                return _elementwise(_rule, _base)(b, a)

            register(getattr(TensorMethod, dunder))(reflected)
        else:
            plain = _elementwise(rule, base)

            def forward(*args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
                if len(args) > 1 and not _is_operand(args[1]):
                    return NotImplemented
                return _plain(*args, **kwargs)

            register(getattr(TensorMethod, dunder))(forward)
    # nonlinear rounding division: a Partial numerator must be reduced first
    div_plain = _elementwise("div", torch.div)
    div_round = _elementwise("div_rounding", torch.div)

    @register(torch.div, TensorMethod.div, torch.divide, TensorMethod.divide)
    def div(*args: Any, **kwargs: Any) -> Any:
        return (div_round if kwargs.get("rounding_mode") is not None else div_plain)(
            *args, **kwargs)


# --- in place: write each distinct local buffer once --------------------------------------
def _target(x: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ShardingTypeError(
            f"{name}: the tensor written in place is a {type(x).__name__}, but an operand is "
            "a shardwise.Tensor. Write into a shardwise.Tensor, or gather the operand first "
            "with .to_torch()."
        )
    return x


def _write(self: Tensor, value: Tensor, name: str) -> Tensor:
    """Copy ``value`` (same global shape) into ``self``'s own buffers."""
    if value.shape != self.shape:
        raise ShardingError(
            f"{name}: the result has shape {tuple(value.shape)} but the tensor written in "
            f"place has shape {tuple(self.shape)}; in-place ops cannot change the shape."
        )
    if self.dist_layout.is_partial:
        raise ShardingError(
            f"{name} on {self!r}: a Partial tensor cannot be written in place (its devices "
            "hold addends, not the value). Reduce it first (x = x.redistribute(...) or "
            "shardwise.all_reduce(x))."
        )
    src = value.relayout(self.dist_layout) if value.mesh == self.mesh else None
    if src is None:
        raise ShardingError(f"{name}: the operands live on {value.mesh!r} and {self.mesh!r}.")
    seen: set[int] = set()
    for s, v in zip(self._shards, src._shards):
        if s is not None and id(s) not in seen:
            seen.add(id(s))
            s.copy_(v)
    return self


def _same_layout_rows(self: Tensor, operands: Sequence[Any]) -> bool:
    lay = self.dist_layout
    if lay.is_partial:
        return False
    for a in operands:
        if isinstance(a, Tensor):
            if a.dist_layout != lay and not (a.ndim == 0 and not a.dist_layout.is_partial):
                return False
        elif isinstance(a, torch.Tensor) and a.ndim != 0:
            return False
    return True


def _inplace(name: str, method: Any, out_of_place: Callable[..., Any] | None
             ) -> Callable[..., Any]:
    """``x.op_(...)``: run ``method`` on each distinct local buffer when every operand
    is laid out like ``x``; else compute ``out_of_place`` and copy it into ``x``."""

    def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = _target(self, name)
        if _same_layout_rows(t, list(args) + list(kwargs.values())):
            seen: set[int] = set()
            for k, s in enumerate(t._shards):
                if s is None or id(s) in seen:
                    continue
                seen.add(id(s))
                call = [a._shards[k] if isinstance(a, Tensor) else a for a in args]
                kw = {key: (v._shards[k] if isinstance(v, Tensor) else v)
                      for key, v in kwargs.items()}
                method(s, *call, **kw)
            return t
        if out_of_place is None:
            raise ShardingError(
                f"{name} has no sharding rule for these operands ({_describe((self, *args))}). "
                "Lay the operands out like the tensor written in place, or use the "
                "out-of-place op."
            )
        return _write(t, out_of_place(t, *args, **kwargs), name)

    return handler


def _install_inplace() -> None:
    names = set(_LINEAR) | set(_NONLINEAR) | {"copy", "zero", "fill", "uniform", "normal"}
    for name in sorted(names):
        method = getattr(TensorMethod, name + "_", None)
        if method is None:
            continue
        out = HANDLERS.get(getattr(TensorMethod, name, None))
        register(method)(_inplace(name + "_", method, out))
    for dunder, name in (("__iadd__", "add"), ("__isub__", "sub"), ("__imul__", "mul"),
                         ("__itruediv__", "div"), ("__ipow__", "pow")):
        register(getattr(TensorMethod, dunder))(
            _inplace(dunder, getattr(TensorMethod, name + "_"),
                     HANDLERS[getattr(TensorMethod, name)]))

    @register(TensorMethod.copy_)
    def copy_(self: Any, src: Any, non_blocking: bool = False) -> Any:
        t = _target(self, "copy_")
        if isinstance(src, Tensor):
            value: Tensor = src if src.dtype == t.dtype else _to(src, t.dtype)
            if value.shape != t.shape:
                value = C.add(value, zeros_like(t))  # broadcast to t's shape
            return _write(t, value, "copy_")
        value = torch.as_tensor(src).to(t.dtype).expand(t.shape)  # type: ignore[assignment]
        return _write(t, place(value, Layout.replicated(t.mesh, t.ndim)), "copy_")

    @register(TensorMethod.zero_)
    def zero_(self: Any) -> Any:
        t = _target(self, "zero_")
        for s in {id(s): s for s in t._shards if s is not None}.values():
            s.zero_()
        return t

    @register(TensorMethod.fill_)
    def fill_(self: Any, value: Any) -> Any:
        t = _target(self, "fill_")
        if t.dist_layout.is_partial:
            raise ShardingError(f"fill_ on the Partial tensor {t!r}: reduce it first.")
        v = value.item() if isinstance(value, torch.Tensor) else value
        for s in {id(s): s for s in t._shards if s is not None}.values():
            s.fill_(v)
        return t


# --- foreach (torch.optim, clip_grad_norm_) -----------------------------------------------
def _foreach(name: str) -> Callable[..., Any]:
    """``torch._foreach_op(lists...)`` as the per-tensor op over the lists."""
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    plain = base.rstrip("_")
    per: Any = getattr(TensorMethod, base, None) if inplace else (
        getattr(torch, base, None) or getattr(TensorMethod, base, None))
    if base == "norm":
        per = torch.linalg.vector_norm
    if per is None and inplace and hasattr(torch, plain):
        op = getattr(torch, plain)

        def per(x: Any, *args: Any, **kwargs: Any) -> Any:
            return x.copy_(op(x, *args, **kwargs))
    if per is None:
        def per(*args: Any, **kwargs: Any) -> Any:
            raise ShardingError(f"torch.{name} has no shardwise rule; loop over the tensors "
                                "with the per-tensor op instead.")

    def handler(*args: Any, **kwargs: Any) -> Any:
        n = len(args[0])
        out = []
        for i in range(n):
            call = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = kwargs
            if plain in ("addcmul", "addcdiv") and len(call) > 3:  # value is keyword-only
                kw = {**kwargs, "value": call.pop()}
            out.append(per(*call, **kw))
        return None if inplace else out

    return handler


def _install_foreach() -> None:
    for attr in dir(torch):
        if attr.startswith("_foreach_"):
            register(getattr(torch, attr))(_foreach(attr))


# --- creation like an existing tensor -----------------------------------------------------
def zeros_like(x: Tensor) -> Tensor:
    return _like(torch.zeros_like, x)


def _like(fn: Any, x: Any, *args: Any, **kwargs: Any) -> Tensor:
    """``fn(x_block, ...)`` per distinct block, in x's layout without its Partial axes."""
    t = x if not x.dist_layout.is_partial else x.relayout(
        x.dist_layout.with_partial((None,) * x.mesh.ndim))
    kwargs.pop("memory_format", None)
    return t._map_unique(lambda s: fn(s, *args, **kwargs))


def _install_like() -> None:
    for name in ("zeros_like", "ones_like", "empty_like", "full_like"):
        fn = getattr(torch, name)
        register(fn)(functools.partial(_like, fn))

    def random_like(draw: Callable[..., torch.Tensor]) -> Callable[..., Any]:
        # drawn globally from torch's generator, then laid out: the same values as
        # single-device torch for the same seed
        def handler(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
            kwargs.pop("memory_format", None)
            kwargs.pop("device", None)
            g = draw(torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device), *args,
                     **kwargs)
            return place(g, x.dist_layout.with_partial((None,) * x.mesh.ndim))

        return handler

    register(torch.rand_like)(random_like(torch.rand_like))
    register(torch.randn_like)(random_like(torch.randn_like))
    register(torch.randint_like)(random_like(torch.randint_like))


# --- conversions, copies, views -----------------------------------------------------------
def _to(x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.to(dtype)`` / ``.to(device)`` / ``.to(other)``: dtype casts per block; the
    torch device must already be the shards' (move meshes with shardwise.to_device)."""
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    kwargs.pop("memory_format", None)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            dtype, device = a.dtype, a.device
    if device is not None and torch.device(device) != x.device:
        raise ShardingError(
            f"{x!r} lives on {x.device} shards; .to({device!r}) would move a distributed "
            "tensor's shards behind its mesh. Use shardwise.to_device(x, sharding=...) to "
            "move it to a mesh of other devices."
        )
    if dtype is None or dtype == x.dtype:
        return x
    return apply("to", (x,), lambda s: s.to(dtype))


def _install_conversions() -> None:
    register(TensorMethod.to)(_to)
    for name, dtype in (("float", torch.float32), ("double", torch.float64),
                        ("half", torch.float16), ("bfloat16", torch.bfloat16),
                        ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool)):
        register(getattr(TensorMethod, name))(
            lambda x, *a, _d=dtype, **k: _to(x, _d))

    @register(TensorMethod.type_as)
    def type_as(x: Any, other: Any) -> Any:
        return _to(x, other.dtype)

    @register(torch.clone, TensorMethod.clone)
    def clone(x: Any, memory_format: Any = None) -> Any:
        return apply("clone", (x,), torch.clone)

    @register(TensorMethod.contiguous)
    def contiguous(x: Any, memory_format: Any = None) -> Any:
        if all(s is None or s.is_contiguous() for s in x._shards):
            return x
        return x._map_unique(lambda s: s.contiguous())

    @register(TensorMethod.cpu)
    def cpu(x: Any, *args: Any, **kwargs: Any) -> Any:
        return _to(x, "cpu")

    @register(TensorMethod.conj, torch.conj, TensorMethod.resolve_conj, torch.resolve_conj,
              TensorMethod.resolve_neg, torch.resolve_neg)
    def conj(x: Any) -> Any:
        if x.is_complex():
            return x._map_unique(torch.conj)
        return x


def _shape_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return tuple(int(s) for s in args[0])
    return tuple(int(s) for s in args)


def _install_views() -> None:
    @register(TensorMethod.view, TensorMethod.reshape, torch.reshape)
    def reshape(x: Any, *shape: Any) -> Any:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise ShardingError("x.view(dtype) reinterprets bytes; use x.to(dtype) on a "
                                "shardwise.Tensor.")
        return C.reshape(x, _shape_args(shape))

    @register(TensorMethod.view_as, TensorMethod.reshape_as)
    def view_as(x: Any, other: Any) -> Any:
        return C.reshape(x, tuple(other.shape))

    @register(TensorMethod.permute, torch.permute)
    def permute(x: Any, *dims: Any) -> Any:
        return C.permute(x, _shape_args(dims))

    @register(TensorMethod.transpose, torch.transpose, TensorMethod.swapaxes, torch.swapaxes,
              TensorMethod.swapdims, torch.swapdims)
    def transpose(x: Any, dim0: int, dim1: int) -> Any:
        return C.transpose(x, dim0, dim1)

    @register(TensorMethod.t, torch.t)
    def t(x: Any) -> Any:
        return C.transpose(x, 0, 1) if x.ndim == 2 else x

    getter = "__get__"  # torch's property getters (not visible to mypy on the stubs)
    register(getattr(TensorMethod.T, getter))(
        lambda x: C.permute(x, tuple(reversed(range(x.ndim)))) if x.ndim != 0 else x)
    register(getattr(TensorMethod.mT, getter))(lambda x: C.transpose(x, -2, -1))

    @register(TensorMethod.flatten, torch.flatten)
    def flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
        if x.ndim == 0:
            return C.reshape(x, (1,))
        a = normalize_dim(start_dim, x.ndim, "flatten start_dim")
        b = normalize_dim(end_dim, x.ndim, "flatten end_dim")
        shape = (*x.shape[:a], math.prod(x.shape[a:b + 1]), *x.shape[b + 1:])
        return C.reshape(x, shape)

    @register(TensorMethod.unflatten, torch.unflatten)
    def unflatten(x: Any, dim: int, sizes: Sequence[int]) -> Any:
        d = normalize_dim(dim, x.ndim, "unflatten dim")
        sizes = list(sizes)
        if -1 in sizes:
            rest = math.prod(s for s in sizes if s != -1)
            sizes[sizes.index(-1)] = x.shape[d] // rest
        return C.reshape(x, (*x.shape[:d], *sizes, *x.shape[d + 1:]))

    @register(TensorMethod.squeeze, torch.squeeze)
    def squeeze(x: Any, dim: Any = None) -> Any:
        if dim is None:
            dims = {d for d, n in enumerate(x.shape) if n == 1}
        else:
            ds = dim if isinstance(dim, (list, tuple)) else (dim,)
            dims = {normalize_dim(d, max(x.ndim, 1), "squeeze dim") for d in ds}
            dims = {d for d in dims if x.ndim and x.shape[d] == 1}
        return C.reshape(x, tuple(n for d, n in enumerate(x.shape) if d not in dims))

    @register(TensorMethod.unsqueeze, torch.unsqueeze)
    def unsqueeze(x: Any, dim: int) -> Any:
        d = normalize_dim(dim, x.ndim + 1, "unsqueeze dim")
        return C.reshape(x, (*x.shape[:d], 1, *x.shape[d:]))

    @register(TensorMethod.expand)
    def expand(x: Any, *sizes: Any) -> Any:
        shape = _shape_args(sizes)
        lead = len(shape) - x.ndim
        full = tuple(x.shape[d - lead] if s == -1 else s for d, s in enumerate(shape))
        if full == tuple(x.shape):
            return x
        return C.add(x, _zeros(x, full))

    @register(TensorMethod.expand_as)
    def expand_as(x: Any, other: Any) -> Any:
        return expand(x, tuple(other.shape))

    @register(torch.cat, torch.concat, torch.concatenate)
    def cat(tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
        return C.cat(_on_mesh(tensors), dim)

    @register(torch.stack)
    def stack(tensors: Sequence[Any], dim: int = 0) -> Any:
        ts = _on_mesh(tensors)
        d = normalize_dim(dim, ts[0].ndim + 1, "stack dim")
        return C.cat([unsqueeze(t, d) for t in ts], d)

    @register(TensorMethod.narrow, torch.narrow)
    def narrow(x: Any, dim: int, start: int, length: int) -> Any:
        d = normalize_dim(dim, x.ndim, "narrow dim")
        return C.getitem(x, (slice(None),) * d + (slice(start, start + length),))

    @register(TensorMethod.select, torch.select)
    def select(x: Any, dim: int, index: int) -> Any:
        d = normalize_dim(dim, x.ndim, "select dim")
        return C.getitem(x, (slice(None),) * d + (index,))

    @register(TensorMethod.split, torch.split)
    def split(x: Any, split_size: Any, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "split dim")
        n = x.shape[d]
        sizes = ([split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
                 if isinstance(split_size, int) else list(split_size))
        out, start = [], 0
        for s in sizes:
            out.append(narrow(x, d, start, s))
            start += s
        return tuple(out)

    @register(TensorMethod.chunk, torch.chunk)
    def chunk(x: Any, chunks: int, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "chunk dim")
        return split(x, -(-x.shape[d] // chunks) if x.shape[d] else 1, d)

    @register(TensorMethod.unbind, torch.unbind)
    def unbind(x: Any, dim: int = 0) -> Any:
        d = normalize_dim(dim, x.ndim, "unbind dim")
        return tuple(select(x, d, i) for i in range(x.shape[d]))

    @register(TensorMethod.__iter__)
    def iterate(x: Any) -> Any:
        if x.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(unbind(x, 0))

    @register(TensorMethod.__getitem__)
    def getitem(x: Any, index: Any) -> Any:
        try:
            return C.getitem(x, index)
        except ShardingError as err:
            if "only basic indexing" not in str(err):
                raise
        return _fallback(TensorMethod.__getitem__, (x, index), {})

    for name in ("tril", "triu"):
        fn = getattr(torch, name)

        def handler(x: Any, diagonal: int = 0, _fn: Any = fn) -> Any:
            # the last two dims whole (the diagonal depends on global positions)
            return apply("normalize", (x,), lambda s: _fn(s, diagonal), 2)

        register(fn, getattr(TensorMethod, name))(handler)


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


# --- reductions ---------------------------------------------------------------------------
def _reduce_dims(x: Any, dim: Any) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.ndim))
    ds = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({normalize_dim(d, max(x.ndim, 1), "dim") for d in ds})) if x.ndim else ()


def _install_reductions() -> None:
    @register(torch.sum, TensorMethod.sum)
    def sum_(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        t = x if dtype is None else _to(x, dtype)
        return C.sum(t, dim, keepdim)

    @register(torch.mean, TensorMethod.mean)
    def mean(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        t = x if dtype is None else _to(x, dtype)
        return C.mean(t, dim, keepdim)

    register(torch.amax, TensorMethod.amax)(
        lambda x, dim=(), keepdim=False: C.amax(x, dim if dim != () else None, keepdim))
    register(torch.amin, TensorMethod.amin)(
        lambda x, dim=(), keepdim=False: C.amin(x, dim if dim != () else None, keepdim))

    def full_reduce(fn: Any) -> Callable[..., Any]:
        def handler(x: Any, dim: Any = None, keepdim: bool = False, *args: Any,
                    **kwargs: Any) -> Any:
            dims = _reduce_dims(x, dim)
            if dim is None:  # over everything: torch's no-dim overload
                return apply("reduce_full", (x,), lambda s: fn(s, *args, **kwargs), dims,
                             False)
            return apply("reduce_full", (x,), lambda s: fn(s, dim, keepdim, *args, **kwargs),
                         dims, keepdim)

        return handler

    for name in ("prod", "any", "all", "argmax", "argmin", "logsumexp", "median", "nansum",
                 "count_nonzero"):
        fn = getattr(torch, name)
        register(fn, getattr(TensorMethod, name, None))(full_reduce(fn))

    for name in ("var", "std"):
        fn = getattr(torch, name)

        def vs(x: Any, dim: Any = None, *args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            unbiased = kwargs.pop("unbiased", None)
            if args and isinstance(args[0], bool) and dim is not None and not isinstance(
                    dim, bool):
                unbiased, args = args[0], args[1:]
            if isinstance(dim, bool):  # var(x, unbiased)
                unbiased, dim = dim, None
            keepdim = kwargs.pop("keepdim", args[0] if args else False)
            correction = kwargs.pop("correction", None)
            if unbiased is not None:
                correction = 1 if unbiased else 0
            if correction is None:
                correction = 1
            dims = _reduce_dims(x, dim)
            return apply("reduce_full", (x,), lambda s: _fn(
                s, dims, correction=correction, keepdim=keepdim), dims, keepdim)

        register(fn, getattr(TensorMethod, name))(vs)

    def extreme(name: str, fn: Any, values: Any) -> Callable[..., Any]:
        def handler(x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
            if isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
                return HANDLERS[getattr(torch, "maximum" if name == "max" else "minimum")](
                    x, dim)
            if dim is None:
                return values(x, None, False)
            d = normalize_dim(dim, max(x.ndim, 1), f"{name} dim")
            vals = apply("reduce_full", (x,), lambda s: fn(s, d, keepdim)[0], (d,), keepdim)
            idx = apply("reduce_full", (x,), lambda s: fn(s, d, keepdim)[1], (d,), keepdim)
            kind = torch.return_types.max if name == "max" else torch.return_types.min
            return kind((vals, idx))

        return handler

    register(torch.max, TensorMethod.max)(extreme("max", torch.max, C.amax))
    register(torch.min, TensorMethod.min)(extreme("min", torch.min, C.amin))

    @register(torch.topk, TensorMethod.topk)
    def topk(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        d = normalize_dim(dim, max(x.ndim, 1), "topk dim")

        def run(i: int) -> Tensor:
            return apply("topk", (x,), lambda s: torch.topk(s, k, d, largest, sorted)[i], d, k)

        return torch.return_types.topk((run(0), run(1)))

    for name in ("cumsum", "cumprod", "log_softmax", "softmax"):
        fn = getattr(torch, name)

        def dimwise(x: Any, dim: Any = None, *args: Any, _fn: Any = fn, _name: str = name,
                    **kwargs: Any) -> Any:
            if dim is None:
                raise ShardingError(f"{_name} needs dim= (torch's implicit dim is deprecated).")
            d = normalize_dim(dim, max(x.ndim, 1), f"{_name} dim")
            dtype = kwargs.pop("dtype", args[0] if args else None)
            kwargs.pop("_stacklevel", None)
            return apply(_name, (x,), lambda s: _fn(s, d, dtype=dtype), d)

        register(fn, getattr(TensorMethod, name), getattr(F, name, None))(dimwise)

    @register(torch.linalg.vector_norm, torch.norm, TensorMethod.norm)
    def vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                    dtype: Any = None, p: Any = None, **kwargs: Any) -> Any:
        if p is not None:
            ord = p
        if isinstance(ord, str):
            if ord != "fro":
                return _fallback(torch.linalg.vector_norm, (x, ord, dim, keepdim), {})
            ord = 2
        t = x if dtype is None else _to(x, dtype)
        a = C.abs_(t)
        if ord == math.inf:
            return C.amax(a, dim, keepdim)
        if ord == -math.inf:
            return C.amin(a, dim, keepdim)
        if ord == 0:
            return C.sum(_to(C.ne(t, 0), t.dtype), dim, keepdim)
        if ord == 1:
            return C.sum(a, dim, keepdim)
        if ord == 2:
            return C.sqrt(C.sum(C.mul(a, a), dim, keepdim))
        return C.pow(C.sum(C.pow(a, ord), dim, keepdim), 1.0 / ord)


# --- neural-network ops -------------------------------------------------------------------
def _install_nn() -> None:
    @register(F.linear)
    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        y = apply("linear", (x, weight), F.linear)
        return y if bias is None else C.add(y, bias)

    @register(torch.matmul, TensorMethod.matmul, TensorMethod.__matmul__, torch.mm,
              TensorMethod.mm, torch.bmm, TensorMethod.bmm)
    def matmul(a: Any, b: Any) -> Any:
        return C.matmul(a, b)

    @register(TensorMethod.__rmatmul__)
    def rmatmul(a: Any, b: Any) -> Any:
        return C.matmul(b, a)

    @register(torch.einsum)
    def einsum(equation: str, *operands: Any) -> Any:
        return C.einsum(equation, *operands)

    @register(F.layer_norm, torch.layer_norm)
    def layer_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None,
                   bias: Any = None, eps: float = 1e-5, *args: Any) -> Any:
        shape = tuple(normalized_shape)
        ops = [x] + [t for t in (weight, bias) if t is not None]

        def local(s: torch.Tensor, *wb: torch.Tensor) -> torch.Tensor:
            w = wb[0] if weight is not None else None
            b = wb[-1] if bias is not None else None
            return F.layer_norm(s, shape, w, b, eps)

        return apply("normalize", ops, local, len(shape))

    @register(getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None))
    def rms_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None,
                 eps: Any = None) -> Any:
        shape = tuple(normalized_shape)
        ops = [x] + ([weight] if weight is not None else [])
        return apply("normalize", ops, lambda s, *w: F.rms_norm(
            s, shape, w[0] if w else None, eps), len(shape))

    @register(F.embedding)
    def embedding(ids: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None,
                  *args: Any, **kwargs: Any) -> Any:
        if max_norm is not None:
            raise ShardingError("F.embedding(max_norm=...) renormalizes the table in "
                                "place; it is not supported on a shardwise.Tensor table.")
        ops = _on_mesh([ids, weight]) if not isinstance(ids, Tensor) else [ids, weight]
        return apply("embedding", ops, lambda i, w: F.embedding(i, w, padding_idx))

    @register(F.dropout, torch.dropout)
    def dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return C.mul(x, 0.0)
        # torch's CPU dropout: mask = empty_like(x).bernoulli_(1 - p) / (1 - p); x * mask.
        # Drawn over the global shape, so values equal single-device torch's for a seed.
        noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        noise.div_(1 - p)
        mask = place(noise, x.dist_layout.with_partial((None,) * x.mesh.ndim))
        return C.mul(x, mask)

    @register(F.scaled_dot_product_attention)
    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:
        if dropout_p:
            return _fallback(F.scaled_dot_product_attention, (q, k, v, attn_mask, dropout_p,
                                                             is_causal, scale), {})
        ops = [q, k, v] + ([attn_mask] if attn_mask is not None else [])

        def local(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                  *m: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(qs, ks, vs, m[0] if m else None, 0.0,
                                                  is_causal, scale=scale)

        return apply("sdpa", _on_mesh(ops), local, bool(is_causal))

    @register(F.cross_entropy)
    def cross_entropy(logits: Any, target: Any, weight: Any = None, size_average: Any = None,
                      ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                      label_smoothing: float = 0.0) -> Any:
        if weight is not None or size_average is not None or reduce is not None or (
                logits.ndim != 2 or target.ndim != 1 or target.dtype.is_floating_point):
            return _fallback(F.cross_entropy, (logits, target), dict(
                weight=weight, ignore_index=ignore_index, reduction=reduction,
                label_smoothing=label_smoothing))
        ops = _on_mesh([logits, target])
        per = apply("cross_entropy", ops, lambda lg, tg: F.cross_entropy(
            lg, tg, ignore_index=ignore_index, reduction="none",
            label_smoothing=label_smoothing))
        if reduction == "none":
            return per
        total = C.sum(per)
        if reduction == "sum":
            return total
        count = C.sum(_to(C.ne(ops[1], ignore_index), per.dtype))
        return C.div(total, count)

    for loss_fn, term in ((F.mse_loss, lambda d: C.mul(d, d)), (F.l1_loss, C.abs_)):
        def loss(a: Any, b: Any, size_average: Any = None, reduce: Any = None,
                 reduction: str = "mean", weight: Any = None, _term: Any = term,
                 _fn: Any = loss_fn) -> Any:
            if size_average is not None or reduce is not None or weight is not None:
                return _fallback(_fn, (a, b), dict(size_average=size_average, reduce=reduce,
                                                   reduction=reduction))
            per = _term(C.sub(*_on_mesh([a, b])))
            return per if reduction == "none" else (C.sum(per) if reduction == "sum"
                                                     else C.mean(per))

        register(loss_fn)(loss)

    @register(F.nll_loss)
    def nll_loss(*args: Any, **kwargs: Any) -> Any:
        return _fallback(F.nll_loss, args, kwargs)

    @register(torch.index_select, TensorMethod.index_select)
    def index_select(x: Any, dim: int, index: Any) -> Any:
        d = normalize_dim(dim, max(x.ndim, 1), "index_select dim")
        ops = _on_mesh([x, index])
        return apply("index_select", ops, lambda s, i: torch.index_select(s, d, i), d)


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
    if (short.endswith("_") and not short.endswith("__")) or short.startswith("__i") or (
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


def install() -> None:
    """Fill the registry (idempotent)."""
    if FALLBACK:
        return
    _install_elementwise()
    _install_conversions()
    _install_views()
    _install_reductions()
    _install_nn()
    _install_like()
    _install_inplace()
    _install_foreach()
    HANDLERS.pop(None, None)
    FALLBACK.append(_fallback)


install()
