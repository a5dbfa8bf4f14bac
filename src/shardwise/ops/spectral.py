"""``torch.fft`` on shardwise Tensors: the transformed dims stay whole, the others shard
freely (each 1-D transform reads one whole line of its dim).

Invariants:
- Every transform runs on the ``"free_dims"`` rule with torch's own function on each block;
  the output has the input's rank, and each dim that is not transformed keeps its
  factor (and so its sharding).
- The transformed dims are torch's: ``dim`` given, else the last ``len(s)`` dims when
  ``s`` is given, else the default of the function (the last one or two dims, or all).
- ``fftshift``/``ifftshift`` roll the dims they shift: those stay whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.ops.free_dims import apply_free_dims
from shardwise.ops.registry import register
from shardwise.sharding.layout import normalize_dim

__all__: list[str] = []


def _dims(x: Any, dim: Any, size: Any, default: int | None) -> set[int]:
    """The dims a transform acts on (``default``: the last ``default`` dims; None: all)."""
    n = max(x.ndim, 1)
    if dim is not None:
        ds = (dim,) if isinstance(dim, int) else tuple(dim)
    elif size is not None and not isinstance(size, int):
        ds = tuple(range(-len(size), 0))
    elif default is None:
        ds = tuple(range(x.ndim))
    else:
        ds = tuple(range(-default, 0))
    return {normalize_dim(d, n, "fft dim") for d in ds}


def _empty_safe(fn: Any, xs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn`` on a block; a size-0 block of a free dim (MKL refuses it) gets the empty
    result of its shape and dtype, as torch gives for such an input on other backends."""
    if xs.numel() == 0:
        r = fn(torch.empty(tuple(xs.shape), dtype=xs.dtype, device="meta"), *args, **kwargs)
        return torch.zeros(tuple(r.shape), dtype=r.dtype, device=xs.device)
    return fn(xs, *args, **kwargs)


def _transform(fn: Any, default: int | None) -> Callable[..., Any]:
    """``fn(x, s_or_n, dim, norm)``; ``default`` transformed dims (1, 2, or None: all)."""
    def handler(x: Any, *args: Any, **kwargs: Any) -> Any:
        s = args[0] if args else kwargs.get("s", kwargs.get("n"))
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        whole = _dims(x, dim, s, default) if x.ndim else set()
        free = tuple(-1 if d in whole else d for d in range(x.ndim))
        return apply_free_dims(f"fft.{fn.__name__}",
                               lambda xs: _empty_safe(fn, xs, *args, **kwargs),
                               [x], [free], [free])

    return handler


for _name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"):
    _f = getattr(torch.fft, _name)
    register(_f)(_transform(_f, 1))
for _name in ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"):
    _f = getattr(torch.fft, _name)
    register(_f)(_transform(_f, 2))
for _name in ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"):
    _f = getattr(torch.fft, _name)
    register(_f)(_transform(_f, None))


def _shift(fn: Any) -> Callable[..., Any]:
    def handler(x: Any, dim: Any = None) -> Any:
        whole = _dims(x, dim, None, None) if x.ndim else set()
        free = tuple(-1 if d in whole else d for d in range(x.ndim))
        return apply_free_dims(f"fft.{fn.__name__}", lambda xs: fn(xs, dim), [x], [free], [free])

    return handler


register(torch.fft.fftshift)(_shift(torch.fft.fftshift))
register(torch.fft.ifftshift)(_shift(torch.fft.ifftshift))
