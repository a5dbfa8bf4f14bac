"""``parallelize_module``: apply a plan of parallel styles to an ordinary ``nn.Module``.

Invariants:
- A plan is one style (for the module itself) or a dict of submodule name patterns
  to styles. A pattern is matched one dotted component at a time with ``fnmatch``
  (``"layers.*.attn.wq"``: ``*`` stands for one component, e.g. a block index);
  every pattern must match at least one submodule.
- Styles apply in the plan's order; the module is changed in place and returned.
- A parameter shared by several planned modules (tied weights) stays one parameter,
  with one layout (styles that disagree on it raise).
- Submodules no pattern matches keep their parameters as they are (plain torch
  tensors stay plain: mixed into an op with shardwise Tensors they are Replicated).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch.nn as nn

from shardwise.parallel import replicas
from shardwise.parallel.hf import gather_on_save, name_matches
from shardwise.parallel.placing import axis_of, keeping_ties
from shardwise.parallel.style import ParallelStyle
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["parallelize_module"]

M = TypeVar("M", bound=nn.Module)


def _style(value: object, where: str) -> ParallelStyle:
    if not isinstance(value, ParallelStyle):
        raise ShardingTypeError(
            f"The plan maps {where} to {value!r}, which is not a parallel style. Use "
            "ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...) "
            "or PrepareModuleOutput(...).")
    return value


def parallelize_module(module: M, mesh: DeviceMesh,
                       plan: ParallelStyle | Mapping[str, ParallelStyle],
                       axis: str | None = None) -> M:
    """Lay ``module`` out over one mesh axis as ``plan`` says (tensor / sequence parallel).

    Args:
        module: an ordinary ``nn.Module``; changed in place: the planned submodules'
            parameters become ``nn.Parameter`` over shardwise Tensors (Replicated on the
            other mesh axes) and forward hooks lay their inputs and outputs out. A
            transformers model's ``save_pretrained`` then writes global values
            (:func:`~shardwise.parallel.hf.gather_on_save`).
        mesh: the DeviceMesh, e.g. ``DeviceMesh.cpu((2, 4), ("dp", "tp"))``.
        plan: a style for ``module`` itself, or a dict of submodule names (fnmatch
            patterns per dotted component, e.g. ``"layers.*.attn.wq"``) to styles.
        axis: the mesh axis to parallelize over; default: the only axis of a 1-D mesh,
            else ``"tp"``.

    Returns:
        ``module``.

    Megatron's MLP on a 2x2 mesh (the batch stays Sharded over ``dp``)::

        device (dp,tp)  (0,0)        (0,1)        (1,0)        (1,1)
        0.weight        W1[0:32]     W1[32:64]    W1[0:32]     W1[32:64]
        2.weight        W2[:, 0:32]  W2[:, 32:64] W2[:, 0:32]  W2[:, 32:64]

    >>> from shardwise.parallel import ColwiseParallel, RowwiseParallel
    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
    ...                           torch.nn.Linear(64, 16))
    >>> mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> mlp[0].weight.placements, mlp[2].weight.placements
    ((Replicated(), Sharded(axis=0)), (Replicated(), Sharded(axis=1)))
    >>> x = shardwise.tensor(torch.randn(8, 16), sharding=PlacementMapping(
    ...     mesh, [Sharded(0), Replicated()]))
    >>> with shardwise.debug.CommCounter() as cc:
    ...     y = mlp(x)
    >>> y.placements, dict(cc.counts)        # one all_reduce, at w2's output
    ((Sharded(axis=0), Replicated()), {'all_reduce': 1})
    """
    if not isinstance(module, nn.Module):
        raise ShardingTypeError(f"parallelize_module takes an nn.Module. Got "
                                f"{type(module).__name__}.")
    a = axis_of(mesh, axis)
    gather_on_save(module)  # a transformers model's save_pretrained writes global values
    replicas.track(module)  # the replica check names parameters from the root
    if isinstance(plan, ParallelStyle):
        with keeping_ties():
            plan.apply(module, mesh, a, "")
        return module
    if not isinstance(plan, Mapping):
        raise ShardingTypeError(
            f"plan is a parallel style or a dict of submodule names to styles. Got "
            f"{type(plan).__name__}; e.g. {{'layers.*.mlp.w1': ColwiseParallel()}}.")
    named = dict(module.named_modules())
    found: list[tuple[str, ParallelStyle]] = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise ShardingTypeError(f"Plan keys are submodule names (str). Got {pattern!r}.")
        st = _style(style, repr(pattern))
        hits = [n for n in named if n and name_matches(pattern, n)]
        if not hits:
            names = [n for n in named if n]
            shown = ", ".join(names[:24]) + (f", ... ({len(names)} in all)"
                                             if len(names) > 24 else "")
            raise ShardingError(
                f"Plan pattern {pattern!r} matches no submodule of {type(module).__name__}. "
                f"Its submodules are: {shown or '(none)'}. Patterns match whole dotted "
                "names one component at a time ('layers.*.attn.wq'); fix the name.")
        found += [(n, st) for n in hits]
    with keeping_ties():
        for name, st in found:
            st.apply(named[name], mesh, a, name)
    return module
