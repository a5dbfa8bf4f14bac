"""Expert parallelism's oracles, shared by the simulated tests and the Gloo bodies: the
single-device per-expert loop, an experts module that never reads the counts on the
host, a counter of host reads, and routed inputs.

Invariants:
- :func:`expert_loop` is the reference: for each group and expert, its rows through
  that expert's SwiGLU (the first ``capacity`` of them when given; the others 0).
- :class:`MaskedExperts` computes the same values with no host read (every expert on
  every row, the right one kept): what a grouped GEMM does on an accelerator.
- :class:`HostReads` counts the torch calls that read a tensor's values on the host
  (``tolist``, ``item``, ``bool``...), on the threads it is entered in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from benchmarks.common import example

moe_gpt = example("moe_gpt")
GroupedExperts = moe_gpt.GroupedExperts


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
           ) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def expert_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Each group's rows of each expert through that expert, one at a time."""
    table = counts.reshape(-1, w1.shape[0]).tolist()
    pieces, at = [], 0
    for row in table:
        for e, n in enumerate(int(v) for v in row):
            kept = n if capacity is None else min(n, capacity)
            pieces.append(swiglu(x[at:at + kept], w1[e], w2[e], w3[e]))
            pieces.append(x.new_zeros(n - kept, x.shape[1]))
            at += n
    return torch.cat(pieces)


class MaskedExperts(GroupedExperts):  # type: ignore[misc,valid-type]
    """:class:`GroupedExperts` without a host read: each row's expert from the counts by
    device arithmetic, every expert run on every row and the right one kept."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        experts = self.w1.shape[0]
        ends = torch.cumsum(num_tokens_per_expert.reshape(-1), 0)
        rows = torch.arange(x.shape[0], device=x.device)
        expert = (torch.searchsorted(ends, rows, right=True) % experts).unsqueeze(1)
        out = torch.zeros_like(x)
        for e in range(experts):
            out = torch.where(expert == e, swiglu(x, self.w1[e], self.w2[e], self.w3[e]), out)
        return out


_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
          torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero, torch.masked_select,
          torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.Tensor.cpu}


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads:`` counts host reads of tensor values in
    ``reads.calls`` (names), on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _READS:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def routed(rows: int, dim: int, experts: int, groups: int, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[rows, dim]`` and counts ``[groups, experts]`` (each group's rows split
    among the experts at random, some experts empty)."""
    g = torch.Generator().manual_seed(seed)
    per = rows // groups
    counts = torch.zeros(groups, experts, dtype=torch.int64)
    for k in range(groups):
        ids = torch.randint(0, experts, (per,), generator=g)
        ids[ids == k % experts] = (k + 1) % experts  # an expert with no rows in group k
        counts[k] = torch.bincount(ids, minlength=experts)
    return torch.randn(rows, dim, generator=g), counts


def experts_module(experts: int, dim: int, hidden: int, seed: int = 0,
                   cls: type = GroupedExperts) -> Any:
    torch.manual_seed(seed)
    return cls(dim, hidden, experts)
