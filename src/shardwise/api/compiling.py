"""``shardwise.compile_backend``: the ``torch.compile`` backend for code on shardwise
Tensors (its machinery: :mod:`shardwise.ops.compiling`)."""

from __future__ import annotations

from shardwise.ops.compiling import compile_backend

__all__ = ["compile_backend"]
