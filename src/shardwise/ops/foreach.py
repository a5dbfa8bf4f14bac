"""torch's ``_foreach_*`` ops (``torch.optim``, ``clip_grad_norm_``) on lists of shardwise
Tensors.

Invariants:
- ``torch._foreach_op(lists...)`` is the per-tensor op over the lists, each call routed
  as usual, so each tensor keeps its own layout and its own rule.
- An in-place ``_foreach_op_`` writes each tensor through the in-place handlers and
  returns None, as torch's does; one without a per-tensor op raises, naming the loop.
- ``_foreach_norm`` is the exception: each tensor's reduction stays Partial, the
  reductions with one layout are stacked and reduced together (one all_reduce per
  distinct group of mesh axes, not one per tensor), then each norm is finished; the
  values are the per-tensor ``vector_norm``'s.
- shardwise Tensors are foreach-capable for ``torch.utils._foreach_utils`` (as DTensor
  registers itself), so ``clip_grad_norm_`` and ``get_total_norm`` take that path by
  default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.utils._foreach_utils as foreach_utils

from shardwise.ops.reductions import norm_reduction
from shardwise.ops.registry import TensorMethod, register
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor

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


@register(torch._foreach_norm)
def foreach_norm(tensors: Any, ord: Any = 2, dtype: Any = None) -> list[Any]:
    """The norm of each tensor, the shardwise ones' reductions reduced together: one
    all_reduce per distinct layout of the reductions (the mesh axes that shard them).

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> rows = PlacementMapping(mesh, [Sharded(0), Replicated()])
    >>> both = PlacementMapping(mesh, [Sharded(0), Sharded(1)])
    >>> ts = [shardwise.tensor(torch.ones(4, 4), sharding=s) for s in (rows, both, both)]
    >>> with shardwise.debug.CommCounter() as cc:
    ...     norms = torch._foreach_norm(ts)
    >>> [float(n) for n in norms], cc.counts   # over dp; over dp and tp (two tensors)
    ([4.0, 4.0, 4.0], Counter({'all_reduce': 2}))
    """
    out: list[Any] = [None] * len(tensors)
    # stacked only with the same layout and dtype (stack would promote a mix)
    groups: dict[tuple[Layout, Any], list[tuple[int, Any, Callable[[Any], Any]]]] = {}
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            out[i] = torch.linalg.vector_norm(x, ord, dtype=dtype)
            continue
        total, finish = norm_reduction(x, ord, dtype=dtype)
        groups.setdefault((total.dist_layout, total.dtype), []).append((i, total, finish))
    for (layout, _), members in groups.items():
        stacked = cast(Tensor, torch.stack([total for _, total, _ in members]))
        # one collective for the group (a no-op when nothing is Partial)
        norms = members[0][2](stacked.relayout(Layout.replicated(layout.mesh, 1)))
        for j, (i, _, _) in enumerate(members):
            out[i] = norms[j]
    return out


def _foreach_capable() -> None:
    """Let ``torch.utils._foreach_utils._has_foreach_support`` accept shardwise Tensors
    (DTensor appends itself likewise), so ``clip_grad_norm_``'s default path is
    ``_foreach_norm`` above instead of one ``vector_norm`` (one all_reduce) per gradient."""
    if Tensor not in foreach_utils._foreach_supported_types:
        # typed as torch.Tensor types; shardwise's Tensor is a torch.Tensor at run time
        foreach_utils._foreach_supported_types.append(Tensor)  # type: ignore[arg-type]


_foreach_capable()
