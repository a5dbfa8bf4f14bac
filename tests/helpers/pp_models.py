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


class _Split(nn.Module):
    """x -> (h, sign): a tuple whose second tensor takes no gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), (x.sum(-1, keepdim=True) > 0).to(torch.int64)


class _Join(nn.Module):
    """(h, sign) -> {"h": ..., "sign": ..., "n": 3}: a dict with a value leaf."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, sign: torch.Tensor) -> dict[str, Any]:
        return {"h": torch.tanh(self.lin(h)) * (1 + sign), "sign": sign, "n": 3}


class _Head(nn.Module):
    """{"h", "sign", "n"} -> (h, h2): a tuple of two tensors that both take gradients."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, d: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        assert d["n"] == 3 and not d["sign"].requires_grad
        h = self.lin(d["h"])
        return h, h * d["sign"]


class _Sum(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) + b




def structured_stages(width: int) -> list[nn.Module]:
    """Four stages passing values other than one tensor (seeded)."""
    torch.manual_seed(0)
    return [_Split(width), _Join(width), _Head(width), _Sum(width)]


def check_structured(pipe: Any, ref: Sequence[nn.Module], x: torch.Tensor,
                     t: torch.Tensor, m: int, loss: Callable[..., torch.Tensor],
                     losses: Sequence[Any], what: str) -> None:
    """The pipeline's losses (where the last stage is local) and the local stages'
    gradients equal single-device torch's on ``ref`` (copies of the stage modules)."""
    want = []
    for xi, ti in zip(x.tensor_split(m), t.tensor_split(m), strict=True):
        v0 = ref[0](xi)
        v1 = ref[1](*v0)
        v2 = ref[2](v1)
        want.append(loss(ref[3](*v2), ti))
    (sum(want) / m).backward()  # type: ignore[operator]
    if pipe.stages[-1].is_local:
        assert len(losses) == m, (what, losses)
    for a, b in zip(losses, want, strict=False):
        w = float(b.detach())
        assert abs(float(values(a)) - w) <= 1e-5 * abs(w), (what, a, w)
    local = [st for st in pipe.stages if st.is_local]
    assert local, what
    for st in local:
        pairs = list(zip(st.module.parameters(), ref[st.index].parameters(), strict=True))
        assert pairs, what
        for q, r in pairs:
            assert q.grad is not None and r.grad is not None, (what, st.index)
            assert_close(q.grad, r.grad, f"{what} stage {st.index} grad")
