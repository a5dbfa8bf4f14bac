"""The floor of Python-level dispatch: a minimal ``torch.Tensor`` wrapper subclass.

:class:`Floor` holds one local tensor; ``__torch_function__`` unwraps every Floor
argument, runs the torch function on the local tensors and wraps each tensor result.
It knows no layout, plans nothing and checks nothing: the cheapest a distributed
tensor that is a ``torch.Tensor`` can dispatch an op, so per-op overhead above it is
what a library's own Python costs (the ``dispatch`` bench section's floor column).

>>> y = torch.nn.functional.gelu(Floor(torch.zeros(2, 3)))
>>> type(y).__name__, tuple(y.local.shape)
('Floor', (2, 3))
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Floor"]


def _unwrap(a: Any) -> Any:
    if type(a) is Floor:
        return a.local
    if type(a) in (list, tuple):
        return type(a)(_unwrap(v) for v in a)
    return a


def _wrap(r: Any) -> Any:
    if type(r) is torch.Tensor:
        return Floor(r)
    if type(r) in (list, tuple):
        return type(r)(_wrap(v) for v in r)
    return r


class Floor(torch.Tensor):
    """One local tensor behind a storage-less wrapper (see the module doc)."""

    local: torch.Tensor
    __slots__ = ("local",)

    @staticmethod
    def __new__(cls, local: torch.Tensor) -> Floor:
        self = torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype,
                                                   device=local.device)
        self.local = local
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        args = tuple(_unwrap(a) for a in args)
        out = func(*args, **({k: _unwrap(v) for k, v in kwargs.items()} if kwargs else {}))
        return _wrap(out)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} reached the dispatcher with a Floor")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Floor({self.local!r})"
