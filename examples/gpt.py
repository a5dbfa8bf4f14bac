"""A small GPT in ordinary PyTorch (nn.Linear, nn.Embedding, nn.LayerNorm, F.sdpa).

Nothing in the model knows about shardwise: tensor, sequence and fully sharded
data parallelism are applied from outside (``shardwise.parallel``). Tests and
benchmarks import the model from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    """Model size: vocabulary, context length, width, heads, blocks."""

    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, 4 * c.dim)
        self.w2 = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``idx`` (B, T) against ``targets``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def batch(c: Config, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and their next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, c.vocab, (size, c.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
