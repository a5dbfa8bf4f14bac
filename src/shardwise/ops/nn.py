"""torch.nn.functional ops a transformer uses, on shardwise Tensors: linear, matmul and
einsum, layer/rms norm, embedding, dropout, scaled_dot_product_attention, the mse and l1
losses (cross_entropy, nll_loss and the other losses: :mod:`shardwise.ops.losses`).

Invariants:
- Each op names the dims that must stay whole (normalized dims, the vocabulary,
  keys and values, classes) in its rule; batch and head dims shard freely.
- ``F.linear`` where the runtime runs it on whole values (``cache.runs_whole``: an
  algorithm valid only there) runs torch's own addmm once (torch's bits); the add
  rule still lays the bias out and decides the output layout. On blocks, where
  the linear rule's decision (taken first) leaves an add that would keep its output
  layout and read the bias whole (a replicated bias of the input's dtype, recording no gradient;
  an output neither Partial nor split on its last dim), the bias goes into the same
  local ``F.linear`` call.
- Dropout draws its mask over the global shape from torch's generator, as
  single-device torch does, then lays it out like the input.
- Dropout inside attention draws its noise over the attention weights' global shape as
  torch's math kernel (its CPU path) does, then runs that kernel op for op per block
  (float32/float64; other dtypes fall back).
- Arguments without a rule (class weights, the deprecated ``size_average``/``reduce``)
  fall back: exact values, a Replicated result, a warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute, matmuls
from shardwise.ops.execute import apply, decision_of, records
from shardwise.ops.registry import TensorMethod, describe, fallback, on_mesh, register
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor, place

__all__: list[str] = []


def _whole_bias(*operands: Any) -> torch.Tensor | None:
    """The bias (the last operand) as the whole value an op runs on, where the runtime
    runs the op once on whole values (every operand a Tensor holding one); else None.
    While CommCounter counts, an identity view of it: the bias's gradient passes there,
    counted by the add."""
    if not all(isinstance(t, Tensor) for t in operands) or not cache.runs_whole(operands):
        return None
    b = cache.whole_of(operands[-1])
    assert b is not None
    if comm.active() and b.requires_grad and torch.is_grad_enabled():
        b = b.view_as(b)
    return b


@register(F.linear)
def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    if bias is None:
        return apply("linear", (x, weight), F.linear)
    dec = decision_of("linear", (x, weight))
    b = _bias_block(bias) if dec is not None and _adds_in_place(dec.output, x, bias) else None
    if b is None:
        b = _whole_bias(x, weight, bias)
        if b is not None:
            # whole values: torch's own addmm on them (one node, torch's bits); the add
            # rule still lays the bias out and decides the output layout
            y = apply("linear", (x, weight), lambda xs, ws: F.linear(xs, ws, b))
            return apply("add", (y, bias), lambda ys, _: ys, views={1: b})
        return compute.add(apply("linear", (x, weight), F.linear), bias)
    # the add would keep y's layout and use the bias whole: one call, torch's addmm
    return apply("linear", (x, weight), lambda xs, ws: F.linear(xs, ws, b))


def _adds_in_place(out: Layout, x: Tensor, bias: Any) -> bool:
    """Whether ``y + bias`` (``y`` laid out as ``out``) is ``F.linear``'s own bias add on
    each block: a bias of x's dtype, fully replicated, recording no gradient (no
    diverge to sum), and an output neither Partial (the bias would be added once per
    term) nor split on its last dim (each block needs all of the bias)."""
    return (isinstance(bias, Tensor) and bias.dtype is x.dtype
            and bias.dist_layout.is_fully_replicated and not out.is_partial
            and not out.dims[-1] and not records(bias))


def _bias_block(bias: Tensor) -> torch.Tensor | None:
    """The one buffer every device here holds of a replicated bias (None if they hold
    several: replicas on several torch devices)."""
    held = [s for s in bias.shards if s is not None]
    first = held[0] if held else None
    return first if all(s is first for s in held) else None


@register(torch.matmul, TensorMethod.matmul, TensorMethod.__matmul__, torch.mm,
          TensorMethod.mm, torch.bmm, TensorMethod.bmm)
def matmul(a: Any, b: Any) -> Any:
    return compute.matmul(a, b)


@register(torch.addmm, TensorMethod.addmm)
def addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1, out: Any = None) -> Any:
    """``bias + a @ b`` (transformers' ``Conv1D``): the matmul rule, then the add rule."""
    if out is not None or beta != 1 or alpha != 1:
        return matmuls.scaled_addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    w = _whole_bias(a, b, bias)
    if w is not None:
        # whole values: torch's own addmm once (torch's bits), as F.linear does
        y = apply("matmul", (a, b), lambda xs, ys: torch.addmm(w, xs, ys))
        return apply("add", (y, bias), lambda ys, _: ys, views={1: w})
    return compute.add(compute.matmul(a, b), bias)


@register(TensorMethod.__rmatmul__)
def rmatmul(a: Any, b: Any) -> Any:
    return compute.matmul(b, a)


@register(torch.einsum)
def einsum(equation: str, *operands: Any) -> Any:
    return compute.einsum(equation, *operands)


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
              norm_type: float = 2.0, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    if max_norm is not None:
        raise ShardingError(
            f"Cannot run F.embedding(max_norm={max_norm}) on a shardwise.Tensor table "
            f"({describe([weight])}): it renormalizes the looked-up rows of the table in "
            "place, a write with no sharding rule. Got max_norm; renormalize those rows "
            "yourself under torch.no_grad() (table[ids] = ...) and call without it.")
    if scale_grad_by_freq or sparse:
        # each id's gradient is scaled by its count over all the ids (or made sparse),
        # which no block of ids sees: torch's own call on the gathered values
        return fallback(F.embedding, (ids, weight, padding_idx, max_norm, norm_type,
                                      scale_grad_by_freq, sparse), {})
    ops = on_mesh([ids, weight]) if not isinstance(ids, Tensor) else [ids, weight]
    return apply("embedding", ops, lambda i, w: F.embedding(i, w, padding_idx))


@register(F.dropout, torch.dropout)
def dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return compute.mul(x, 0.0)
    # torch's CPU dropout: mask = empty_like(x).bernoulli_(1 - p) / (1 - p); x * mask.
    # Drawn over the global shape, so values equal single-device torch's for a seed.
    noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise.div_(1 - p)
    mask = place(noise, x.dist_layout.without_partial())
    return compute.mul(x, mask)


@register(F.scaled_dot_product_attention)
def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
         is_causal: bool = False, *, scale: Any = None, enable_gqa: bool = False) -> Any:
    # torch's signature: scale and enable_gqa are keyword-only (a 7th positional
    # argument is torch's TypeError here too)
    if dropout_p and q.dtype not in (torch.float32, torch.float64):
        return fallback(F.scaled_dot_product_attention, (q, k, v, attn_mask, dropout_p,
                                                         is_causal),
                        dict(scale=scale, enable_gqa=enable_gqa))
    ops = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
    groups = 1
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            raise ShardingError(
                f"scaled_dot_product_attention(enable_gqa=True): the query heads "
                f"({q.shape[-3]}) must be a multiple of the key/value heads "
                f"({k.shape[-3]}), as torch requires. Got q {list(q.shape)}, "
                f"k {list(k.shape)}.")
        groups = q.shape[-3] // k.shape[-3]
    if dropout_p:
        # torch's CPU kernel for dropout is its math path, which draws the noise over the
        # attention weights' global shape: drawn here the same way, then cut like them
        shape = (*torch.broadcast_shapes(q.shape[:-2], (*k.shape[:-3], q.shape[-3])),
                 q.shape[-2], k.shape[-2])
        noise = torch.zeros(shape, dtype=q.dtype) if dropout_p == 1 else torch.empty(
            shape, dtype=q.dtype).bernoulli_(1 - dropout_p).div_(1 - dropout_p)
        ops.append(noise)

        def dropped(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                    *rest: torch.Tensor) -> torch.Tensor:
            return _math_sdpa(qs, ks, vs, rest[0] if len(rest) == 2 else None, rest[-1],
                              is_causal, scale, groups)

        return apply("sdpa", on_mesh(ops), dropped, bool(is_causal), groups, True)

    def local(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
              *m: torch.Tensor) -> torch.Tensor:
        # each device holds whole groups: its query heads are `groups` x its kv heads
        return F.scaled_dot_product_attention(qs, ks, vs, m[0] if m else None, 0.0,
                                              is_causal, scale=scale,
                                              enable_gqa=bool(enable_gqa))

    return apply("sdpa", on_mesh(ops), local, bool(is_causal), groups)


def _math_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               noise: torch.Tensor, causal: bool, scale: Any, groups: int) -> torch.Tensor:
    """torch's math attention (``_scaled_dot_product_attention_math``, its CPU path with
    dropout) op for op, with the dropout noise given: bit for bit torch's value."""
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    f = math.sqrt(abs(s))  # q and k each scaled by sqrt(scale), for stability
    q = q * (-f if s < 0 else f)
    if groups > 1:
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    attn = q @ (k.transpose(-2, -1) * f)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(
                mask.logical_not(), float("-inf"))
        attn = attn + mask
    return (torch._safe_softmax(attn, -1) * noise) @ v


def _pointwise_loss(fn: Any, term: Callable[[Any], Any]) -> Callable[..., Any]:
    """``F.mse_loss``/``F.l1_loss``: ``term(a - b)`` summed or averaged by the rule table;
    the deprecated ``size_average``/``reduce`` and a ``weight`` fall back."""

    def loss(a: Any, b: Any, size_average: Any = None, reduce: Any = None,
             reduction: str = "mean", weight: Any = None) -> Any:
        if size_average is not None or reduce is not None or weight is not None:
            return fallback(fn, (a, b), dict(size_average=size_average, reduce=reduce,
                                             reduction=reduction))
        per = term(compute.sub(*on_mesh([a, b])))
        return per if reduction == "none" else (compute.sum(per) if reduction == "sum"
                                                 else compute.mean(per))

    return loss


def _square(d: Any) -> Any:
    return compute.mul(d, d)


register(F.mse_loss)(_pointwise_loss(F.mse_loss, _square))
register(F.l1_loss)(_pointwise_loss(F.l1_loss, compute.abs_))
