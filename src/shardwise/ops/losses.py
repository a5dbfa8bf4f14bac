"""Losses of ``torch.nn.functional`` on shardwise Tensors: cross_entropy, nll_loss,
linear_cross_entropy, the pointwise losses (binary cross entropy, smooth L1, Huber, KL,
Poisson and Gaussian NLL, margins...) and the per-sample ones (multi-margin, multilabel,
cosine embedding, triplet).

Invariants:
- Each loss runs torch's own loss with ``reduction="none"`` on the local blocks (rule
  ``pointwise_loss``: numpy broadcasting; rule ``per_sample``: the classes or features
  whole, samples shard), then reduces with the Partial-friendly ``sum``: ``"sum"`` and
  ``"mean"`` of a sharded batch leave Partial(SUM), no communication. A ``"mean"``
  divides by torch's own denominator (the element count; for class-weighted hard
  targets the summed weights of the counted samples), so values are torch's up to the
  order of the sum.
- Arguments without a rule (the deprecated ``size_average``/``reduce``, a custom
  ``distance_function``, shapes torch broadcasts its own way) fall back: exact values,
  a Replicated result, a warning.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.ops import compute
from shardwise.ops.conversions import to
from shardwise.ops.execute import apply
from shardwise.ops.linalg import whole
from shardwise.ops.registry import fallback, on_mesh, register
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


def _reduce(per: Any, reduction: str, name: str) -> Any:
    if reduction == "none":
        return per
    if reduction == "sum":
        return compute.sum(per)
    if reduction == "mean":
        return compute.mean(per)
    raise ValueError(f"{name}: {reduction!r} is not a valid value for reduction "
                     "('none', 'mean' or 'sum').")


def _bound(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    sig = inspect.signature(fn)
    b = sig.bind(*args, **kwargs)
    b.apply_defaults()
    return dict(b.arguments)


def _legacy(a: dict[str, Any]) -> bool:
    return a.get("size_average") is not None or a.get("reduce") is not None


def _run(rule: str, fn: Any, a: dict[str, Any], names: list[str], *params: Any) -> Any:
    """torch's ``fn`` with ``reduction="none"`` on the blocks of the tensors ``names``."""
    rest = {k: v for k, v in a.items() if k not in names}
    rest["reduction"] = "none"

    def call(*blocks: torch.Tensor) -> torch.Tensor:
        return fn(**rest, **dict(zip(names, blocks)))

    return apply(rule, on_mesh([a[n] for n in names]), call, *params)


def _pointwise(fn: Any, tensors: tuple[str, ...]) -> Callable[..., Any]:
    """A loss elementwise in its (broadcast) tensors, then reduced."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        a = _bound(fn, args, kwargs)
        names = [n for n in tensors if isinstance(a.get(n), torch.Tensor)]
        if _legacy(a) or any(isinstance(v, Tensor) for k, v in a.items() if k not in names):
            return fallback(fn, args, kwargs)
        reduction = a.get("reduction", "mean")
        if fn is F.gaussian_nll_loss and "var" in names:
            x, var = a["input"], a["var"]
            if tuple(var.shape) != tuple(x.shape) and tuple(var.shape) == tuple(x.shape[:-1]):
                # torch's unsqueeze
                a["var"] = compute.reshape(on_mesh([x, var])[1], (*var.shape, 1))
        per = _run("pointwise_loss", fn, a, names)
        if reduction == "batchmean":  # kl_div: the sum over the batch's size
            total = compute.sum(per)
            return compute.div(total, a["input"].shape[0]) if a["input"].ndim else total
        return _reduce(per, reduction, fn.__name__)

    return handler


_POINTWISE = {
    F.binary_cross_entropy: ("input", "target", "weight"),
    F.binary_cross_entropy_with_logits: ("input", "target", "weight", "pos_weight"),
    F.smooth_l1_loss: ("input", "target"),
    F.huber_loss: ("input", "target", "weight"),
    F.soft_margin_loss: ("input", "target"),
    F.kl_div: ("input", "target"),
    F.margin_ranking_loss: ("input1", "input2", "target"),
    F.hinge_embedding_loss: ("input", "target"),
    F.poisson_nll_loss: ("input", "target"),
    F.gaussian_nll_loss: ("input", "target", "var"),
}
for _fn, _tensors in _POINTWISE.items():
    register(_fn)(_pointwise(_fn, _tensors))


# --- per-sample losses: classes or features whole, samples shard ---------------------------
def _class_weighted_mean(per: Any, target: Any, weight: Any, ignore_index: int) -> Any:
    """nll_loss/cross_entropy's mean over hard targets: the sum over the summed weights
    of the counted samples (their count without a weight)."""
    total = compute.sum(per)
    kept = compute.ne(target, ignore_index)
    if weight is None:
        return compute.div(total, compute.sum(to(kept, per.dtype)))
    classes = weight.shape[0]

    def picked(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.where(t != ignore_index, w[t.clamp(0, classes - 1)], 0).to(per.dtype)

    return compute.div(total, compute.sum(apply("class_pick", on_mesh([target, weight]), picked)))


def _classes(fn: Any, roles: dict[str, str], weighted_mean: bool = False
             ) -> Callable[..., Any]:
    """A loss per sample of ``(N, C, d...)`` inputs (rule ``per_sample``; ``roles`` names
    each tensor argument's role), then reduced."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        a = _bound(fn, args, kwargs)
        names = [n for n in roles if isinstance(a.get(n), torch.Tensor)]
        if _legacy(a) or any(isinstance(v, Tensor) for k, v in a.items() if k not in names):
            return fallback(fn, args, kwargs)
        x = a[names[0]]
        kinds = "".join(roles[n] for n in names)
        if not _fits(x, [a[n] for n in names], kinds):  # torch's own shapes: all whole
            rest = {k: v for k, v in a.items() if k not in names}
            return whole(fn, on_mesh([a[n] for n in names]), lambda *bs: fn(
                **rest, **dict(zip(names, bs))), args, kwargs)
        per = _run("per_sample", fn, a, names, kinds)
        reduction = a.get("reduction", "mean")
        target = a.get("target")
        if reduction == "mean" and weighted_mean and target is not None and not (
                target.dtype.is_floating_point):
            weight = a.get("weight")
            ignore = a.get("ignore_index")
            return _class_weighted_mean(per, on_mesh([x, target])[1],
                                        None if weight is None else on_mesh([x, weight])[1],
                                        -100 if ignore is None else ignore)
        return _reduce(per, reduction, fn.__name__)

    return handler


def _fits(x: Any, ts: list[Any], kinds: str) -> bool:
    """The shapes the per-sample rule names: ``x`` (N, C, d...) or (C,), targets
    (N, d...) or (), soft targets x's shape, weights (C,)."""
    if x.ndim == 0:
        return False
    lead = tuple(x.shape[:1]) + tuple(x.shape[2:]) if x.ndim > 1 else ()
    for t, k in zip(ts, kinds):
        want = {"x": tuple(x.shape), "s": tuple(x.shape), "t": lead,
                "w": (x.shape[1 if x.ndim > 1 else 0],)}.get(k)
        if want is not None and tuple(t.shape) != want:
            return False
    return True


register(F.nll_loss)(_classes(F.nll_loss, {"input": "x", "target": "t", "weight": "w"},
                              weighted_mean=True))
register(F.multi_margin_loss)(_classes(F.multi_margin_loss,
                                       {"input": "x", "target": "t", "weight": "w"}))
register(F.multilabel_margin_loss)(_classes(F.multilabel_margin_loss,
                                            {"input": "x", "target": "s"}))
register(F.cosine_embedding_loss)(_classes(F.cosine_embedding_loss,
                                           {"input1": "x", "input2": "s", "target": "t"}))
register(F.triplet_margin_loss)(_classes(F.triplet_margin_loss,
                                         {"anchor": "x", "positive": "s", "negative": "s"}))
_ce = _classes(F.cross_entropy, {"input": "x", "target": "t", "weight": "w"},
               weighted_mean=True)
_ce_soft = _classes(F.cross_entropy, {"input": "x", "target": "s", "weight": "w"})


@register(F.cross_entropy)
def cross_entropy(*args: Any, **kwargs: Any) -> Any:
    a = _bound(F.cross_entropy, args, kwargs)
    target = a["target"]
    soft = isinstance(target, torch.Tensor) and target.dtype.is_floating_point
    return (_ce_soft if soft else _ce)(*args, **kwargs)


_mlsm = _classes(F.multilabel_soft_margin_loss, {"input": "x", "target": "s", "weight": "w"})


@register(F.multilabel_soft_margin_loss)
def multilabel_soft_margin_loss(*args: Any, **kwargs: Any) -> Any:
    a = _bound(F.multilabel_soft_margin_loss, args, kwargs)
    if a["input"].ndim > 2:  # torch's classes are the last dim, the rule's dim 1
        return fallback(F.multilabel_soft_margin_loss, args, kwargs)
    return _mlsm(*args, **kwargs)


_tmdl = _classes(F.triplet_margin_with_distance_loss,
                 {"anchor": "x", "positive": "s", "negative": "s"})


@register(F.triplet_margin_with_distance_loss)
def triplet_margin_with_distance_loss(*args: Any, **kwargs: Any) -> Any:
    a = _bound(F.triplet_margin_with_distance_loss, args, kwargs)
    dist = a.get("distance_function")
    if dist is not None and type(dist) is not nn.PairwiseDistance:
        # a user's distance may mix samples: it runs on the gathered values
        return fallback(F.triplet_margin_with_distance_loss, args, kwargs)
    return _tmdl(*args, **kwargs)


_lce = _classes(F.linear_cross_entropy, {"input": "x", "linear_weight": "l", "target": "t",
                                         "weight": "v"}, weighted_mean=True) if hasattr(
    F, "linear_cross_entropy") else None


def _linear_ce(*args: Any, **kwargs: Any) -> Any:
    fn = F.linear_cross_entropy
    a = _bound(fn, args, kwargs)
    x, w, t = a["input"], a["linear_weight"], a["target"]
    if x.ndim not in (1, 2) or w.ndim != 2 or a.get("linear_bias") is not None or (
            t.dtype.is_floating_point) or tuple(t.shape) != tuple(x.shape[:-1]) or (
            w.shape[1] != x.shape[-1]):  # torch's other shapes: every dim whole
        names = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
        rest = {k: v for k, v in a.items() if k not in names}
        return whole(fn, on_mesh([a[n] for n in names]), lambda *bs: fn(
            **rest, **dict(zip(names, bs))), args, kwargs)
    assert _lce is not None
    return _lce(*args, **kwargs)


if hasattr(F, "linear_cross_entropy"):
    register(F.linear_cross_entropy)(_linear_ce)
