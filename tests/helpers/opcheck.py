"""``check(fn, inputs)``: a torch function on shardwise Tensors against plain torch, for
ops with one or several outputs (tuples, torch's named tuples).

Each case runs twice: whole-value leaves (the op runs once on the global values:
bit-identical to torch, asserted) and block leaves (one local call per block:
``allclose``, since a per-block kernel may round apart). Values, dtypes, shapes and
the gradients of every floating input are compared, and a fallback warning fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import shardwise as sw
from shardwise import PlacementMapping, Replicated
from shardwise.ops.registry import ShardwiseFallbackWarning
from shardwise.sharding import DeviceMesh

R = Replicated()


def pm(mesh: DeviceMesh, *placements: Any) -> PlacementMapping:
    return PlacementMapping(mesh, list(placements))


def _outputs(r: Any) -> list[Any]:
    return list(r) if isinstance(r, (tuple, list)) else [r]


def check(fn: Callable[..., Any], inputs: Sequence[Any], *, grad: bool | int = True,
          rtol: float = 1e-5, atol: float = 1e-6, exact_whole: bool = True) -> None:
    """``fn`` on ``inputs`` (``(value, PlacementMapping)`` pairs become shardwise Tensors;
    other items pass as they are) equals ``fn`` on the plain values. ``grad``: whether
    floating inputs require grad (an int ``k``: only the first ``k`` inputs)."""
    for whole in (True, False):
        ts: list[Any] = []
        refs: list[Any] = []
        for i, item in enumerate(inputs):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(
                    item[1], PlacementMapping):
                value, mapping = item
                g = (grad is True or (grad is not False and i < grad)) and (
                    value.is_floating_point() or value.is_complex())
                if whole:
                    t = sw.tensor(value, sharding=mapping)
                    t = t.requires_grad_() if g else t
                else:
                    t = sw.tensor(value, sharding=mapping, requires_grad=g)
                ts.append(t)
                refs.append(value.clone().requires_grad_(g))
            else:
                ts.append(item)
                refs.append(item)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardwiseFallbackWarning)
            got = _outputs(fn(*ts))
        want = _outputs(fn(*refs))
        assert len(got) == len(want)
        for g_, w_ in zip(got, want):
            assert isinstance(g_, sw.Tensor), type(g_)
            v = g_.to_torch()
            assert v.dtype == w_.dtype and v.shape == w_.shape, (v.dtype, v.shape, w_.dtype,
                                                                  w_.shape)
            if whole and exact_whole:
                assert torch.equal(v.isnan(), w_.isnan()) and torch.equal(
                    v.nan_to_num(), w_.detach().nan_to_num()), (v, w_)
            else:
                torch.testing.assert_close(v, w_.detach(), rtol=rtol, atol=atol,
                                           equal_nan=True)
        diff = [(g_, w_) for g_, w_ in zip(got, want)
                if w_.requires_grad and (w_.is_floating_point() or w_.is_complex())]
        if not diff:
            continue
        gen = torch.Generator().manual_seed(3)
        weights = [torch.randn(w_.shape, generator=gen, dtype=w_.real.dtype).to(w_.dtype)
                   for _, w_ in diff]
        sum((g_.to_torch() * k).abs().sum() if g_.is_complex() else (g_.to_torch() * k).sum()
            for (g_, _), k in zip(diff, weights)).backward()
        sum((w_ * k).abs().sum() if w_.is_complex() else (w_ * k).sum()
            for (_, w_), k in zip(diff, weights)).backward()
        for t, r in zip(ts, refs):
            if isinstance(t, sw.Tensor) and t.requires_grad:
                want_g = r.grad if r.grad is not None else torch.zeros_like(r)
                assert t.grad is not None
                torch.testing.assert_close(t.grad.to_torch(), want_g, rtol=1e-4, atol=1e-5)
