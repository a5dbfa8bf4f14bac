"""torch's elementwise ops and operators on shardwise Tensors: ``x + y``, ``torch.relu``,
``F.gelu``, ``torch.where``... one handler per alias, registered from the name tables.

Invariants:
- Each alias (``torch.name``, ``Tensor.name``, ``F.name``, ``torch.special.name``) runs
  itself on the blocks, so its own keywords (``F.relu``'s ``inplace=``, ``F.gelu``'s
  ``approximate=``) keep torch's meaning; the rule table decides the layouts
  (:func:`shardwise.ops.execute.apply_elementwise`), per distinct block or once on
  whole values.
- Tensors and numbers (not bools) among the positional arguments, and tensors among
  the keywords, are the operands; every other argument passes through unchanged.
- An operator given an argument that is no tensor or number returns ``NotImplemented``,
  so Python tries the other side, as torch's own operators do; a bool is a number there
  (``x & True``). ``&``, ``|``, ``^`` are bitwise, as torch's (int & bool is an int).
- ``div`` with a ``rounding_mode`` is nonlinear: a Partial numerator is reduced first.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.execute import apply, apply_elementwise
from shardwise.ops.registry import TensorMethod, register
from shardwise.propagation import rules
from shardwise.tensors.tensor import Tensor

__all__ = ["LINEAR", "NONLINEAR", "OPERATORS"]


_NUMERIC = (torch.Tensor, int, float)  # what a handler passes to its op as an operand


def _is_operand(a: Any) -> bool:
    """An operand of a ``torch.nn.functional`` op: a tensor or a number, not a bool."""
    return isinstance(a, torch.Tensor) or (
        isinstance(a, numbers.Number) and not isinstance(a, bool))


def _is_value(a: Any) -> bool:
    """An operator's other side: a tensor or any Python number, bools included (``x &
    True``, ``x + True`` are torch's arithmetic; only in argument lists is a bool a flag)."""
    return isinstance(a, (torch.Tensor, numbers.Number))


def _aliases(name: str) -> list[Any]:
    """``torch.name``, ``Tensor.name``, ``F.name``, ``torch.special.name`` (None if absent)."""
    return [getattr(mod, name, None) for mod in (torch, TensorMethod, F, torch.special)]


def _elementwise(rule: str, func: Any, flags: bool = False) -> Callable[..., Any]:
    """A handler running ``func`` per local block; tensors and numbers among the
    positional arguments are its operands, everything else passes through. ``flags``:
    ``func`` is a ``torch.nn.functional`` op, whose positional bools are options
    (``F.relu(x, True)`` is ``inplace``); elsewhere a bool is a number (``torch.add(x,
    True)``)."""
    is_operand = _is_operand if flags else _is_value

    def handler(*args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            for a in args:  # (a shardwise Tensor, the common argument, tested first)
                if type(a) is not Tensor and (not isinstance(a, _NUMERIC) or (
                        flags and isinstance(a, bool))):
                    break
            else:
                return apply_elementwise(rule, args, func)  # every argument is an operand
        pos = [i for i, a in enumerate(args) if is_operand(a)]
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


# the names are the rule table's: one list, which the rules are made from
#: linear ops (a Partial operand may stay Partial): name -> its rule
LINEAR = rules.ELEMENTWISE_LINEAR
#: the other elementwise ops, each its own rule unless _RULE_OF names another
NONLINEAR = [*rules.ELEMENTWISE_NONLINEAR, *rules.ELEMENTWISE_SHARED]
_RULE_OF = rules.ELEMENTWISE_RULE

for _name, _rule in [*LINEAR.items(), *((n, _RULE_OF.get(n, n)) for n in NONLINEAR)]:
    for _f in _aliases(_name):
        if _f is not None:
            _functional = _f is getattr(F, _name, None) and _f is not getattr(torch, _name, None)
            register(_f)(_elementwise(_rule, _f, flags=_functional))


# --- operators: x + y, 2 * x, -x, x == y ... -------------------------------------------
#: Python's operators: dunder -> the torch op it runs (inplace.py derives x += y ...)
OPERATORS = {"__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub",
            "__mul__": "mul", "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div",
            "__div__": "div", "__rdiv__": "div", "__pow__": "pow", "__rpow__": "pow",
            "__neg__": "neg", "__abs__": "abs", "__eq__": "eq", "__ne__": "ne",
            "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
            # bitwise, as torch's operators: logical_* would turn int & bool into bools
            "__and__": "bitwise_and", "__rand__": "bitwise_and", "__or__": "bitwise_or",
            "__ror__": "bitwise_or", "__xor__": "bitwise_xor", "__rxor__": "bitwise_xor",
            "__lshift__": "bitwise_left_shift", "__rlshift__": "bitwise_left_shift",
            "__rshift__": "bitwise_right_shift", "__rrshift__": "bitwise_right_shift",
            "__invert__": "bitwise_not", "__floordiv__": "floor_divide",
            "__rfloordiv__": "floor_divide", "__mod__": "remainder", "__rmod__": "remainder"}
_REFLECTED = {"__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__rdiv__", "__rpow__",
              "__rfloordiv__", "__rand__", "__ror__", "__rxor__", "__rlshift__", "__rrshift__",
              "__rmod__"}



def _operator(rule: str, func: Callable[..., Any], reflected: bool) -> Callable[..., Any]:
    """``x op y`` (``y op x`` when ``reflected``: ``x.__radd__(y)``) on the blocks. Both
    sides are operands, a bool too; NotImplemented when the other side is no tensor or
    number, so that Python asks it."""
    plain = _elementwise(rule, func)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            if not isinstance(args[1], (torch.Tensor, numbers.Number)):  # _is_value
                return NotImplemented
            if reflected:
                args = (args[1], args[0])
        if kwargs:
            return plain(*args, **kwargs)
        return apply_elementwise(rule, args, func)

    return forward


# After the aliases: torch's Tensor.__neg__ and __abs__ are Tensor.neg and Tensor.abs
# themselves, so those two methods end on the operator's handler (as they always did).
for _dunder, _name in OPERATORS.items():
    register(getattr(TensorMethod, _dunder))(_operator(
        LINEAR.get(_name) or _RULE_OF.get(_name, _name),
        getattr(torch, _name, None) or getattr(TensorMethod, _name), _dunder in _REFLECTED))

_div_plain = _elementwise("div", torch.div)
_div_round = _elementwise("div_rounding", torch.div)


@register(torch.div, TensorMethod.div, torch.divide, TensorMethod.divide)
def div(*args: Any, **kwargs: Any) -> Any:
    """``torch.div``: linear, unless a ``rounding_mode`` makes it nonlinear (a Partial
    numerator must then be reduced first)."""
    return (_div_round if kwargs.get("rounding_mode") is not None else _div_plain)(
        *args, **kwargs)


# --- issue 20 (helper ew): elementwise ops that need more than a name --------------------
@register(torch.frexp, TensorMethod.frexp)
def frexp(x: Any) -> Any:
    """``torch.frexp``: its two outputs (mantissa, exponent), each on the shared rule."""
    mantissa = apply_elementwise("elementwise", (x,), lambda s: torch.frexp(s).mantissa)
    exponent = apply_elementwise("elementwise", (x,), lambda s: torch.frexp(s).exponent)
    return torch.return_types.frexp((mantissa, exponent))


def _part(func: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """``torch.real``/``torch.imag`` and the ``x.real``/``x.imag`` getters, per block."""

    def handler(x: Any) -> Any:
        return apply_elementwise("elementwise", (x,), func)

    return handler


_GETTER = "__get__"  # torch's property getters (not visible to mypy on the stubs)
register(torch.real, getattr(TensorMethod.real, _GETTER))(_part(torch.real))
register(torch.imag, getattr(TensorMethod.imag, _GETTER))(_part(torch.imag))


@register(torch.unravel_index)
def unravel_index(indices: Any, shape: Any) -> Any:
    """``torch.unravel_index``: one coordinate tensor per dim of ``shape``, each
    elementwise in ``indices`` (torch's own op on each block, one output at a time)."""
    coords = torch.unravel_index(torch.zeros((), dtype=indices.dtype), shape)  # checks
    return tuple(
        apply_elementwise("elementwise", (indices,),
                          lambda s, k=k: torch.unravel_index(s, shape)[k])
        for k in range(len(coords)))


@register(F.one_hot)
def one_hot(x: Any, num_classes: int = -1) -> Any:
    """``F.one_hot``: each element becomes a row of ``num_classes``, a new last dim that
    stays whole. ``-1`` reads the number of classes from the global maximum, as torch
    does (an all-reduce of one number)."""
    if num_classes == -1 and x.numel():
        num_classes = int(torch.amax(x)) + 1
    elif num_classes == -1:  # torch's error for an empty tensor
        F.one_hot(torch.empty(tuple(x.shape), dtype=x.dtype), num_classes)
    return apply("one_hot", (x,), lambda s: F.one_hot(s, num_classes), num_classes)


@register(torch.prelu, getattr(TensorMethod, "prelu", None))
def prelu(x: Any, weight: Any) -> Any:
    """``F.prelu``: elementwise with one slope per channel (dim 1), which shards with
    x's channels, or one slope for all; torch's own op on each block."""
    torch.prelu(torch.empty(tuple(x.shape), dtype=x.dtype, device="meta"),
                torch.empty(tuple(weight.shape), dtype=weight.dtype, device="meta"))
    return apply("prelu", (x, weight), torch.prelu)
