"""New tensors made like a shardwise Tensor: ``torch.zeros_like``, ``x.new_zeros``,
``x.new_tensor``, ``torch.randn_like``...

Invariants:
- A ``*_like`` result and a ``new_*`` result of x's own shape keep x's layout less its
  Partial axes (as DTensor does), made per block by torch's own function, so dtype,
  device and value rules are torch's; a Partial ``x`` is never reduced for it (only
  its blocks' shapes are read).
- A ``new_*`` result of any other shape, and ``x.new_tensor(data)``, are Replicated;
  a ``device=`` other than the mesh's gives a plain torch tensor there, as torch gives.
- Random ``*_like`` ops draw over the global shape from torch's generator, so their
  values are single-device torch's for a seed, on every layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from shardwise.ops.registry import fallback, register, shape_args
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor, place

__all__ = ["zeros_like"]


def _like(fn: Any, x: Any, *args: Any, **kwargs: Any) -> Tensor:
    """``fn(x_block, ...)`` per distinct block, in x's layout without its Partial axes
    (only the blocks' shapes are read: a Partial ``x`` is never reduced for it)."""
    kwargs.pop("memory_format", None)
    return x.map_buffers(lambda s: fn(s, *args, **kwargs), x.dist_layout.without_partial())


for _name in ("zeros_like", "ones_like", "empty_like", "full_like"):
    _fn = getattr(torch, _name)
    register(_fn)(functools.partial(_like, _fn))


def zeros_like(x: Tensor) -> Tensor:
    """``torch.zeros_like(x)``, called directly (no dispatch)."""
    return _like(torch.zeros_like, x)


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
        size = shape_args(args if args else (kwargs.pop("size"),))
        device = kwargs.get("device")
        if device is not None and torch.device(device) != x.device:
            # not on the mesh's devices: a plain torch tensor there, as torch gives
            return method(torch.empty(0, dtype=x.dtype), size, *fill, **kwargs)
        if size == tuple(x.shape):  # the blocks are plain torch tensors
            return _like(lambda s: method(s, s.shape, *fill, **kwargs), x)
        whole = method(torch.empty(0, dtype=x.dtype, device=x.device), size, *fill, **kwargs)
        return place(whole, Layout.replicated(x.mesh, whole.ndim))

    return handler


for _name in ("new_zeros", "new_ones", "new_empty", "new_full"):
    register(getattr(torch.Tensor, _name))(_new(_name))


@register(torch.Tensor.new_tensor)
def new_tensor(x: Any, data: Any, **kwargs: Any) -> Any:
    """``x.new_tensor(data)``: a new Replicated tensor on x's mesh (a plain torch tensor
    when ``device=`` is not the mesh's: nn.init reads its bounds through
    ``x.new_tensor(a, device="cpu").item()``)."""
    if isinstance(data, Tensor):
        return fallback(torch.Tensor.new_tensor, (x, data), kwargs)
    whole = torch.empty(0, dtype=x.dtype, device=x.device).new_tensor(data, **kwargs)
    if whole.device != x.device:
        return whole
    return place(whole, Layout.replicated(x.mesh, whole.ndim))


def _random_like(draw: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``torch.randn_like(x)`` and kin: drawn globally from torch's generator, then laid
    out: the same values as single-device torch for the same seed."""

    def handler(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("memory_format", None)
        kwargs.pop("device", None)
        g = draw(torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device), *args,
                 **kwargs)
        return place(g, x.dist_layout.without_partial())

    return handler


for _draw in (torch.rand_like, torch.randn_like, torch.randint_like):
    register(_draw)(_random_like(_draw))
