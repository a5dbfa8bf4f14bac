"""torch.nn.functional ops a transformer uses, on shardwise Tensors: linear, matmul and
einsum, layer/rms norm, embedding, dropout, scaled_dot_product_attention, cross_entropy
and pointwise losses.

Invariants:
- Each op names the dims that must stay whole (normalized dims, the vocabulary,
  keys and values, classes) in its rule; batch and head dims shard freely.
- ``F.linear`` with whole-valued operands runs torch's own addmm once (torch's bits);
  the add rule still lays the bias out and decides the output layout.
- Dropout draws its mask over the global shape from torch's generator, as
  single-device torch does, then lays it out like the input.
- Arguments without a rule (class weights, dropout inside attention, the deprecated
  ``size_average``/``reduce``) fall back: exact values, a Replicated result, a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute as C
from shardwise.ops.conversions import to
from shardwise.ops.execute import apply
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, register
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.tensor import Tensor, place

__all__: list[str] = []


@register(F.linear)
def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    if bias is not None and all(isinstance(t, Tensor) and t._whole is not None
                                for t in (x, weight, bias)):
        # whole values: torch's own addmm on them (one node, torch's bits); the add
        # rule still lays the bias out and decides the output layout
        b = bias._whole
        if comm.active() and b.requires_grad and torch.is_grad_enabled():
            b = b.view_as(b)  # the bias's gradient passes here: counted by the add
        y = apply("linear", (x, weight), lambda xs, ws: F.linear(xs, ws, b))
        return apply("add", (y, bias), lambda ys, _: ys, views={1: b})
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
    ops = on_mesh([ids, weight]) if not isinstance(ids, Tensor) else [ids, weight]
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
    mask = place(noise, x.dist_layout.without_partial())
    return C.mul(x, mask)


@register(F.scaled_dot_product_attention)
def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:
    if dropout_p or (enable_gqa and q.shape[-3:-2] != k.shape[-3:-2]):
        # dropout inside attention, or grouped keys and values: no rule yet
        return fallback(F.scaled_dot_product_attention, (q, k, v, attn_mask, dropout_p,
                                                         is_causal), {
            "scale": scale, "enable_gqa": enable_gqa})
    ops = [q, k, v] + ([attn_mask] if attn_mask is not None else [])

    def local(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
              *m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, m[0] if m else None, 0.0,
                                              is_causal, scale=scale)

    return apply("sdpa", on_mesh(ops), local, bool(is_causal))


@register(F.cross_entropy)
def cross_entropy(logits: Any, target: Any, weight: Any = None, size_average: Any = None,
                  ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Any:
    if weight is not None or size_average is not None or reduce is not None or (
            logits.ndim != 2 or target.ndim != 1 or target.dtype.is_floating_point):
        return fallback(F.cross_entropy, (logits, target), dict(
            weight=weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing))
    ops = on_mesh([logits, target])
    per = apply("cross_entropy", ops, lambda lg, tg: F.cross_entropy(
        lg, tg, ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing))
    if reduction == "none":
        return per
    total = C.sum(per)
    if reduction == "sum":
        return total
    count = C.sum(to(C.ne(ops[1], ignore_index), per.dtype))
    return C.div(total, count)


def _pointwise_loss(fn: Any, term: Callable[[Any], Any]) -> Callable[..., Any]:
    """``F.mse_loss``/``F.l1_loss``: ``term(a - b)`` summed or averaged by the rule table;
    the deprecated ``size_average``/``reduce`` and a ``weight`` fall back."""

    def loss(a: Any, b: Any, size_average: Any = None, reduce: Any = None,
             reduction: str = "mean", weight: Any = None) -> Any:
        if size_average is not None or reduce is not None or weight is not None:
            return fallback(fn, (a, b), dict(size_average=size_average, reduce=reduce,
                                             reduction=reduction))
        per = term(C.sub(*on_mesh([a, b])))
        return per if reduction == "none" else (C.sum(per) if reduction == "sum"
                                                 else C.mean(per))

    return loss


def _square(d: Any) -> Any:
    return C.mul(d, d)


register(F.mse_loss)(_pointwise_loss(F.mse_loss, _square))
register(F.l1_loss)(_pointwise_loss(F.l1_loss, C.abs_))


@register(F.nll_loss)
def nll_loss(*args: Any, **kwargs: Any) -> Any:
    return fallback(F.nll_loss, args, kwargs)
