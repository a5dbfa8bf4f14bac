"""torch's ``_foreach_*`` ops (``torch.optim``, ``clip_grad_norm_``) on lists of shardwise
Tensors.

Invariants:
- ``torch._foreach_op(lists...)`` is the per-tensor op over the lists, each call routed
  as usual, so each tensor keeps its own layout and its own rule.
- An in-place ``_foreach_op_`` writes each tensor through the in-place handlers and
  returns None, as torch's does; one without a per-tensor op raises, naming the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.ops.registry import TensorMethod, register
from shardwise.sharding.errors import ShardingError

__all__: list[str] = []


def _foreach(name: str) -> Callable[..., Any]:
    """``torch._foreach_op(lists...)`` as the per-tensor op over the lists."""
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    plain = base.rstrip("_")
    per: Any = getattr(TensorMethod, base, None) if inplace else (
        getattr(torch, base, None) or getattr(TensorMethod, base, None))
    if base == "norm":
        per = torch.linalg.vector_norm
    if per is None and inplace and hasattr(torch, plain):
        op = getattr(torch, plain)

        def per(x: Any, *args: Any, **kwargs: Any) -> Any:
            return x.copy_(op(x, *args, **kwargs))
    if per is None:
        def per(*args: Any, **kwargs: Any) -> Any:
            raise ShardingError(f"torch.{name} has no shardwise rule; loop over the tensors "
                                "with the per-tensor op instead.")

    def handler(*args: Any, **kwargs: Any) -> Any:
        n = len(args[0])
        out = []
        for i in range(n):
            call = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = kwargs
            if plain in ("addcmul", "addcdiv") and len(call) > 3:  # value is keyword-only
                kw = {**kwargs, "value": call.pop()}
            out.append(per(*call, **kw))
        return None if inplace else out

    return handler


for _name in dir(torch):
    if _name.startswith("_foreach_"):
        register(getattr(torch, _name))(_foreach(_name))
