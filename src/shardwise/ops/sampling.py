"""Random ops on shardwise Tensors: bernoulli, normal, multinomial, the feature and alpha
dropouts, rrelu; their values are single-device torch's under the same seed.

Invariants:
- A random draw is made once, over the global shape, from torch's generator, in the
  order and dtype torch draws it, then laid out like the operand it meets; the
  arithmetic after the draw is torch's (same ops, same order), block by block. So the
  values equal single-device torch's for a seed, on every layout and in every process.
- ``bernoulli(p)``: torch draws one uniform per element (in ``p``'s dtype, or float32
  below it) and compares it with ``p``; the comparison runs shard-wise.
- Ops whose draws depend on the values (multinomial, rrelu in training) run on the
  ``"free_dims"`` rule with every dim whole: one call on the replicated value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute
from shardwise.ops.conversions import to
from shardwise.ops.execute import apply_elementwise
from shardwise.ops.free_dims import apply_free_dims
from shardwise.ops.registry import TensorMethod, on_mesh, register
from shardwise.tensors.tensor import Tensor, place

__all__: list[str] = []


def _like(value: torch.Tensor, x: Tensor) -> Tensor:
    """A drawn global ``value`` laid out like ``x`` (broadcast dims: see the mul rule)."""
    lay = x.dist_layout.without_partial()
    if value.shape != x.shape:  # a feature mask (N, C, 1, 1): replicated, sliced by mul
        return place(value, type(lay).replicated(lay.mesh, value.ndim))
    return place(value, lay)


# --- dropouts -------------------------------------------------------------------------------
def _feature_dropout(fn: Any) -> Callable[..., Any]:
    """``F.dropout2d``/``dropout3d``: torch's own call on ones of the global shape is its
    mask (``ones * noise == noise``), so ``x * mask`` is torch's ``x * noise``."""

    def handler(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0 or x.numel() == 0:
            return x
        mask = fn(torch.ones(tuple(x.shape), dtype=x.dtype, device=x.device), p, True)
        return compute.mul(x, _like(mask, x))

    return handler


register(F.dropout2d)(_feature_dropout(F.dropout2d))
register(F.dropout3d)(_feature_dropout(F.dropout3d))

_ALPHA = 1.7580993408473766  # SELU's alpha, as torch's Dropout.cpp


def _alpha_dropout(feature: bool) -> Callable[..., Any]:
    """torch's ``_dropout_impl`` (Dropout.cpp) with alpha, step by step in doubles."""

    def handler(x: Any, p: float = 0.5, training: bool = False, inplace: bool = False) -> Any:
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if p == 0 or not training or x.numel() == 0:
            return x
        if p == 1:
            return compute.mul(x, torch.zeros((), dtype=x.dtype, device=x.device))
        shape = tuple(x.shape)
        if feature:  # one draw per (sample, channel)
            shape = shape[:2] + (1,) * (len(shape) - 2)
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return compute.add(compute.mul(x, _like(noise, x)), _like(b, x))

    return handler


register(F.alpha_dropout)(_alpha_dropout(False))
register(F.feature_alpha_dropout)(_alpha_dropout(True))


@register(torch.ops.aten.native_dropout_backward.default,
          torch.ops.aten.native_dropout_backward)
def native_dropout_backward(grad: Any, mask: Any, scale: float) -> Any:
    """``grad * mask * scale`` elementwise: every dim shards freely."""
    free = tuple(range(grad.ndim))
    return apply_free_dims("native_dropout_backward",
                           lambda g, m: torch.ops.aten.native_dropout_backward(g, m, scale),
                           on_mesh([grad, mask]), [free, free], [free])


# --- draws over the global shape ------------------------------------------------------------
@register(torch.bernoulli, TensorMethod.bernoulli)
def bernoulli(x: Any, p: Any = None, *, generator: Any = None) -> Any:
    if p is not None:  # a scalar probability: x gives only the shape and dtype
        drawn = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
        return _zero_grad_of(_like(drawn.bernoulli_(p, generator=generator), x), x)
    if bool(compute.lt(x, 0).any()) or bool(compute.gt(x, 1).any()):
        raise RuntimeError("Expected p_in >= 0 && p_in <= 1 to be true, but got false.  "
                           "(bernoulli on a shardwise.Tensor of probabilities)")
    draw = torch.float64 if x.dtype == torch.float64 else torch.float32
    u = torch.rand(tuple(x.shape), dtype=draw, device=x.device, generator=generator)
    return _zero_grad_of(to(compute.lt(_like(u, x), x), x.dtype), x)


def _zero_grad_of(drawn: Any, x: Any) -> Any:
    """``drawn``, in x's graph with a zero gradient (torch's bernoulli: its derivative
    with respect to the probabilities is zero, and the sample requires grad)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return drawn
    return compute.with_zero_grad(drawn, x)


@register(torch.normal)
def normal(mean: Any, std: Any = 1.0, *args: Any, generator: Any = None, **kwargs: Any
           ) -> Any:
    """torch's ``normal_out_impl``: a standard draw of the broadcast shape, then
    ``mul_(std)`` and ``add_(mean)`` (a scalar std scales the draw itself)."""
    if args or kwargs or not any(isinstance(t, Tensor) for t in (mean, std)):
        return torch.normal(*[t.to_torch() if isinstance(t, Tensor) else t
                              for t in (mean, std, *args)], generator=generator, **kwargs)
    like = mean if isinstance(mean, Tensor) else std
    if isinstance(std, Tensor) and bool(compute.lt(std, 0).any()):
        raise RuntimeError("normal expects all elements of std >= 0.0")
    if isinstance(std, torch.Tensor):
        shape = torch.broadcast_shapes(tuple(mean.shape) if isinstance(mean, torch.Tensor)
                                       else (), tuple(std.shape))
        z = torch.empty(shape, dtype=like.dtype, device=like.device).normal_(
            0, 1, generator=generator)
        return apply_elementwise("elementwise", [_on(z, like), std, mean], _scaled)
    z = torch.empty(tuple(mean.shape), dtype=mean.dtype, device=mean.device).normal_(
        0, float(std), generator=generator)
    return apply_elementwise("elementwise", [_on(z, mean), mean], _shifted)


def _scaled(z: torch.Tensor, std: Any, mean: Any) -> torch.Tensor:
    with torch.no_grad():  # torch's normal_out_impl: mul_(std) then add_(mean)
        value = z * std + mean
    return compute.ZeroGrad.apply(value, False, std, mean)


def _shifted(z: torch.Tensor, mean: Any) -> torch.Tensor:
    with torch.no_grad():
        value = z + mean
    return compute.ZeroGrad.apply(value, False, mean)


def _on(z: torch.Tensor, like: Tensor) -> Tensor:
    lay = like.dist_layout.without_partial()
    if tuple(z.shape) == tuple(like.shape):
        return place(z, lay)
    return place(z, type(lay).replicated(lay.mesh, z.ndim))


@register(torch.multinomial, TensorMethod.multinomial)
def multinomial(x: Any, num_samples: int, replacement: bool = False, *,
                generator: Any = None) -> Any:
    """Each row's draws follow the previous rows': one call on the whole value."""
    whole = (-1,) * x.ndim
    return apply_free_dims("multinomial", lambda s: torch.multinomial(
        s, num_samples, replacement, generator=generator), [x], [whole])


@register(F.rrelu)
def rrelu(x: Any, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False,
          inplace: bool = False) -> Any:
    """In training a slope is drawn per negative element (the draws follow the values):
    one call on the whole value; in eval it is elementwise, every dim free."""
    free = (-1,) * x.ndim if training else tuple(range(x.ndim))
    return apply_free_dims("rrelu", lambda s: F.rrelu(s, lower, upper, training), [x], [free],
                           [free])
