"""torch functions on shardwise Tensors: the registry behind ``Tensor.__torch_function__``.

Every ``torch.*`` function, ``Tensor`` method or operator and ``torch.nn.functional``
op called with a shardwise Tensor arrives here as ``(func, args, kwargs)``.

Invariants:
- Each call resolves to exactly one of: a registered handler (sharding propagation
  through :func:`shardwise.ops.execute.apply`, values equal to torch's on the global
  tensor), a metadata query answered by the wrapper itself, or the fallback.
- The fallback never gives a wrong value: an op without a rule runs on the gathered
  global operands and returns a Replicated result, warning once per op by name
  (:class:`ShardwiseFallbackWarning`); an in-place op or ``out=`` call without a rule
  raises, naming the op (writing into a gathered copy would be lost silently).
- In-place ops write each distinct local buffer once (replicas share one buffer), so
  ``torch.optim`` updates a sharded parameter exactly as it would the global one.
- Plain torch tensors mixed with shardwise Tensors are treated as Replicated on the
  Tensor's mesh (every process must hold the same value), like JAX's numpy arrays.
"""

from __future__ import annotations

from shardwise.ops import torch_elementwise, torch_nn, torch_shapes
from shardwise.ops.registry import ShardwiseFallbackWarning, _fallback, register
from shardwise.tensors.tensor import FALLBACK, HANDLERS

__all__ = ["ShardwiseFallbackWarning", "install", "register"]


def install() -> None:
    """Fill the registry (idempotent)."""
    if FALLBACK:
        return
    torch_elementwise.install()
    torch_shapes.install()
    torch_nn.install()
    HANDLERS.pop(None, None)
    FALLBACK.append(_fallback)


install()
