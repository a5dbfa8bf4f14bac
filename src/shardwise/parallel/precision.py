"""Mixed precision for ``fully_shard``: which dtype parameters are gathered in, which
dtype gradients are reduced in (FSDP2's ``MixedPrecisionPolicy``).

Invariants:
- The sharded parameters (what the optimizer sees) keep their own dtype: the cast
  to ``param_dtype`` happens on each device's shard *before* the all_gather, so the
  gather moves ``param_dtype`` bytes and the gathered value is ``param_dtype``.
- Gradients arrive in ``param_dtype``, are cast to ``reduce_dtype`` before the
  reduce_scatter and stored in the parameter's dtype.
- ``None`` means "no cast": a policy of ``None``s changes nothing.
- Under ``torch.compile`` a unit's hooks are :func:`compiled_hooks` (Dynamo traces this
  module): the parameters' casts are graph ops on the sharded parameters, each op
  gathering as it needs; the cast's backward brings gradients back to the
  parameter's dtype. On processes the graph sums the gradients' shares in
  ``param_dtype`` (the relayout's backward, before the cast's): a unit whose
  ``reduce_dtype`` differs says so once, with a warning, when a graph is compiled
  (:func:`warn_reduce_in_graph`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardwise.sharding.errors import ShardingTypeError
from shardwise.tensors.tensor import Tensor
from shardwise.tensors.traced import ON_COMPILE

__all__ = ["MixedPrecisionPolicy", "cast_floating", "compiled_hooks", "warn_reduce_in_graph"]

#: units whose policy reduces in another dtype than it computes in, on a process mesh
#: (compiled, their gradients are summed in param_dtype), until each has been warned of
_REDUCE_APART: weakref.WeakSet[Any] = weakref.WeakSet()


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


def compiled_hooks(unit: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The forward pre- and post-hooks that compiled code runs for a ``fully_shard``
    unit (``unit``: its ``params``, each with ``sharded`` and ``owners``, and its
    ``policy``): before the forward each parameter's module holds it cast to
    ``param_dtype`` (a graph op on the sharded parameter) and the floating inputs are
    cast; after it the modules hold the sharded parameters again and the floating
    outputs are cast to ``output_dtype``. Dynamo traces both (no shardwise Python is
    called: torch functions and attributes only).

    >>> class Unit:
    ...     params, policy = [], MixedPrecisionPolicy(param_dtype=torch.float64)
    >>> before, after = compiled_hooks(Unit())
    >>> before(None, (torch.ones(1),), {})[0][0].dtype
    torch.float64
    """

    policy = unit.policy
    if (policy.reduce_dtype is not None and policy.param_dtype is not None
            and policy.reduce_dtype != policy.param_dtype and not unit.local):
        _REDUCE_APART.add(unit)

    def before(module: nn.Module, args: Any, kwargs: Any) -> Any:
        policy = unit.policy
        dtype = policy.param_dtype
        if dtype is None:
            return args, kwargs
        for fp in unit.params:
            cast = fp.sharded.to(dtype)
            for owner, name in fp.owners:
                owner._parameters[name] = cast
        if policy.cast_forward_inputs:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)
        return args, kwargs

    def after(module: nn.Module, args: Any, output: Any) -> Any:
        for fp in unit.params:
            for owner, name in fp.owners:
                owner._parameters[name] = fp.sharded
        return cast_floating(output, unit.policy.output_dtype)

    return before, after


def warn_reduce_in_graph() -> None:
    """Warn once per ``fully_shard`` unit on a process mesh whose ``reduce_dtype``
    differs from its ``param_dtype``: compiled, its gradients' shares are summed in
    ``param_dtype`` (run by ``shardwise.compile_backend`` when it compiles a graph).

    >>> warn_reduce_in_graph()  # (no such unit)
    """
    for unit in list(_REDUCE_APART):
        _REDUCE_APART.discard(unit)
        policy = unit.policy
        warnings.warn(
            f"fully_shard(mp_policy={policy}) on {unit.mesh!r} under torch.compile: the "
            f"compiled graph sums the gradients' shares over the FSDP axis in param_dtype "
            f"({policy.param_dtype}), not in reduce_dtype ({policy.reduce_dtype}) as eager "
            "code does (gradients differ by a few ulps of param_dtype). Run the step "
            "eagerly where reduce_dtype matters, or pass reduce_dtype=None to accept the "
            "graph's reduction.", UserWarning, stacklevel=3)


ON_COMPILE.append(warn_reduce_in_graph)
