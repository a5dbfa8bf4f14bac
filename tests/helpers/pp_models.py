"""Models for the pipeline tests: examples/gpt.py's blocks in a GPT whose forward is a
sequence of top-level children (so ``pipeline(model, split_points=...)`` can cut it),
its TP plan per stage, and a single-device oracle of one pipelined step."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import example_gpt
from shardwise.parallel import ColwiseParallel, RowwiseParallel

gpt = example_gpt()


class Embed(nn.Module):
    """Token plus position embedding: one child, so a stage holds both."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class PipeGPT(nn.Module):
    """examples/gpt.py's GPT returning logits, its forward a chain of its children."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        self.embed = Embed(c)
        self.layers = nn.ModuleList(gpt.Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def config(layers: int = 4) -> Any:
    return gpt.Config(vocab=32, seq=8, dim=16, heads=2, layers=layers)


def make(layers: int = 4, seed: int = 0) -> PipeGPT:
    torch.manual_seed(seed)
    return PipeGPT(config(layers))


def batch(c: Any, size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt.batch(c, size, step)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


TP_PLAN = {"layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
           "layers.*.mlp.w1": ColwiseParallel(), "layers.*.mlp.w2": RowwiseParallel(),
           "head": ColwiseParallel()}


def plan_for(module: nn.Module, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The entries of ``plan`` (default: TP_PLAN) that match a submodule of ``module``
    (a stage holds only some of the model's modules)."""
    names = [n for n, m in module.named_modules() if n and not isinstance(m, nn.Identity)]
    return {k: v for k, v in (plan or TP_PLAN).items()
            if any(fnmatch.fnmatchcase(n, k) for n in names)}


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
