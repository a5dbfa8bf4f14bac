"""Models for the pipeline tests: examples/gpt_pp.py's GPT (a forward that chains its
children, so ``pipeline(model, split_points=...)`` can cut it) and its TP plan per stage,
at a tiny size, and a single-device oracle of one pipelined step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from examples.gpt_pp import Embed, PipeGPT, gpt, loss_fn, tp_plan
from examples.gpt_pp import stage_plan as plan_for

__all__ = ["Embed", "PipeGPT", "TP_PLAN", "config", "loss_fn", "make", "plan_for"]

TP_PLAN = tp_plan()


def config(layers: int = 4) -> Any:
    return gpt.Config(vocab=32, seq=8, dim=16, heads=2, layers=layers)


def make(layers: int = 4, seed: int = 0) -> PipeGPT:
    torch.manual_seed(seed)
    return PipeGPT(config(layers))


def batch(c: Any, size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt.batch(c, size, step)


def reference(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, m: int,
              loss: Callable[..., torch.Tensor] = loss_fn) -> tuple[list[float], torch.Tensor]:
    """Single-device torch: per-microbatch losses and the output; ``.grad`` of the mean
    loss accumulates into ``model``'s parameters."""
    outs, losses = [], []
    for x, t in zip(inputs.tensor_split(m), target.tensor_split(m), strict=True):
        out = model(x)
        losses.append(loss(out, t))
        outs.append(out.detach())
    (sum(losses) / m).backward()  # type: ignore[operator]
    return [float(v.detach()) for v in losses], torch.cat(outs)


def values(t: Any) -> torch.Tensor:
    """A plain torch value of a torch or shardwise tensor."""
    import shardwise as sw

    return t.detach().to_torch() if isinstance(t, sw.Tensor) else t.detach()


def assert_close(got: Any, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    g = values(got)
    assert g.shape == want.shape and g.dtype == want.dtype, (what, g.shape, want.shape)
    torch.testing.assert_close(g, want, rtol=rtol, atol=rtol * float(want.abs().max()) + 1e-7,
                               msg=lambda s: f"{what}: {s}")


def assert_grads(pairs: Sequence[tuple[str, Any]], ref: nn.Module, rtol: float = 1e-5) -> None:
    got = dict(pairs)
    want = dict(ref.named_parameters())
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, q in want.items():
        assert got[name].grad is not None, f"{name}: no gradient"
        assert q.grad is not None
        assert_close(got[name].grad, q.grad, f"grad of {name}", rtol)
