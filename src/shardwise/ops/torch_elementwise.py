"""torch's elementwise ops, in-place ops, foreach ops, ``*_like`` and dtype conversions
on shardwise Tensors (installed into the registry by :mod:`shardwise.ops.torch_api`).

Invariants:
- Elementwise ops keep torch's own function per alias (``F.relu``'s ``inplace=``,
  ``F.gelu``'s ``approximate=``) and run it per distinct block, or once on whole values.
- In-place ops write each distinct local buffer once; a Partial tensor refuses them.
- Random ``*_like`` ops draw over the global shape (single-device values for a seed).
"""

from __future__ import annotations

import functools
import pydoc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops import compute as C
from shardwise.ops.execute import apply, apply_elementwise
from shardwise.ops.registry import (
    TensorMethod,
    _aliases,
    _describe,
    _is_operand,
    _shape_args,
    register,
)
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.tensors.relayout import record_plan
from shardwise.tensors.tensor import FALLBACK, HANDLERS, Tensor, place

__all__ = ["install"]


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
        plain = _elementwise(rule, base)
        if dunder in _REFLECTED:
            def reflected(a: Any, b: Any, _plain: Any = plain) -> Any:
                if not _is_operand(b):
                    return NotImplemented
                return _plain(b, a)

            register(getattr(TensorMethod, dunder))(reflected)
        else:
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


def _refuse_partial(t: Tensor, name: str) -> None:
    if t.dist_layout.is_partial:
        raise ShardingError(
            f"{name} on {t!r}: a Partial tensor cannot be written in place (its devices "
            "hold addends, not the value). Reduce it first (x = x.redistribute(...) or "
            "shardwise.all_reduce(x))."
        )


def _write(self: Tensor, value: Tensor, name: str) -> Tensor:
    """Copy ``value`` (same global shape) into ``self``'s own buffers."""
    if value.shape != self.shape:
        raise ShardingError(
            f"{name}: the result has shape {tuple(value.shape)} but the tensor written in "
            f"place has shape {tuple(self.shape)}; in-place ops cannot change the shape."
        )
    _refuse_partial(self, name)
    if value.mesh != self.mesh:
        raise ShardingError(f"{name}: the operands live on {value.mesh!r} and {self.mesh!r}.")
    if self._whole is not None and value._whole is not None and not value.dist_layout.is_partial:
        # both hold their global values: one copy, the layout change only counted
        if value.dist_layout != self.dist_layout:
            record_plan(value.plan_to(self.dist_layout))
        self._whole.copy_(value._whole)
        return self
    src = value.relayout(self.dist_layout)
    shards = self._shards
    for k in self._unique():
        shards[k].copy_(src._shards[k])
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


def _wholes_like(t: Tensor, operands: Any) -> list[Any] | None:
    """The operands as whole values when ``t`` (no Partial axes) and every Tensor among
    them hold one in ``t``'s layout (0-d: any layout without Partial axes); else None."""
    lay = t._layout
    if lay.is_partial:
        return None
    out = []
    for a in operands:
        if isinstance(a, Tensor):
            w = a._whole
            if w is None or (a._layout is not lay and a._layout != lay and (
                    a._shape or a._layout.is_partial)):
                return None
            out.append(w)
        elif isinstance(a, torch.Tensor) and a.ndim != 0:
            return None
        else:
            out.append(a)
    return out


def _inplace(name: str, method: Any, out_of_place: Callable[..., Any] | None
             ) -> Callable[..., Any]:
    """``x.op_(...)``: run ``method`` on each distinct local buffer when every operand
    is laid out like ``x``; else compute ``out_of_place`` and copy it into ``x``."""

    def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = _target(self, name)
        whole = t._whole
        if whole is not None:  # the optimizers' hot path: one call on the wholes
            wargs = _wholes_like(t, args)
            wkw = _wholes_like(t, kwargs.values()) if kwargs else []
            if wargs is not None and wkw is not None:
                method(whole, *wargs, **dict(zip(kwargs, wkw)))
                return t
        if _same_layout_rows(t, list(args) + list(kwargs.values())):
            shards = t._shards
            tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
            tkw = [key for key, v in kwargs.items() if isinstance(v, Tensor)]
            if not tensors and not tkw:  # numbers only: the same call on every buffer
                for k in t._unique():
                    method(shards[k], *args, **kwargs)
                return t
            call = list(args)
            kw = dict(kwargs)
            for k in t._unique():
                for i in tensors:
                    call[i] = args[i]._shards[k]
                for key in tkw:
                    kw[key] = kwargs[key]._shards[k]
                method(shards[k], *call, **kw)
            return t
        if out_of_place is None:
            _refuse_partial(t, name)
            raise ShardingError(
                f"{name} has no sharding rule for these operands ({_describe((self, *args))}). "
                "Lay the operands out like the tensor written in place, or use the "
                "out-of-place op."
            )
        return _write(t, out_of_place(t, *args, **kwargs), name)

    return handler


# in-place fills from torch's generator (nn.init ends in these)
_RANDOM_FILLS = ("uniform_", "normal_", "bernoulli_", "exponential_", "random_", "cauchy_",
                 "log_normal_", "geometric_")


def _random_fill(name: str, fill: Callable[..., Any], init: bool = False
                 ) -> Callable[..., Any]:
    """``x.normal_()`` and kin, and the ``nn.init`` functions: ``fill`` runs on one
    plain tensor of x's global shape, then each of x's buffers takes its block. So the
    values are single-device torch's for the same seed, on every layout and in every
    process (each process draws the same stream; drawn per block, the blocks of one
    seed would repeat across processes). ``init``: an nn.init function (no autograd,
    as its own body runs under no_grad)."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        if init:
            with torch.no_grad():
                return fill_(*args, **kwargs)
        return fill_(*args, **kwargs)

    def fill_(*args: Any, **kwargs: Any) -> Any:
        # nn.init passes its tensor by keyword
        self, args = (args[0], args[1:]) if args else (kwargs.pop("tensor"), ())
        t = _target(self, name)
        _refuse_partial(t, name)
        if t._whole is not None:  # it holds its global value: fill that in place
            fill(t._whole, *args, **kwargs)
            return t
        drawn = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
        fill(drawn, *args, **kwargs)
        return _write(t, place(drawn, t.dist_layout), name)

    return handler


def _install_inplace() -> None:
    names = set(_LINEAR) | set(_NONLINEAR) | {"copy", "zero", "fill"}
    for name in sorted(names):
        method = getattr(TensorMethod, name + "_", None)
        if method is None:
            continue
        out = HANDLERS.get(getattr(TensorMethod, name, None))
        register(method)(_inplace(name + "_", method, out))
    for name in _RANDOM_FILLS:
        register(getattr(TensorMethod, name))(_random_fill(name, getattr(TensorMethod, name)))
    # the nn.init functions that dispatch on their tensor (the others call x.normal_()...)
    for name in ("uniform_", "normal_", "kaiming_uniform_", "constant_"):
        fn = getattr(torch.nn.init, name)
        register(fn)(_random_fill(f"torch.nn.init.{name}", fn, init=True))
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
        # zeros are a valid Partial value too (they reduce to zeros), unlike other writes
        t = _target(self, "zero_")
        if t._whole is not None:
            t._whole.zero_()
            return t
        for s in t.unique_shards()[1]:
            s.zero_()
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
    """``fn(x_block, ...)`` per distinct block, in x's layout without its Partial axes
    (only the blocks' shapes are read: a Partial ``x`` is never reduced for it)."""
    kwargs.pop("memory_format", None)
    layout = x.dist_layout
    if layout.is_partial:
        return x._map_unique(lambda s: fn(s, *args, **kwargs),
                             layout.with_partial((None,) * x.mesh.ndim))
    if x._whole is not None:
        return Tensor.from_whole(fn(x._whole, *args, **kwargs), layout, x._open)
    return x._map_unique(lambda s: fn(s, *args, **kwargs))


def _new(name: str) -> Callable[..., Any]:
    """``x.new_zeros(size)`` and its kin: x's own shape keeps x's layout (less its
    Partial axes, as DTensor does), any other shape is Replicated; made per block from
    torch's own method, so dtype, device and value rules are torch's. ``device=``
    other than the mesh's gives a plain torch tensor there, as torch gives."""
    method = getattr(torch.Tensor, name)

    def handler(x: Any, *args: Any, **kwargs: Any) -> Any:
        fill: tuple[Any, ...] = ()
        if name == "new_full":  # new_full(size, fill_value): size is one sequence
            fill = (args[1] if len(args) > 1 else kwargs.pop("fill_value"),)
            args = args[:1]
        size = _shape_args(args if args else (kwargs.pop("size"),))
        device = kwargs.get("device")
        if device is not None and torch.device(device) != x.device:
            # not on the mesh's devices: a plain torch tensor there, as torch gives
            return method(torch.empty(0, dtype=x.dtype), size, *fill, **kwargs)
        if size == tuple(x.shape):  # the blocks are plain torch tensors
            return _like(lambda s: method(s, s.shape, *fill, **kwargs), x)
        whole = method(torch.empty(0, dtype=x.dtype, device=x.device), size, *fill, **kwargs)
        return place(whole, Layout.replicated(x.mesh, whole.ndim))

    return handler


def _new_tensor(x: Any, data: Any, **kwargs: Any) -> Any:
    """``x.new_tensor(data)``: a new Replicated tensor on x's mesh (a plain torch tensor
    when ``device=`` is not the mesh's: nn.init reads its bounds through
    ``x.new_tensor(a, device="cpu").item()``)."""
    if isinstance(data, Tensor):
        return FALLBACK[0](torch.Tensor.new_tensor, (x, data), kwargs)
    whole = torch.empty(0, dtype=x.dtype, device=x.device).new_tensor(data, **kwargs)
    if whole.device != x.device:
        return whole
    return place(whole, Layout.replicated(x.mesh, whole.ndim))


def _install_like() -> None:
    for name in ("zeros_like", "ones_like", "empty_like", "full_like"):
        fn = getattr(torch, name)
        register(fn)(functools.partial(_like, fn))

    for name in ("new_zeros", "new_ones", "new_empty", "new_full"):
        register(getattr(torch.Tensor, name))(_new(name))
    register(torch.Tensor.new_tensor)(_new_tensor)

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

    # dtype queries the optimizers make per parameter and step: answered directly
    register(torch.is_complex)(lambda x: x.dtype.is_complex)
    register(torch.is_floating_point)(lambda x: x.dtype.is_floating_point)

    @register(TensorMethod.type_as)
    def type_as(x: Any, other: Any) -> Any:
        return _to(x, other.dtype)

    @register(TensorMethod.type)
    def type_(x: Any, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        # torch.typename and nn.Module's error messages call x.type(): answered from the
        # dtype, never by gathering the values
        if dtype is None:
            return torch.empty(0, dtype=x.dtype, device=x.device).type()
        if isinstance(dtype, str):  # "torch.DoubleTensor", "torch.cuda.HalfTensor"
            cls = pydoc.locate(dtype)
            target = getattr(cls, "dtype", None)
            if not isinstance(target, torch.dtype):
                raise ShardingTypeError(
                    f"{x!r}.type({dtype!r}): {dtype!r} names no tensor type; pass a "
                    "torch.dtype or a name like 'torch.DoubleTensor'.")
            cuda = bool(getattr(cls, "is_cuda", False))  # the name says cpu or cuda only
            same = cuda == (x.device.type == "cuda")
            return _to(x, target, x.device if same else ("cuda" if cuda else "cpu"))
        return _to(x, dtype)

    # nn.Module._apply asks it per parameter (module.to(dtype)); wrappers and their
    # shards are plain TensorImpls, so the answer is torch's on the wrappers themselves
    @register(torch._has_compatible_shallow_copy_type)
    def compatible_shallow_copy(a: Any, b: Any) -> bool:
        with torch._C.DisableTorchFunctionSubclass():
            return bool(torch._has_compatible_shallow_copy_type(a, b))

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


def install() -> None:
    _install_elementwise()
    _install_conversions()
    _install_like()
    _install_inplace()
    _install_foreach()
