"""A tiny mixture-of-experts GPT (torchtitan's MoE shapes) trained with expert parallelism.

``gpt.py``'s GPT with each block's MLP replaced by a mixture of experts: a top-k router
with torchtitan's load-balancing bias, SwiGLU experts in torchtitan's shape (``w1 [E, H,
D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]``), tokens sorted by expert within each sequence.
Nothing in the model knows about shardwise. From outside (:func:`parallelize`):
``ExpertParallel`` lays the experts over ``dp`` (dp2ep: ep borrowed from dp), tensor
parallelism covers attention and the head over ``tp``, and ``fully_shard`` shards the
dense parts over ``dp``. Every step's loss is checked against single-device torch.

    python examples/moe_gpt.py                          # simulated 2x2 mesh (dp x tp)
    python examples/moe_gpt.py --mesh 4x1 --capacity-factor 4   # fixed slots, none dropped
    torchrun --nproc-per-node 4 examples/moe_gpt.py     # 4 Gloo processes, 2x2
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


def _gpt() -> Any:
    """``gpt.py`` as a module (examples/ is not a package), under the one name the
    tests and benchmarks load it by."""
    name = "shardwise_example_gpt"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("gpt.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up here
        spec.loader.exec_module(mod)
    return mod


gpt = _gpt()


@dataclass(frozen=True)
class Config(gpt.Config):  # type: ignore[misc,name-defined]
    """``gpt.Config`` plus the experts: how many, how many per token, their width, and
    the load-balancing bias's step (None: no bias)."""

    experts: int = 4
    top_k: int = 2
    hidden: int = 32
    load_balance_coeff: float | None = 1e-3


class TopKRouter(nn.Module):
    """torchtitan's token-choice router: sigmoid scores of a gate; each token's top
    ``top_k`` experts are chosen on the scores plus a per-expert load-balancing bias,
    and weighted by the unbiased scores."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> gates and expert ids ``[B, T, k]``, and each sequence's
        tokens per expert ``[B, E]``."""
        scores = torch.sigmoid(self.gate(x).float())
        if expert_bias is None:
            gates, ids = torch.topk(scores, self.top_k, dim=-1)
        else:  # the bias steers the choice only
            ids = torch.topk(scores + expert_bias, self.top_k, dim=-1).indices
            gates = scores.gather(-1, ids)
        flat = ids.flatten(1)
        counts = flat.new_zeros(x.shape[0], self.experts).scatter_add(
            1, flat, torch.ones_like(flat))
        return gates, ids, counts


class GroupedExperts(nn.Module):
    """SwiGLU experts in torchtitan's shape, one loop per expert (torchtitan's
    ``_run_experts_for_loop``, which reads the counts on the host)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [N, D]`` sorted by expert (within each of the G groups of
        ``num_tokens_per_expert [E]`` or ``[G, E]``) -> ``[N, D]``."""
        w1, w2, w3 = self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)
        rows = x.split([int(n) for n in num_tokens_per_expert.reshape(-1).tolist()])
        out = []
        for i, r in enumerate(rows):
            e = i % len(w1)
            out.append((F.silu(r @ w1[e].T) * (r @ w3[e].T)) @ w2[e].T)
        return torch.cat(out)


class MoE(nn.Module):
    """Route each token to its top-k experts (sorted by expert within its sequence),
    run them, and sum their gated outputs back per token (torchtitan's ``MoE``)."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.router = TopKRouter(c.dim, c.experts, c.top_k)
        self.experts = GroupedExperts(c.dim, c.hidden, c.experts)
        self.load_balance_coeff = c.load_balance_coeff
        self.register_buffer("expert_bias", torch.zeros(c.experts)
                             if c.load_balance_coeff is not None else None)
        self.register_buffer("tokens_per_expert", torch.zeros(c.experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        gates, ids, counts = self.router(x, self.expert_bias)
        with torch.no_grad():  # for the bias update, outside autograd
            self.tokens_per_expert = self.tokens_per_expert + counts.sum(0)
        order = torch.argsort(ids.flatten(1), dim=1, stable=True)  # by expert, per sequence
        token = (order // ids.shape[-1]).unsqueeze(-1).expand(-1, -1, d)
        routed = x.gather(1, token).flatten(0, 1)
        out = self.experts(routed, counts).view(b, -1, d)
        out = out * gates.flatten(1).gather(1, order).unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).scatter_add(1, token, out)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """torchtitan's auxiliary-loss-free balancing: move each expert's bias by the
        coefficient toward the mean load (sign only, centred), then restart the count."""
        if self.expert_bias is None:
            return
        load = self.tokens_per_expert
        step = self.load_balance_coeff * torch.sign(load.mean() - load)
        self.expert_bias = self.expert_bias + (step - step.mean())
        self.tokens_per_expert = torch.zeros_like(load)


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = gpt.Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.moe = MoE(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(gpt.GPT):  # type: ignore[misc,name-defined]
    """``gpt.GPT`` with :class:`Block` (attention, then the mixture of experts)."""

    block = Block

    def update_expert_bias(self) -> None:
        for layer in self.layers:
            layer.moe.update_expert_bias()


def parallelize(model: MoEGPT, mesh: Any, *, capacity_factor: float | None = None,
                fsdp: bool = True) -> MoEGPT:
    """dp2ep: the experts over ``dp`` (``ExpertParallel``), attention and the head over
    ``tp`` (Megatron), the dense parts fully sharded over ``dp`` (per block, then root)."""
    from shardwise import Sharded
    from shardwise.parallel import (
        ColwiseParallel,
        ExpertParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
    )

    parallelize_module(model, mesh, {"layers.*.attn.w[qkv]": ColwiseParallel(),
                                     "layers.*.attn.wo": RowwiseParallel(),
                                     "head": ColwiseParallel(output_layouts=Sharded(-1))},
                       axis="tp")
    parallelize_module(model, mesh, {"layers.*.moe.experts": ExpertParallel(
        capacity_factor=capacity_factor)}, axis="dp")
    if fsdp:
        experts = {p for layer in model.layers for p in layer.moe.experts.parameters()}
        for layer in model.layers:
            fully_shard(layer, mesh, axis="dp", ignored_params=experts)
        fully_shard(model, mesh, axis="dp", ignored_params=experts)
    return model


def main(argv: list[str] | None = None) -> int:
    """Train the MoE GPT with dp2ep x TP x FSDP; exit 1 if a loss differs from torch."""
    import argparse
    import copy

    import shardwise as sw
    from shardwise import PlacementMapping, Replicated, Sharded
    from shardwise.debug import CommCounter
    from shardwise.distributed import maybe_initialize, process_count, shutdown
    from shardwise.parallel import loss_parallel

    p = argparse.ArgumentParser(description="Train a tiny MoE GPT with expert parallelism.")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--mesh", default="2x2", help="dp x tp (ep = dp), e.g. 4x1")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="fixed expert capacity (no host read of the counts); parity with "
                        "the dropless reference holds while no expert overflows (a factor of "
                        "at least the expert count never does)")
    args = p.parse_args(argv)
    multi = maybe_initialize(backend="gloo")
    dp, tp = (int(v) for v in args.mesh.split("x"))
    mesh = sw.DeviceMesh.cpu((dp, tp), ("dp", "tp"))
    cfg = Config()
    torch.manual_seed(0)
    reference = MoEGPT(cfg)
    model = parallelize(copy.deepcopy(reference), mesh, capacity_factor=args.capacity_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    where = f"torch.distributed, {process_count()} processes" if multi else "simulated"
    gpt._say(f"MoE GPT ({cfg.experts} experts, top {cfg.top_k}) on DeviceMesh(dp={dp}, "
             f"tp={tp}), experts over dp ({where})")
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))
    rows: list[tuple[int, float, float]] = []
    comm = None
    for step in range(args.steps):
        ids, targets = gpt.batch(cfg, args.batch, step)
        with CommCounter() as counter, loss_parallel():
            loss = model(sw.tensor(ids, sharding=data), sw.tensor(targets, sharding=data))
            loss.backward()
        opt.step()
        opt.zero_grad()
        model.update_expert_bias()
        want = reference(ids, targets)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.update_expert_bias()
        rows.append((step, loss.item(), want.item()))
        comm = counter
    if comm is not None:
        gpt._say(f"collectives per step: forward {dict(comm.counts)}, backward "
                 f"{dict(comm.backward_counts)}")
    ok = gpt.parity(rows, args.rtol)
    if multi:
        shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
