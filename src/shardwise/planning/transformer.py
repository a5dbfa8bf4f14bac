"""The decoder the planner builds from a config: examples/gpt.py's GPT, or a Llama-style
one (grouped-query attention, SwiGLU, RMSNorm), with the same module names.

Invariants:
- Plain PyTorch: nothing here knows about shardwise; plans name its modules
  (``layers.*.attn.w[qkv]``, ``layers.*.attn.wo``, ``layers.*.mlp.w[123]``,
  ``embed.tok``, ``head``), as examples/gpt.py's but for the embedding, which is one
  child (``embed``) so that a pipeline can cut the model.
- ``ModelConfig.gpt()`` is examples/gpt.py's ``Config`` (learned positions, LayerNorm,
  a GELU MLP of 4x the width with biases, attention without them); a Llama config
  leaves the rotary position embedding out (elementwise work: a few percent of the
  memory traffic, none of the parameters).
- ``ModelConfig.from_hf`` reads a Hugging Face ``config.json`` (Llama, Mistral, Qwen2,
  GPT-2 names) and refuses one it cannot read, naming the keys it needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.sharding.errors import ShardingError

__all__ = ["ModelConfig", "Transformer", "loss_fn"]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's sizes: vocabulary, context, width, heads (and key/value heads),
    blocks, the MLP's hidden width; ``llama``: SwiGLU, RMSNorm, no learned positions.

    >>> ModelConfig.llama3_8b().parameters() / 1e9
    8.030261248
    """

    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    kv_heads: int = 0
    ff: int = 0
    llama: bool = False
    tied: bool = False
    name: str = "gpt"

    def __post_init__(self) -> None:
        for key in ("vocab", "seq", "dim", "heads", "layers"):
            if getattr(self, key) < 1:
                raise ShardingError(f"ModelConfig.{key} must be >= 1. Got {getattr(self, key)}.")
        if self.dim % self.heads or self.heads % self.kv:
            raise ShardingError(
                f"ModelConfig: the width ({self.dim}) must split into {self.heads} heads and "
                f"the heads into {self.kv} key/value groups. Got dim={self.dim}, "
                f"heads={self.heads}, kv_heads={self.kv}.")

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hidden(self) -> int:
        return self.ff or 4 * self.dim

    def parameters(self) -> int:
        """How many parameters the model has."""
        d, hd = self.dim, self.dim // self.heads
        attn = 2 * d * d + 2 * d * self.kv * hd
        mlp = 3 * d * self.hidden if self.llama else 2 * d * self.hidden + self.hidden + d
        norms = (2 if self.llama else 4) * d
        embed = self.vocab * d * (1 if self.tied else 2) + (0 if self.llama else self.seq * d)
        final = d if self.llama else 2 * d
        return self.layers * (attn + mlp + norms) + embed + final

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    @classmethod
    def gpt(cls, **sizes: Any) -> ModelConfig:
        """examples/gpt.py's GPT (its ``Config`` defaults, or ``sizes``)."""
        return cls(**sizes)

    @classmethod
    def llama3_8b(cls, seq: int = 8192) -> ModelConfig:
        """Llama-3-8B's sizes (32 layers, width 4096, 32 heads / 8 key-value, FF 14336,
        vocabulary 128256)."""
        return cls(vocab=128256, seq=seq, dim=4096, heads=32, layers=32, kv_heads=8,
                   ff=14336, llama=True, name="llama3-8b")

    @classmethod
    def llama3_70b(cls, seq: int = 8192) -> ModelConfig:
        """Llama-3-70B's sizes (80 layers, width 8192, 64 heads / 8 key-value, FF 28672)."""
        return cls(vocab=128256, seq=seq, dim=8192, heads=64, layers=80, kv_heads=8,
                   ff=28672, llama=True, name="llama3-70b")

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any], seq: int | None = None
                ) -> ModelConfig:
        """The sizes of a Hugging Face ``config.json`` (a path or its dict).

        >>> ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64,
        ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...     "intermediate_size": 128, "vocab_size": 100}, seq=32).kv
        2
        """
        raw = config if isinstance(config, dict) else json.loads(Path(config).read_text())
        kind = str(raw.get("model_type", ""))
        if kind == "gpt2" or "n_embd" in raw:
            need = ("n_embd", "n_layer", "n_head", "vocab_size")
            missing = [k for k in need if k not in raw]
            if not missing:
                return cls(vocab=raw["vocab_size"], seq=seq or raw.get("n_positions", 1024),
                           dim=raw["n_embd"], heads=raw["n_head"], layers=raw["n_layer"],
                           ff=raw.get("n_inner") or 0, tied=True, name=kind or "gpt2")
        else:
            need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            missing = [k for k in need if k not in raw]
            if not missing:
                return cls(vocab=raw["vocab_size"], seq=seq or min(
                    raw.get("max_position_embeddings", 4096), 8192),
                    dim=raw["hidden_size"], heads=raw["num_attention_heads"],
                    layers=raw["num_hidden_layers"],
                    kv_heads=raw.get("num_key_value_heads") or 0,
                    ff=raw.get("intermediate_size") or 0,
                    llama=raw.get("hidden_act", "silu") in ("silu", "swiglu"),
                    tied=bool(raw.get("tie_word_embeddings", False)), name=kind or "decoder")
        raise ShardingError(
            f"Cannot read the model sizes of this config: it lacks {missing}. Got keys "
            f"{sorted(raw)[:12]}; pass a decoder's config.json (Llama, Mistral, Qwen2, GPT-2).")


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        hd = c.dim // c.heads
        self.heads, self.kv = c.heads, c.kv
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv * hd, bias=False)
        self.wv = nn.Linear(c.dim, c.kv * hd, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (w(x).view(b, t, self.kv, -1).transpose(1, 2) for w in (self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.llama = c.llama
        self.w1 = nn.Linear(c.dim, c.hidden, bias=not c.llama)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=not c.llama)
        if c.llama:
            self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


def _norm(c: ModelConfig) -> nn.Module:
    return nn.RMSNorm(c.dim) if c.llama else nn.LayerNorm(c.dim)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = _norm(c), Attention(c), _norm(c), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token embedding (plus learned positions for a GPT): one child, so a pipeline's
    first stage holds both."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        if not c.llama:
            self.pos = nn.Embedding(c.seq, c.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if hasattr(self, "pos"):
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of (B, T, V) ``logits`` against ``targets``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


class Transformer(nn.Module):
    """A decoder of :class:`ModelConfig`'s sizes. Its forward applies its children in
    order (``embed``, ``layers``, ``norm``, ``head``), so ``pipeline`` can cut it;
    ``forward(idx)`` gives the logits, ``forward(idx, targets)`` the mean next-token
    cross-entropy (as examples/gpt.py's GPT).

    >>> model = Transformer(ModelConfig.gpt())
    >>> sum(p.numel() for p in model.parameters()) == ModelConfig.gpt().parameters()
    True
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = Embed(c)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = _norm(c)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return logits if targets is None else loss_fn(logits, targets)
