"""Writes into a shardwise Tensor: ``x.add_(y)``, ``x += y``, ``x.copy_(y)``, ``x.zero_()``,
and the random fills (``x.normal_()``, ``nn.init.kaiming_uniform_``).

Invariants:
- An in-place op writes each distinct local buffer once (replicas share one buffer),
  so ``torch.optim`` updates a sharded parameter exactly as it would the global one.
- The written tensor keeps its layout and shape: operands laid out like it run the
  op on its buffers; otherwise the out-of-place result is relaid out and copied in.
- A Partial tensor refuses every write but ``zero_`` (zeros are a valid Partial value).
- Random fills draw over the global shape from torch's generator, so the values are
  single-device torch's for a seed, on every layout and in every process.
- The out-of-place handlers are read from the registry when this module loads, so
  :mod:`shardwise.ops.elementwise` registers first (imported here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.ops import compute
from shardwise.ops.conversions import to
from shardwise.ops.elementwise import LINEAR, NONLINEAR, OPERATORS
from shardwise.ops.factories import zeros_like
from shardwise.ops.registry import TensorMethod, describe, register, shape_args, type_name
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import HANDLERS, Tensor, pieces, place

__all__ = ["write_into"]


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


def write_into(self: Tensor, value: Tensor, name: str) -> Tensor:
    """Copy ``value`` (``self``'s global shape, a Tensor) into ``self``'s own buffers,
    relaid out as ``self`` (``x[i] = v`` ends here); a Partial ``self`` refuses."""
    return _write(self, value, name)


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
    layout = self.dist_layout
    src = value.held
    if value.dist_layout != layout:  # (a value held whole moves as metadata, counted)
        src = src.moved(value.plan_to(layout), layout)
    local = self.held
    for i, b in enumerate(local.buffers()):
        b.copy_(local.part(src, i, layout))
    return self


def _inplace(name: str, method: Any, out_of_place: Callable[..., Any] | None
             ) -> Callable[..., Any]:
    """``x.op_(...)``: run ``method`` on each distinct local buffer when every operand
    is laid out like ``x``; else compute ``out_of_place`` and copy it into ``x``."""

    def handler(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = self if type(self) is Tensor else _target(self, name)
        rows = pieces(t, args)
        if rows is not None:
            for v in kwargs.values():  # (options: value=, alpha=; a tensor among them
                if isinstance(v, torch.Tensor):  # is cut below)
                    break
            else:
                # the optimizers' hot path: the method on each buffer of t (its whole
                # value, or each distinct block) with the operands' pieces at the same place
                for b, row in rows:
                    method(b, *row, **kwargs)
                return t
        kw_rows = pieces(t, list(kwargs.values())) if rows is not None else None
        if rows is not None and kw_rows is not None:
            for (b, row), (_, kw) in zip(rows, kw_rows):
                method(b, *row, **dict(zip(kwargs, kw)))
            return t
        if out_of_place is None:
            _refuse_partial(t, name)
            raise ShardingError(
                f"{name} has no sharding rule for these operands ({describe((self, *args))}). "
                "Lay the operands out like the tensor written in place, or use the "
                "out-of-place op."
            )
        value = out_of_place(t, *args, **kwargs)
        if not torch.can_cast(value.dtype, t.dtype):  # torch's rule, and its words
            raise RuntimeError(
                f"result type {type_name(value.dtype)} can't be cast to the desired output "
                f"type {type_name(t.dtype)} ({name} on {t!r}).")
        return _write(t, value, name)

    return handler


# x.add_(y), x.relu_()...: the out-of-place handler is the elementwise one, when it has
# one (copy_ and zero_ are replaced below, fill_ has none); torch's function forms
# (torch.relu_(x), torch.zero_(x)) share the method's handler
for _name in sorted(set(LINEAR) | set(NONLINEAR) | {"copy", "zero", "fill"}):
    _method = getattr(TensorMethod, _name + "_", None)
    if _method is not None:
        register(_method, getattr(torch, _name + "_", None))(_inplace(
            _name + "_", _method, HANDLERS.get(getattr(TensorMethod, _name, None))))

# x += y and friends: the in-place twin of each operator that torch has (x.__iadd__
# runs x.add_ on x's buffers); torch's __idiv__ is __itruediv__ itself, registered once
_twins: set[Any] = set()
for _dunder, _name in OPERATORS.items():
    _inplace_name = "__i" + _dunder[2:]
    _twin = getattr(TensorMethod, _inplace_name, None)
    if _twin is not None and _twin not in _twins:
        _twins.add(_twin)
        register(_twin)(_inplace(_inplace_name, getattr(TensorMethod, _name + "_"),
                                 HANDLERS[getattr(TensorMethod, _name)]))


@register(TensorMethod.copy_)
def copy_(self: Any, src: Any, non_blocking: bool = False) -> Any:
    """``x.copy_(src)``: src cast to x's dtype, broadcast to its shape, laid out like x."""
    t = _target(self, "copy_")
    if isinstance(src, Tensor):
        value: Tensor = src if src.dtype == t.dtype else to(src, t.dtype)
        if value.shape != t.shape:
            value = compute.add(value, zeros_like(t))  # broadcast to t's shape
        return _write(t, value, "copy_")
    value = torch.as_tensor(src).to(t.dtype).expand(t.shape)  # type: ignore[assignment]
    return _write(t, place(value, Layout.replicated(t.mesh, t.ndim)), "copy_")


@register(TensorMethod.zero_, torch.zero_)
def zero_(self: Any) -> Any:
    # zeros are a valid Partial value too (they reduce to zeros), unlike other writes
    t = _target(self, "zero_")
    for b in t.held.buffers():
        b.zero_()
    return t


@register(TensorMethod.resize_, TensorMethod.resize_as_, torch.resize_as_)
def resize_(self: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.resize_(shape)``/``x.resize_as_(y)``: a no-op to x's own shape, else refused
    (a Tensor's shape and layout are fixed: its shards would have to change in place)."""
    shape = tuple(size.shape) if isinstance(size, torch.Tensor) else shape_args((size, *args))
    t = _target(self, "resize_")
    if shape == tuple(t.shape):
        return t
    raise ShardingError(
        f"resize_ to {list(shape)}: a shardwise.Tensor keeps the shape and layout it was "
        f"made with ({describe([t])}); resizing would change its shards in place. Make a "
        "new Tensor instead (x.new_empty(shape), x.reshape(shape) for the same number of "
        "elements), or resize the gathered x.to_torch().")


# --- random fills: in place from torch's generator (nn.init ends in these) -----------------
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
        drawn = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
        fill(drawn, *args, **kwargs)
        return _write(t, place(drawn, t.dist_layout), name)

    return handler


for _name in ("uniform_", "normal_", "bernoulli_", "exponential_", "random_", "cauchy_",
              "log_normal_", "geometric_"):
    register(getattr(TensorMethod, _name))(_random_fill(_name, getattr(TensorMethod, _name)))

# the nn.init functions that dispatch on their tensor (the others call x.normal_()...)
for _name in ("uniform_", "normal_", "kaiming_uniform_", "constant_"):
    _init = getattr(torch.nn.init, _name)
    register(_init)(_random_fill(f"torch.nn.init.{_name}", _init, init=True))
