"""The decision cache's key of an op on its operands: everything the rule's binding and
the layout decision read, so that equal keys get equal decisions.

Invariants:
- One function builds the key (:func:`decision_key`): per operand its layout, shape,
  open dims and dtype (a marker for a Python number), after the op's name, whether its
  local call takes the output shape, and its parameters; and, when some operand keeps
  layouts an earlier op moved it to (priced free by ``decide``), those layouts with
  the request each was kept for. Plain torch operands, converted per call, get no key.
- Here, in the Tensor's package, so that the executor reads no Tensor field itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.tensors.cache import kept_layouts
from shardwise.tensors.tensor import Tensor

__all__ = ["decision_key"]

_CONSTS = (int, float, bool, complex)  # Python numbers: broadcast constants


def decision_key(op: str, shaped: bool, params: tuple[Any, ...], operands: Sequence[Any]
                 ) -> tuple[Any, ...] | None:
    """The decision cache's key of ``op`` on ``operands`` (module doc), or None where
    the decision cannot be cached (an operand a plain torch tensor or another type,
    converted or refused per call). The one function that builds it; one and two
    Tensors keeping nothing (every op's common case) are keyed without a loop.

    >>> decision_key("neg", False, (), (torch.ones(2),)) is None
    True
    >>> x = shardwise.tensor(torch.ones(2))
    >>> decision_key("neg", False, (), (x,))[:4] == ("neg", False, (), x.dist_layout)
    True
    """
    n = len(operands)
    if n == 1:
        x = operands[0]
        if type(x) is Tensor and x._cache is None:
            return (op, shaped, params, x._layout, x._shape, x._open, x._dtype)
    elif n == 2:
        x, y = operands
        if type(x) is Tensor and type(y) is Tensor and x._cache is None and y._cache is None:
            return (op, shaped, params, x._layout, x._shape, x._open, x._dtype,
                    y._layout, y._shape, y._open, y._dtype)
    key: list[Any] = [op, shaped, params]
    kept = False
    for x in operands:
        if isinstance(x, Tensor):
            key += (x._layout, x._shape, x._open, x._dtype)
            kept = kept or bool(x._cache)
        elif type(x) in _CONSTS:
            key.append(None)
        else:  # torch tensors and the rest: converted or refused by _operands
            return None
    if kept:  # the layouts operands keep are priced by decide: part of the key (both
        # requests', so the key needs no question of how the runtime will run the op)
        key.append(kept_layouts(
            [x if isinstance(x, Tensor) else None for x in operands], None))
    return tuple(key)
