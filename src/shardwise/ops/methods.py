"""Operators and methods of :class:`~shardwise.Tensor`, installed from the compute ops.

``install()`` runs when :mod:`shardwise.ops.compute` is imported, which
``shardwise.ops`` (and so every path that builds a Tensor) does: ``x + y``,
``x @ w``, ``-x``, ``x[i]``, ``x == y``, ``x.sum(0)``, ``x.T`` ... all go
through propagation. Comparisons return Tensors (as in torch), so ``__hash__``
stays identity-based and ``bool()`` works only on one-element Tensors.
``x.max(dim)`` / ``x.min(dim)`` return the values only (``amax``/``amin``), not
torch's (values, indices) pair.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from shardwise.sharding.errors import ShardingError
from shardwise.tensors import Tensor

__all__ = ["install"]


def _operand_ok(x: Any) -> bool:
    return isinstance(x, (Tensor, numbers.Number)) or (
        isinstance(x, torch.Tensor) and x.ndim == 0)


def _binary(fn: Callable[[Any, Any], Tensor], reflected: bool = False) -> Callable[..., Any]:
    """A dunder: NotImplemented for other kinds of operand (so ``x == None`` is False)."""
    def method(self: Tensor, other: Any) -> Any:
        if not _operand_ok(other):
            return NotImplemented
        return fn(other, self) if reflected else fn(self, other)

    return method


def _bool(self: Tensor) -> bool:
    if self.numel() != 1:
        raise ShardingError(
            f"The truth value of {self!r} with {self.numel()} elements is ambiguous: use "
            "(x == y).to_torch().all() or .any()."
        )
    return bool(self.item())


def _t(self: Tensor) -> Tensor:
    """The transpose of a matrix (a Tensor of rank < 2 as it is), like torch's ``.t()``."""
    from shardwise.ops import compute as c

    return c.transpose(self, 0, 1) if self.ndim == 2 else c.permute(self, tuple(range(self.ndim)))


def install() -> None:
    """Set the operators and methods on :class:`Tensor` (idempotent)."""
    from shardwise.ops import compute as c

    binary = {"add": c.add, "sub": c.sub, "mul": c.mul, "truediv": c.div, "pow": c.pow,
              "matmul": c.matmul}
    for name, fn in binary.items():
        setattr(Tensor, f"__{name}__", _binary(fn))
        setattr(Tensor, f"__r{name}__", _binary(fn, reflected=True))
    for name, fn in {"eq": c.eq, "ne": c.ne, "lt": c.lt, "le": c.le, "gt": c.gt,
                     "ge": c.ge}.items():
        setattr(Tensor, f"__{name}__", _binary(fn))
    setattr(Tensor, "__hash__", object.__hash__)  # noqa: B010  (__eq__ is elementwise)
    setattr(Tensor, "__bool__", _bool)  # noqa: B010
    setattr(Tensor, "__neg__", c.neg)  # noqa: B010
    setattr(Tensor, "__abs__", c.abs_)  # noqa: B010
    setattr(Tensor, "__getitem__", c.getitem)  # noqa: B010
    methods: dict[str, Callable[..., Any]] = {
        "add": c.add, "sub": c.sub, "mul": c.mul, "div": c.div, "pow": c.pow,
        "matmul": c.matmul, "neg": c.neg, "abs": c.abs_, "relu": c.relu, "gelu": c.gelu,
        "silu": c.silu, "sigmoid": c.sigmoid, "tanh": c.tanh, "exp": c.exp, "log": c.log,
        "sqrt": c.sqrt, "sum": c.sum, "mean": c.mean, "amax": c.amax, "amin": c.amin,
        "max": c.amax, "min": c.amin, "maximum": c.maximum, "minimum": c.minimum,
        "eq": c.eq, "ne": c.ne, "lt": c.lt, "le": c.le, "gt": c.gt, "ge": c.ge,
        "transpose": c.transpose, "permute": c.permute, "reshape": c.reshape,
        "view": c.reshape, "softmax": c.softmax, "t": _t,
    }
    for name, fn in methods.items():
        setattr(Tensor, name, fn)
    setattr(Tensor, "T", property(  # noqa: B010
        lambda self: c.permute(self, tuple(reversed(range(self.ndim)))),
        doc="The dims reversed (the transpose of a matrix)."))
