"""Mixed precision for ``fully_shard``: which dtype parameters are gathered in, which
dtype gradients are reduced in (FSDP2's ``MixedPrecisionPolicy``).

Invariants:
- The sharded parameters (what the optimizer sees) keep their own dtype: the cast
  to ``param_dtype`` happens on each device's shard *before* the all_gather, so the
  gather moves ``param_dtype`` bytes and the gathered value is ``param_dtype``.
- Gradients arrive in ``param_dtype``, are cast to ``reduce_dtype`` before the
  reduce_scatter and stored in the parameter's dtype.
- ``None`` means "no cast": a policy of ``None``s changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardwise.sharding.errors import ShardingTypeError
from shardwise.tensors.tensor import Tensor

__all__ = ["MixedPrecisionPolicy", "cast_floating"]


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """The dtypes of a ``fully_shard`` unit's gathered parameters and reduced gradients.

    Args:
        param_dtype: dtype the parameters are gathered in and the forward computes in
            (``None``: the parameters' own dtype).
        reduce_dtype: dtype the gradients are reduce-scattered in (``None``:
            ``param_dtype``, else the parameters' own dtype), as FSDP2.
        output_dtype: dtype the unit's floating outputs are cast to (``None``: kept).
        cast_forward_inputs: cast the unit's floating inputs to ``param_dtype`` (so
            that ``nn.Linear`` sees one dtype), as FSDP2.

    >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> policy.param_dtype, policy.reduce_dtype
    (torch.bfloat16, torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise ShardingTypeError(
                    f"MixedPrecisionPolicy({name}=...) needs a floating torch.dtype or None. "
                    f"Got {value!r}. Use e.g. {name}=torch.bfloat16."
                )


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` with every floating tensor in it (nested tuples, lists, dicts) cast to
    ``dtype``; other values unchanged.

    >>> cast_floating((torch.ones(2), 3, [torch.arange(2)]), torch.float64)
    (tensor([1., 1.], dtype=torch.float64), 3, [tensor([0, 1])])
    """
    if dtype is None:
        return value
    if isinstance(value, (Tensor, torch.Tensor)):
        return value.to(dtype) if value.dtype.is_floating_point and value.dtype != dtype else value
    if isinstance(value, tuple):
        return tuple(cast_floating(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value
